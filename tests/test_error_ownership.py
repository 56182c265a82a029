"""`hf_cpt.nn.error_ownership`, and the layers' errors quantized over the gradient autograd hands them where it allows
(`CPTConfig.errors_in_place`)."""

import os

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from hf_cpt import CPTConfig, quantize_model, set_precision
from hf_cpt.nn import products
from hf_cpt.numerics import scratch
from hf_cpt.numerics.error_ownership import error_held_alone
from hf_cpt.numerics.errors import ErrorQuantization, quantize_error
from hf_cpt.utils import ConfigError

from .helpers import two_quantizable_layers


class _Seen(torch.autograd.Function):
    """Doubles its input; its backward records whether it held its error alone."""

    seen: list[bool] = []

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, error):
        _Seen.seen.append(error_held_alone(error))
        return error * 2


def _held_alone(run) -> bool:
    _Seen.seen.clear()
    run(torch.randn(4, 8, requires_grad=True))
    (seen,) = _Seen.seen
    return seen


def test_an_error_is_held_alone_only_where_nothing_else_holds_it():
    """True for a gradient that only the backward holds (made by the node after it, with activation checkpointing
    too); False wherever something else could see it overwritten: a hook or a node pre-hook that keeps it, a
    gradient the caller passed and holds, a view of it kept, a double backward, a gradient that is a view."""
    assert _held_alone(lambda x: (_Seen.apply(x) * 3).sum().backward())
    assert _held_alone(lambda x: checkpoint(lambda t: _Seen.apply(t) * 3, x, use_reentrant=False).sum().backward())
    assert _held_alone(lambda x: checkpoint(lambda t: _Seen.apply(t) * 3, x, use_reentrant=True).sum().backward())
    kept = []

    def hooked(x, keep):
        y = _Seen.apply(x)
        y.register_hook(lambda g: kept.append(keep(g)))
        (y * 3).sum().backward()

    assert not _held_alone(lambda x: hooked(x, lambda g: g))
    assert not _held_alone(lambda x: hooked(x, lambda g: g[0]))
    assert not _held_alone(lambda x: hooked(x, lambda g: g.detach()))

    def pre_hooked(x):
        y = _Seen.apply(x)
        y.grad_fn.register_prehook(lambda errors: kept.append(errors[0]))
        (y * 3).sum().backward()

    assert not _held_alone(pre_hooked)
    assert not _held_alone(lambda x: _Seen.apply(x).backward(torch.ones(4, 8)))
    assert not _held_alone(lambda x: torch.autograd.grad((_Seen.apply(x) ** 2).sum(), x, create_graph=True))
    assert not _held_alone(lambda x: _Seen.apply(x).sum().backward())  # sum's gradient: an expanded view


def test_quantize_error_overwrites_only_what_it_may():
    """``overwrite=True`` writes the result over the error: the values of the result written elsewhere, bit for bit.
    Without it, the caller's error is left as it was; a copy the kernel makes (a non-contiguous error) is its own to
    overwrite, so the result of a transposed error is the same too."""
    scheme, bits = ErrorQuantization(granularity="token"), torch.tensor(6.0)
    error = torch.randn(64, 2048)
    torch.manual_seed(0)
    expected = quantize_error(error, bits, scheme)
    assert not torch.equal(expected, error)
    original = error.clone()
    torch.manual_seed(0)
    overwritten = quantize_error(error, bits, scheme, overwrite=True)
    assert overwritten.data_ptr() == error.data_ptr() and torch.equal(error, expected)
    transposed = original.t().contiguous().t()  # the same values, columns first: the kernel copies it
    before = transposed.clone()
    torch.manual_seed(0)
    assert torch.equal(quantize_error(transposed, bits, scheme), expected)
    assert torch.equal(transposed, before)


