"""Handed-on blocks (`CPTConfig.output_mappings`): the outputs and input gradients of quantized layers, GELUs and
dropouts in CPU training in mappings of their own (`hf_cpt.numerics.scratch.handed_on`), with the same values bit for
bit as without."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

from hf_cpt import CPTConfig, dequantize_model, quantize_model, set_precision
from hf_cpt.nn.handed_on import gelu_approximation
from hf_cpt.numerics import scratch
from hf_cpt.utils import ConfigError

from .helpers import mapped_alone

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads the process's mappings (Linux)")

MIB_OF_FLOATS = scratch.HANDED_ON_MAPPING_BYTES // 4


def test_the_setting_is_a_bool():
    with pytest.raises(ConfigError, match="output_mappings"):
        CPTConfig(output_mappings="yes")


def test_only_a_gelu_whose_forward_is_f_gelu_gets_its_approximation():
    from transformers import activations

    assert gelu_approximation(nn.GELU()) == "none" and gelu_approximation(nn.GELU("tanh")) == "tanh"
    assert gelu_approximation(activations.GELUActivation()) == "none"
    assert gelu_approximation(activations.GELUTanh()) == "tanh"
    assert gelu_approximation(activations.GELUActivation(use_gelu_python=True)) is None  # its own formula
    assert gelu_approximation(activations.NewGELUActivation()) is None
    assert gelu_approximation(nn.SiLU()) is None


class _Mlp(nn.Module):
    """Linear, GELU, dropout, Linear: a transformer's MLP, its activations 1 MiB and more."""

    def __init__(self, width: int = 256, act: nn.Module | None = None):
        super().__init__()
        self.up, self.act, self.drop = nn.Linear(width, 4 * width), act or nn.GELU(), nn.Dropout(0.1)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x):
        return self.down(self.drop(self.act(self.up(x))))


def _handed_on_blocks(monkeypatch) -> list[torch.Tensor]:
    """Record every block `scratch.handed_on` makes (its product modules import the module, so patching it there
    reaches them)."""
    made = []
    original = scratch.handed_on

    def recording(shape, dtype, *args, **kwargs):
        made.append(original(shape, dtype, *args, **kwargs))
        return made[-1]

    monkeypatch.setattr(scratch, "handed_on", recording)
    return made


def _quantized_copy(plain: nn.Module, mapped: bool) -> nn.Module:
    """A CPT 8/8 copy of ``plain`` in training mode, its blocks handed on with ``output_mappings=mapped``."""
    model = copy.deepcopy(plain)
    quantize_model(model, CPTConfig(output_mappings=mapped))
    set_precision(model, 8, 8)
    return model.train()


def _train_step(model: nn.Module, x: torch.Tensor, seed: int = 3):
    torch.manual_seed(seed)
    x = x.clone().requires_grad_()
    out = model(x)
    out.square().sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in model.named_parameters()}, torch.rand(4)


@pytest.mark.parametrize("act", [nn.GELU(), nn.GELU("tanh")], ids=["gelu", "gelu-tanh"])
def test_an_mlps_outputs_and_gradients_are_the_same_bit_for_bit_and_its_blocks_are_mapped(monkeypatch, act):
    torch.manual_seed(0)
    plain = _Mlp(act=act)
    x = torch.randn(16, 64, 256)  # 256 Ki values: the MLP's every output and input gradient is 1 MiB or more
    sides = {}
    for mapped in (False, True):
        model = _quantized_copy(plain, mapped)
        made = _handed_on_blocks(monkeypatch) if mapped else []
        sides[mapped] = _train_step(model, x)
        if mapped:
            # both Linears' outputs and input gradients (the first's too: x needs its gradient), the GELU's output
            # and input gradient, the dropout's output
            assert len(made) == 7 and all(mapped_alone(t) for t in made)
            assert mapped_alone(sides[True][0])  # (x's gradient: a copy, made since ``made`` holds the block)
        monkeypatch.undo()
    (out, grad_x, grads, after), (out_m, grad_x_m, grads_m, after_m) = sides[False], sides[True]
    assert torch.equal(out, out_m) and torch.equal(grad_x, grad_x_m) and torch.equal(after, after_m)  # same draws
    assert all(torch.equal(grads[name], grads_m[name]) for name in grads)
    assert not mapped_alone(out)  # without the setting: torch's allocator


