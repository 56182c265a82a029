"""ReLUs that keep a mask in place of an output a quantized layer keeps as codes (hf_cpt/nn/relu_masks.py)."""

from __future__ import annotations

import contextlib
import copy
import weakref

import pytest
import torch
from torch import nn

from hf_cpt import CPTConfig, dequantize_model, quantize_model, set_precision
from hf_cpt.nn.precision import PrecisionState
from hf_cpt.nn.relu_masks import FunctionalReLUs, hand_over_input, kept_output_of, relu_handing_over
from hf_cpt.numerics import mask_kernels

HANDING_OVER = "_ReLUHandingOverBackward"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("handed_over", [False, True])
def test_the_gradient_is_relus_bit_for_bit(inplace, handed_over, dtype):
    """Zeros of both signs, NaN and infinities in the output and in the error: the error passes where the output is
    not <= 0 and is +0.0 elsewhere, as ``ReluBackward0`` makes it, bit for bit."""
    special = [-2.0, -0.0, 0.0, 1e-30, 3.0, float("nan"), float("inf"), -float("inf")]
    source = torch.cat([torch.tensor(special), torch.randn(56)]).to(dtype).requires_grad_()
    error = torch.cat([torch.randn(56), torch.tensor(special)]).to(dtype)
    error[:8] = torch.tensor([-1.0, 2.0, -0.0, float("nan"), -3.0, -0.0, float("inf"), 5.0])  # meets each output
    reference = torch.relu(source * 1.0)
    (expected,) = torch.autograd.grad(reference, source, error)
    x = source * 1.0  # a non-leaf: the in-place ReLU applies
    output = relu_handing_over(x, inplace)
    assert output.grad_fn.name() == HANDING_OVER and (output is x) == inplace
    if handed_over:
        hand_over_input(output, saved=None, state=PrecisionState())
        kept = kept_output_of(output.grad_fn)
        assert kept.output is None and kept.zeroed.dtype == torch.bool
    (got,) = torch.autograd.grad(output, source, error)
    torch.testing.assert_close(output, reference, rtol=0, atol=0, equal_nan=True)
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
    assert got.dtype == dtype and torch.equal(got.view(bits), expected.view(bits))


def test_an_in_place_relu_of_a_view_runs_as_autograds():
    source = torch.randn(4, 6, requires_grad=True)
    gradients = []
    for relu in (torch.relu_, lambda t: relu_handing_over(t, True)):
        source.grad = None
        x = source * 1.0
        relu(x[:, :3])  # edits x through the view
        (x * torch.arange(6.0)).sum().backward()
        gradients.append(source.grad.clone())
    assert torch.equal(*gradients)


def test_an_output_edited_in_place_fails_the_backward_as_with_autograds_relu():
    for relu in (torch.relu, lambda t: relu_handing_over(t, False)):
        output = relu(torch.randn(8, requires_grad=True) * 1.0)
        output.add_(1.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            output.sum().backward()


def test_a_layer_keeping_the_tensor_itself_leaves_the_relu_its_output():
    state = PrecisionState()
    output = relu_handing_over(torch.randn(8, requires_grad=True) * 1.0, False)
    hand_over_input(output, saved=output, state=state)  # the layer keeps x: the float stays, no mask beside it
    assert kept_output_of(output.grad_fn).output is not None
    edited = output * 1.0
    hand_over_input(edited, saved=None, state=state)  # not a converted ReLU's output: nothing to hand over
    assert kept_output_of(output.grad_fn).output is not None
    assert not state.functional_relus
    hand_over_input(torch.relu(torch.randn(8, requires_grad=True)), saved=None, state=state)  # autograd's ReLU
    assert state.functional_relus


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),  # fed by a BatchNorm
        nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),  # the second ReLU's reader: quantized, or kept in FP32
        nn.Flatten(), nn.Linear(8 * 8 * 8, 16), nn.ReLU(), nn.Linear(16, 4),  # a ReLU MLP on float products
    )