@pytest.mark.parametrize("kind", ["linear", "conv1d", "conv2d"])
def test_errors_quantized_in_place_give_the_gradients_of_the_buffer_and_take_none(kind, monkeypatch):
    """The default: each layer's error, held by nothing else, is quantized over itself (never into the error's
    reused buffer), with the gradients of ``errors_in_place=False`` bit for bit; a non-bool is refused."""
    with pytest.raises(ConfigError, match="errors_in_place"):
        CPTConfig(errors_in_place="yes")
    taken = []
    take = scratch.take
    monkeypatch.setattr("hf_cpt.numerics.errors.take", lambda role, *a: taken.append(role) or take(role, *a))
    gradients = {}
    for in_place in (True, False):
        torch.manual_seed(0)
        model, x = two_quantizable_layers(kind)
        quantize_model(model, CPTConfig(errors_in_place=in_place, include_modules=["0", "2"]))
        set_precision(model, 6, 8)
        taken.clear()
        source = x.clone().requires_grad_()
        torch.manual_seed(1)
        model(source).square().sum().backward()
        # (errors of 64K values or more go through the fused kernel: the buffer's only user)
        assert taken.count("error") == 0 if in_place else taken.count("error") >= 1
        gradients[in_place] = [source.grad] + [p.grad for p in model.parameters()]
        scratch.release()
    assert all(torch.equal(a, b) for a, b in zip(gradients[True], gradients[False]))


def test_a_kept_layer_output_gradient_stays_full_precision_and_is_not_overwritten(monkeypatch):
    """A hook that keeps the gradient of a layer's output (large enough for the fused kernel, which could overwrite
    it) sees it as autograd made it, not quantized; the layer before, whose error nothing else holds, quantizes its
    own in place."""
    from torch import nn

    overwrites = []
    quantize = products.quantize_error
    monkeypatch.setattr(products, "quantize_error",
                        lambda *a, **k: overwrites.append(k["overwrite"]) or quantize(*a, **k))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 1024))  # output: 128K values
    quantize_model(model, CPTConfig(include_modules=["0", "2"]))
    set_precision(model, 6, 8)
    output = model(torch.randn(2, 64, 256))
    kept = []
    output.register_hook(kept.append)
    output.square().sum().backward()
    assert overwrites == [False, True]  # the last layer's backward runs first
    assert torch.equal(kept[0], 2 * output.detach())
    scratch.release()


def test_attention_errors_are_quantized_in_place_with_the_gradients_of_a_new_tensor(monkeypatch):
    """Under quantize_attention the scores' error, made by the softmax's backward alone, is quantized over itself (the
    output's, which arrives as a view, is not): the gradients of q, k and v are those of ``errors_in_place=False`` bit
    for bit."""
    from torch import nn

    from hf_cpt.nn.attention import AttentionQuantizer, cpt_attention_forward
    from hf_cpt.nn.precision import PrecisionState
    from hf_cpt.numerics import errors

    overwrites = []
    quantize = errors.quantize_error
    monkeypatch.setattr(errors, "quantize_error",
                        lambda *a, **k: overwrites.append(k.get("overwrite")) or quantize(*a, **k))
    gradients = {}
    for in_place in (True, False):
        torch.manual_seed(0)
        q, k, v = (torch.randn(2, 4, 128, 32, requires_grad=True) for _ in range(3))  # scores: 128K values
        precision = PrecisionState(errors=ErrorQuantization("auto"), errors_in_place=in_place)
        precision.set(8, 6)
        module = nn.Module().train()
        module.cpt_attention = AttentionQuantizer(precision, True, "token")
        overwrites.clear()
        out, _ = cpt_attention_forward(module, q, k, v, torch.zeros(2, 1, 128, 128))
        out.square().sum().backward()
        # the output's error, a view (the output is transposed from heads), then the scores'
        assert overwrites == [False, in_place]
        gradients[in_place] = [t.grad for t in (q, k, v)]
    assert all(torch.equal(a, b) for a, b in zip(gradients[True], gradients[False]))


def test_a_fresh_process_calibrates_within_its_first_backward_and_quantizes_in_place():
    """In a fresh process the counts of an error held alone are first measured inside a layer's backward (a nested
    backward of the probe's own); that first step's errors already go in place: no error buffer is made."""
    from tests.fresh_python import run_python

    script = (
        "import torch; from tests.helpers import two_quantizable_layers; "
        "from hf_cpt import CPTConfig, quantize_model, set_precision; from hf_cpt.numerics import error_ownership, "
        "scratch; model, x = two_quantizable_layers('conv2d'); "
        "quantize_model(model, CPTConfig(include_modules=['0', '2'])); set_precision(model, 6, 8); "
        "assert not error_ownership._calibrated; model(x).square().sum().backward(); "
        "print(error_ownership._calibrated, sorted({role for role, _ in scratch._local.buffers}))"
    )
    result = run_python(["-c", script], cwd=os.path.join(os.path.dirname(__file__), ".."), check=True)
    assert result.stdout.split("\n")[-2] == "True ['input']"