def test_a_converted_gelu_and_dropout_compute_as_torchs_own_modules():
    """With the converted model at full precision (no bit-widths set: its Linears compute as torch's), the converted
    GELU and dropout between them give what torch's modules give, the dropout's output in a mapping of its own."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Dropout(0.2), nn.Linear(1024, 4))
    plain = copy.deepcopy(model)
    quantize_model(model, CPTConfig())
    x = torch.randn(8, 64, 256)
    for m in (model, plain):
        m.train()
    quantized_dropout_input = {}
    model[2].register_forward_hook(lambda m, args, out: quantized_dropout_input.setdefault("out", out))
    grads = []
    for m in (model, plain):
        torch.manual_seed(5)
        hidden = m[2](m[1](m[0](x)))
        hidden.square().sum().backward()
        grads.append((hidden.detach(), m[0].weight.grad.clone()))
    assert mapped_alone(quantized_dropout_input["out"])
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_a_gpt2_conv1d_writes_into_mappings_the_same_values_and_a_conv2d_keeps_torchs_allocator(monkeypatch):
    """GPT-2's Conv1D hands its blocks on like a Linear. A Conv2d does not: in a CNN its output is what the
    BatchNorm after it keeps, and mapping it cost the CIFAR ResNet-20's step time without lowering its peak
    (docs/benchmarks.md, the output-mappings table)."""
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    plain, x = nn.Sequential(Conv1D(1024, 256), nn.ReLU(), Conv1D(256, 1024)), torch.randn(16, 64, 256)
    sides = []
    for mapped in (False, True):
        model = _quantized_copy(plain, mapped)
        made = _handed_on_blocks(monkeypatch) if mapped else []
        sides.append(_train_step(model, x))
        if mapped:
            assert len(made) == 4 and all(mapped_alone(t) for t in made) and mapped_alone(sides[-1][0])
        monkeypatch.undo()
    assert torch.equal(sides[0][0], sides[1][0]) and torch.equal(sides[0][1], sides[1][1])
    assert all(torch.equal(sides[0][2][name], sides[1][2][name]) for name in sides[0][2])
    conv = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1, bias=False))
    quantize_model(conv, CPTConfig())
    set_precision(conv, 8, 8)
    made = _handed_on_blocks(monkeypatch)
    out, *_ = _train_step(conv, torch.randn(32, 16, 32, 32))  # a 2 MiB output
    assert not made and not mapped_alone(out)


def test_a_bert_step_is_the_same_bit_for_bit_and_no_product_maps_under_autocast_or_in_eval(monkeypatch):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=512, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=1024, max_position_embeddings=128)
    plain = BertForSequenceClassification(config)
    batch = {"input_ids": torch.randint(0, 512, (8, 128)), "labels": torch.randint(0, 2, (8,))}  # 1 MiB a layer
    results = []
    for mapped in (False, True):
        model = _quantized_copy(plain, mapped)
        made = _handed_on_blocks(monkeypatch)
        torch.manual_seed(1)
        loss = model(**batch).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
        assert (len(made) > 0) == mapped
        if mapped:
            made.clear()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                model(**batch).loss.backward()
            # products into a given tensor would skip autocast's casts: only the float32 dropouts map theirs
            assert made and not any(t.shape[-1] == config.intermediate_size for t in made)
            assert all(t.dtype == torch.float32 for t in made)
            made.clear()
            model.eval()
            with torch.no_grad():
                model(**batch)
            assert not made
            assert any("output_mappings" in m.__dict__ for m in model.modules())  # the GELUs and dropouts
            assert not any("output_mappings" in m.__dict__ for m in dequantize_model(model).modules())
        monkeypatch.undo()
    assert torch.equal(results[0][0], results[1][0])
    assert results[0][1].keys() == results[1][1].keys()
    assert all(torch.equal(results[0][1][name], results[1][1][name]) for name in results[0][1])


def test_a_small_block_and_a_strided_input_take_torchs_allocator(monkeypatch):
    torch.manual_seed(0)
    model = _Mlp(width=32)
    quantize_model(model, CPTConfig())
    set_precision(model, 8, 8)
    made = _handed_on_blocks(monkeypatch)
    _train_step(model, torch.randn(2, 8, 32))
    assert made and not any(mapped_alone(t) for t in made)  # asked for, but below a MiB
    made.clear()
    wide = _Mlp()
    quantize_model(wide, CPTConfig())
    set_precision(wide, 8, 8)
    out = wide.act(torch.randn(256, 4 * MIB_OF_FLOATS // 256 // 4, requires_grad=True).t())  # strided
    assert not made and not mapped_alone(out)


class _KeptByTheNextOp(nn.Module):
    """A Linear whose output the op after it keeps for its backward, as an attention keeps its query, key and value."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(256, 1024)

    def forward(self, x):
        h = self.proj(x)
        return h * h


def _where_blocks_go(monkeypatch) -> list[tuple[tuple[int, ...], bool]]:
    """Record the shape of every block `scratch.handed_on` makes and whether it is mapped, holding none of them."""
    made, original = [], scratch.handed_on

    def recording(shape, dtype, *args, **kwargs):
        block = original(shape, dtype, *args, **kwargs)
        made.append((tuple(shape), mapped_alone(block)))
        return block

    monkeypatch.setattr(scratch, "handed_on", recording)
    return made


def test_an_output_kept_for_the_backward_comes_from_the_heap_from_the_next_step_on(monkeypatch):
    """A block that lives through the backward leaves no hole in the forward: from the step after the layer's first,
    its output comes from the heap, which holds it without faulting fresh pages in; the values stay the same."""
    torch.manual_seed(0)
    plain, x = _KeptByTheNextOp(), torch.randn(16, 64, 256)
    steps = {}
    for mapped in (False, True):
        model = _quantized_copy(plain, mapped)
        made = _where_blocks_go(monkeypatch)
        steps[mapped] = [_train_step(model, x, seed) for seed in (3, 4, 5)]
        monkeypatch.undo()
        if mapped:  # per step: the output (16x64x1024), then x's gradient (16x64x256), made in the backward
            assert [shape for shape, _ in made] == [(16, 64, 1024), (16, 64, 256)] * 3
            assert [where for _, where in made] == [True, True, False, True, False, True]
    for (out, grad_x, grads, _), (out_m, grad_x_m, grads_m, _) in zip(steps[False], steps[True]):
        assert torch.equal(out, out_m) and torch.equal(grad_x, grad_x_m)
        assert all(torch.equal(grads[name], grads_m[name]) for name in grads)