def _quantized(model: nn.Module, masks: bool, **options) -> nn.Module:
    model = copy.deepcopy(model)
    settings = {"quant_scheme": "paper", "integer_matmul": False, "include_modules": ["8"], **options}
    report = quantize_model(model, CPTConfig(relu_masks=masks, **settings))
    set_precision(model, 6, 8)
    model.train()
    model.cpt_report = report
    return model


def _step(model: nn.Module, x: torch.Tensor) -> tuple[list, dict, list]:
    """(the ReLU nodes of one training forward, the gradients of its backward, what each converted ReLU kept before
    the backward: (its output, its mask))."""
    model.zero_grad(set_to_none=True)
    outputs, hooks = [], [m.register_forward_hook(lambda m, i, o: outputs.append(o)) for m in model
                          if isinstance(m, nn.ReLU)]
    torch.manual_seed(1)  # the same stochastic rounding of the errors
    loss = model(x).square().sum()
    for hook in hooks:
        hook.remove()
    nodes = [o.grad_fn for o in outputs]
    kept = [(k.output, k.zeroed) for k in map(kept_output_of, nodes) if k is not None]
    loss.backward()
    return nodes, {name: p.grad.clone() for name, p in model.named_parameters()}, kept


@pytest.mark.parametrize("batch", [4, 64])
@pytest.mark.parametrize("integer", [False, True])
def test_a_cnn_keeps_masks_and_codes_and_trains_bit_for_bit(integer, batch):
    """Every ReLU feeding a quantized layer keeps a mask (the layer its codes): the gradients of the model whose ReLUs
    keep their outputs, bit for bit. A mask is one bit per value where the native kernel serves the output (float32,
    at least `NATIVE_MIN_NUMEL` values: the convolutions' ReLUs at batch 64), else a bool tensor. A ReLU fed by a
    product on codes recomputes its input instead."""
    packed = batch == 64
    if packed and mask_kernels._library() is None:
        pytest.skip("no C compiler on this machine")
    model, x = _cnn(), torch.randn(batch, 3, 8, 8)
    masked = _quantized(model, True, integer_matmul=integer)
    assert masked.cpt_report.relu_masks == ["2", "5", "9"] and "ReLUs that keep a mask" in str(masked.cpt_report)
    nodes, gradients, kept = _step(masked, x)
    last = "_ActivationOfRecomputedInputBackward" if integer else HANDING_OVER
    assert [node.name() for node in nodes] == [HANDING_OVER, HANDING_OVER, last]
    assert len(kept) == (2 if integer else 3)
    assert all(output is None for output, _ in kept)
    values = batch * 8 * 8 * 8  # a convolution's ReLU output
    assert values >= mask_kernels.NATIVE_MIN_NUMEL if packed else values < mask_kernels.NATIVE_MIN_NUMEL
    for _, zeroed in kept[:2]:
        assert (zeroed.dtype, zeroed.numel()) == ((torch.uint8, values // 8) if packed else (torch.bool, values))
    assert all(zeroed.dtype == torch.bool for _, zeroed in kept[2:])  # the MLP's ReLU: 16 values a row
    plain = _quantized(model, False, integer_matmul=integer)
    assert plain.cpt_report.relu_masks == []
    plain_nodes, expected, _ = _step(plain, x)
    assert [node.name() for node in plain_nodes] == ["ReluBackward0"] * 2 + [last if integer else "ReluBackward0"]
    assert gradients.keys() == expected.keys()
    for name in expected:
        assert torch.equal(gradients[name], expected[name]), name
    dequantize_model(masked)
    assert all(type(m) is nn.ReLU for m in masked if isinstance(m, nn.ReLU))


def test_a_relu_read_by_a_full_precision_layer_keeps_its_output():
    masked = _quantized(_cnn(), True, exclude_modules=["6"])
    _, _, kept = _step(masked, torch.randn(4, 3, 8, 8))
    assert [output is None for output, _ in kept] == [True, False, True]


def test_the_mask_goes_with_the_backward_that_read_it_while_the_loss_lives_on():
    """A loop that keeps its loss until the next forward keeps the graph, but autograd frees what its nodes saved once
    the backward has run: the masks go too. With ``retain_graph`` they stay, and a second backward gives the same
    gradients; a backward after the graph is freed fails as autograd's own."""
    masked = _quantized(_cnn(), True)
    outputs = []
    hooks = [m.register_forward_hook(lambda m, i, o: outputs.append(o)) for m in masked if isinstance(m, nn.ReLU)]
    loss = masked(torch.randn(4, 3, 8, 8)).square().sum()
    for hook in hooks:
        hook.remove()
    nodes = [o.grad_fn for o in outputs]
    masks = [kept_output_of(node).zeroed for node in nodes]
    assert all(mask is not None for mask in masks)
    freed = [weakref.ref(mask) for mask in masks]
    del masks
    torch.manual_seed(1)
    loss.backward(retain_graph=True)
    first = [p.grad.clone() for p in masked.parameters()]
    assert all(kept_output_of(node) is not None for node in nodes)
    masked.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    loss.backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(first, masked.parameters()))
    assert all(kept_output_of(node) is None for node in nodes) and all(ref() is None for ref in freed)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()


def test_under_saved_tensor_hooks_and_in_eval_the_relu_runs_as_before():
    """Checkpointing and offloading hooks see what a node saves: the ReLU keeps its output there as autograd does."""
    masked = _quantized(_cnn(), True)
    x = torch.randn(4, 3, 8, 8)
    outputs = []
    hooks = [m.register_forward_hook(lambda m, i, o: outputs.append(o)) for m in masked if isinstance(m, nn.ReLU)]
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        masked(x)
    with torch.no_grad():
        masked(x)
    for hook in hooks:
        hook.remove()
    assert [o.grad_fn.name() for o in outputs[:3]] == ["ReluBackward0"] * 3
    assert all(o.grad_fn is None for o in outputs[3:])


def test_a_timm_resnet_hands_over_every_relu_a_convolution_reads_and_trains_bit_for_bit():
    """timm's ResNet-18 (in-place ReLU modules, each called once per block or twice): every ReLU output a quantized
    convolution reads is kept as a mask, and the stem's, which the max-pool reads (it keeps its indices alone,
    `hf_cpt.nn.pool_indices`); the last block's, read by the pooling head, keeps its output; the gradients are those
    without masks, bit for bit."""
    timm = pytest.importorskip("timm")

    torch.manual_seed(0)
    base = timm.create_model("resnet18", num_classes=10)
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([1, 7])
    gradients = []
    for masks in (True, False):
        model = copy.deepcopy(base)
        quantize_model(model, CPTConfig(relu_masks=masks))
        set_precision(model, 6, 8)
        model.train()
        outputs: list[torch.Tensor] = []
        hooks = [m.register_forward_hook(lambda m, i, o, record=outputs.append: record(o)) for m in model.modules()
                 if isinstance(m, nn.ReLU)]
        torch.manual_seed(1)
        loss = nn.functional.cross_entropy(model(x), y)
        for hook in hooks:
            hook.remove()
        if masks:
            assert len(outputs) == 17 and all(o.grad_fn.name() == HANDING_OVER for o in outputs)
            assert [kept_output_of(o.grad_fn).output is None for o in outputs] == [True] * 16 + [False]
        loss.backward()
        gradients.append([p.grad for p in model.parameters()])
    for got, expected in zip(*gradients):
        assert torch.equal(got, expected)


def _method_relu(t: torch.Tensor) -> torch.Tensor:
    return t.relu()


def _relu_in_place(t: torch.Tensor) -> torch.Tensor:
    return nn.functional.relu(t, inplace=True)


class _FunctionalCNN(nn.Module):
    """Convolutions after ReLUs called as functions, each way model code calls one; records their outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(3 if i == 0 else 8, 8, 3, padding=1) for i in range(6))
        self.norms = nn.ModuleList(nn.BatchNorm2d(8) for _ in range(5))
        self.relus = [torch.relu, nn.functional.relu, _method_relu, _relu_in_place, torch.relu_]
        self.outputs: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.outputs = []
        for conv, norm, relu in zip(self.convs, self.norms, self.relus):
            x = relu(norm(conv(x)))
            self.outputs.append(x)
        return self.convs[-1](x)


def _functional_steps(masks: bool, steps: int = 2, first_hooked: bool = False
                      ) -> tuple[nn.Module, list[list[str]], list[list[torch.Tensor]]]:
    """(the quantized `_FunctionalCNN`, each step's ReLU nodes, each step's gradients); ``first_hooked``: the first
    forward under saved-tensor hooks of another (identity), where a ReLU runs as autograd's."""
    torch.manual_seed(0)
    model = _FunctionalCNN()
    quantize_model(model, CPTConfig(quant_scheme="paper", relu_masks=masks))
    set_precision(model, 6, 8)
    names, gradients = [], []
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        hooks = (torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t) if first_hooked and step == 0
                 else contextlib.nullcontext())
        with hooks:
            loss = model(torch.randn(2, 3, 8, 8)).square().sum()
        names.append([o.grad_fn.name() for o in model.outputs])
        assert all(kept_output_of(o.grad_fn).output is None and kept_output_of(o.grad_fn).zeroed.dtype == torch.bool
                   for o in model.outputs if o.grad_fn.name() == HANDING_OVER)
        loss.backward()
        gradients.append([p.grad.clone() for p in model.parameters()])
    return model, names, gradients


def test_relus_called_as_functions_keep_masks_from_the_first_step_bit_for_bit():
    """``torch.relu``, ``F.relu``, ``x.relu()``, in place or not: from the first training forward on (the probe of
    `quantize_model`), each such call feeding a quantized convolution keeps a mask (the convolution its codes); the
    gradients of every step are those of the model without masks, bit for bit."""
    model, names, gradients = _functional_steps(True, steps=3)
    assert names == [[HANDING_OVER] * 5] * 3
    assert model.convs[0].cpt_precision.functional_relus
    assert len(model._forward_pre_hooks) == len(model._forward_hooks) == 1  # kept after the probe
    plain, plain_names, expected = _functional_steps(False, steps=3)
    assert plain_names == [["ReluBackward0"] * 5] * 3 and not plain.convs[0].cpt_precision.functional_relus
    for got, want in zip(gradients, expected):
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_the_relu_functions_mode_catches_the_models_calls_and_none_of_a_quantized_layers_own(monkeypatch):
    """`FunctionalReLUs` sees the model's ReLU calls, and none of the calls a quantized layer's forward makes (its
    product, ranges and codes), each of which would otherwise pass through the mode's Python handler."""
    seen = []
    handler = FunctionalReLUs.__torch_function__

    def recording(self, func, types, args=(), kwargs=None):
        seen.append(func)
        return handler(self, func, types, args, kwargs)

    monkeypatch.setattr(FunctionalReLUs, "__torch_function__", recording)
    model, names, _ = _functional_steps(True, steps=2)
    assert names == [[HANDING_OVER] * 5] * 2  # the mode was on and caught every ReLU
    assert {torch.relu, nn.functional.relu, torch.Tensor.relu, torch.relu_} <= set(seen)
    assert nn.functional.batch_norm in seen  # the model's own calls between the layers pass through it
    assert nn.functional.conv2d not in seen and torch.Tensor.detach not in seen  # the layers' calls do not


def test_a_first_forward_that_runs_autograds_relus_turns_the_masks_on_from_the_next():
    """Where the first training forward cannot keep masks (under saved-tensor hooks of another), a quantized layer
    fed autograd's own ReLU keeps the hooks on, and the next forward keeps masks; gradients bit for bit."""
    model, names, gradients = _functional_steps(True, first_hooked=True)
    assert names == [["ReluBackward0"] * 5, [HANDING_OVER] * 5]
    assert len(model._forward_pre_hooks) == 1
    _, _, expected = _functional_steps(False, first_hooked=True)
    for got, want in zip(gradients, expected):
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_the_functional_relu_scope_runs_only_in_training_forwards_and_comes_off_with_the_conversion():
    """Hooks from `quantize_model` to the first training forward, kept only where a ReLU function fed a quantized
    layer (off for a model whose ReLUs are modules, at its next call); no mode outside a training forward with
    gradients (eval, no_grad), none left after a forward that raises; a model copied before or pickled after keeps
    the behaviour; `dequantize_model` removes the hooks."""
    import io

    masked = _quantized(_cnn(), True)
    assert len(masked._forward_pre_hooks) == len(masked._forward_hooks) == 1  # the probe
    masked.eval()
    masked(torch.randn(4, 3, 8, 8))  # no training forward: the probe goes on
    masked.train()
    assert len(masked._forward_pre_hooks) == 1
    for _ in range(2):
        _step(masked, torch.randn(4, 3, 8, 8))
    assert not masked[0].cpt_precision.functional_relus  # modules only
    assert not masked._forward_pre_hooks and not masked._forward_hooks
    torch.manual_seed(0)
    fresh = _FunctionalCNN()
    quantize_model(fresh, CPTConfig(quant_scheme="paper"))
    set_precision(fresh, 6, 8)
    copied = copy.deepcopy(fresh)  # before any forward: the copy puts its hooks on itself
    copied(torch.randn(2, 3, 8, 8)).sum().backward()
    assert [o.grad_fn.name() for o in copied.outputs] == [HANDING_OVER] * 5
    assert not fresh.convs[0].cpt_precision.functional_relus and len(fresh._forward_pre_hooks) == 1

    model, _, _ = _functional_steps(True, steps=1)
    assert len(model._forward_pre_hooks) == len(model._forward_hooks) == 1
    stack = torch.overrides._get_current_function_mode_stack
    seen = []
    recording = model.convs[2].register_forward_pre_hook(lambda m, a: seen.append(len(stack())))
    model(torch.randn(2, 3, 8, 8))
    model.eval()
    model(torch.randn(2, 3, 8, 8))
    model.train()
    with torch.no_grad():
        model(torch.randn(2, 3, 8, 8))
    assert seen == [1, 0, 0] and not stack()
    with pytest.raises(RuntimeError):
        model(torch.randn(2, 5, 8, 8))  # 5 channels where the first conv takes 3
    assert not stack()
    recording.remove()
    buffer = io.BytesIO()
    torch.save(model, buffer)
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    loaded(torch.randn(2, 3, 8, 8))
    assert [o.grad_fn.name() for o in loaded.outputs] == [HANDING_OVER] * 5 and not stack()
    dequantize_model(model)
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_where_saved_tensor_hooks_are_disabled_the_relu_runs_as_autograds():
    """A transform that disables saved-tensor hooks (functorch) would refuse the ReLU's own hook: it keeps its output
    as autograd's ReLU does, with the same gradient."""
    source = torch.randn(16).requires_grad_()
    with torch.autograd.graph.disable_saved_tensors_hooks("disabled here"):
        output = relu_handing_over(source * 1.0, inplace=False)
    assert output.grad_fn.name() == "ReluBackward0" and kept_output_of(output.grad_fn) is None
    (got,) = torch.autograd.grad(output.sum(), source)
    assert torch.equal(got, (source > 0).float())
