"""Dropout that keeps a bool mask for its backward on the CPU (hf_cpt/nn/dropout_masks.py)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hf_cpt import CPTConfig, dequantize_model, quantize_model, set_precision
from hf_cpt.nn.dropout_masks import DropoutKeepingBoolMask, dropout, sdpa_keeping_bool_mask
from hf_cpt.numerics import mask_kernels
from hf_cpt.utils import ConfigError


def _saved(fn, *args, **kwargs):
    """(fn's output, the tensors its graph saves for backward)."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        output = fn(*args, **kwargs)
    return output, saved


def _outputs_and_gradients(fn, inputs, seed=3):
    """fn's output on ``inputs`` under ``seed``, the gradients of a fixed error, and the random state after."""
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    torch.manual_seed(seed)
    output, saved = _saved(fn, *inputs)
    state = torch.get_rng_state()
    error = torch.randn(output.shape, generator=torch.Generator().manual_seed(5)).to(output.dtype)
    gradients = torch.autograd.grad(output, inputs, error)
    return output, gradients, state, saved


@pytest.mark.parametrize("native_kernel", [True, False])
@pytest.mark.parametrize("p", [0.1, 0.5, 0.37])
def test_dropout_is_f_dropout_bit_for_bit_and_keeps_a_packed_or_bool_mask(p, native_kernel, monkeypatch):
    """Same output, gradient and random stream as ``F.dropout`` (a tensor large enough for the parallel kernel);
    what it keeps is its mask packed one bit a value (a bool tensor where the native kernel does not serve), where
    ``F.dropout`` keeps a float one of the input's size."""
    if native_kernel and mask_kernels._library() is None:
        pytest.skip("no C compiler on this machine")
    if not native_kernel:
        monkeypatch.setattr(mask_kernels, "_library", lambda: None)
    x = torch.randn(16, 12, 128, 64)
    got = _outputs_and_gradients(lambda t: dropout(t, p, True), [x])
    expected = _outputs_and_gradients(lambda t: F.dropout(t, p, True), [x])
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1][0], expected[1][0])
    assert torch.equal(got[2], expected[2])  # the random stream moved the same way
    kept = (torch.uint8, ((x.numel() + 7) // 8,)) if native_kernel else (torch.bool, x.shape)
    assert [(t.dtype, t.shape) for t in got[3]] == [kept]
    assert [(t.dtype, t.shape) for t in expected[3]] == [(torch.float32, x.shape)]
    assert 0.5 * (1 - p) < (got[0] != 0).float().mean() < 1.5 * (1 - p)


def test_dropout_elsewhere_runs_as_f_dropout():
    """Eval, no grad, p = 0 or 1, bfloat16: ``F.dropout``'s result and backward."""
    x = torch.randn(64, 64)
    half = x.bfloat16().requires_grad_()
    torch.manual_seed(0)
    got = dropout(half, 0.3, True)
    torch.manual_seed(0)
    assert torch.equal(got, F.dropout(half, 0.3, True)) and got.grad_fn.name() == "MulBackward0"
    assert torch.equal(dropout(x, 0.3, False), x)
    assert torch.equal(dropout(x, 0.0, True), x)
    assert torch.equal(dropout(x, 1.0, True), torch.zeros_like(x))
    with torch.no_grad():
        torch.manual_seed(0)
        got = dropout(x, 0.3, True)
        torch.manual_seed(0)
        assert torch.equal(got, F.dropout(x, 0.3, True))


def test_the_module_is_nn_dropout_bit_for_bit():
    module, converted = nn.Dropout(0.2), nn.Dropout(0.2)
    converted.__class__ = DropoutKeepingBoolMask
    x = torch.randn(8, 32, 48)
    got = _outputs_and_gradients(converted, [x])
    expected = _outputs_and_gradients(module, [x])
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1][0], expected[1][0])
    assert [t.dtype for t in got[3]] == [torch.bool]
    converted.eval()
    assert torch.equal(converted(x), x)
    in_place = nn.Dropout(0.2, inplace=True)
    in_place.__class__ = DropoutKeepingBoolMask
    y = x.clone()
    torch.manual_seed(1)
    assert in_place(y) is y
    torch.manual_seed(1)
    assert torch.equal(y, F.dropout(x, 0.2, True))


SDPA_CASES = {
    "no mask": {},
    "additive padding mask": {"attn_mask": "float"},
    "bool mask": {"attn_mask": "bool"},
    "causal": {"is_causal": True},
    "explicit scale": {"scale": 0.3},
    "grouped key/value heads": {"enable_gqa": True},
    "long enough for a packed mask": {"length": 80},  # 3 x 4 x 80 x 80 probabilities
}


def _sdpa_inputs(case: dict, batch=3, heads=4, length=10, dim=8):
    generator = torch.Generator().manual_seed(7)
    kv_heads = heads // 2 if case.get("enable_gqa") else heads
    length = case.get("length", length)
    q = torch.randn(batch, heads, length, dim, generator=generator)
    k, v = (torch.randn(batch, kv_heads, length, dim, generator=generator) for _ in range(2))
    kwargs = {key: value for key, value in case.items() if key != "length"}
    if case.get("attn_mask") == "float":
        padded = torch.arange(length) >= length - 3  # the last three positions are padding
        kwargs["attn_mask"] = torch.zeros(batch, 1, 1, length).masked_fill(padded, torch.finfo(torch.float32).min)
    elif case.get("attn_mask") == "bool":
        kwargs["attn_mask"] = torch.rand(batch, 1, length, length, generator=generator) > 0.3
        kwargs["attn_mask"][0, 0, 2] = False  # a fully masked row: zeros
    return (q, k, v), kwargs


@pytest.mark.parametrize("case", list(SDPA_CASES))
def test_sdpa_within_the_mode_is_sdpa_bit_for_bit_with_a_bool_mask(case):
    inputs, kwargs = _sdpa_inputs(SDPA_CASES[case])

    def attention(*qkv):
        return F.scaled_dot_product_attention(*qkv, dropout_p=0.2, **kwargs)

    def in_mode(*qkv):
        with sdpa_keeping_bool_mask():
            return attention(*qkv)

    got = _outputs_and_gradients(in_mode, inputs)
    expected = _outputs_and_gradients(attention, inputs)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[2], expected[2])
    for mine, theirs in zip(got[1], expected[1]):
        assert torch.equal(mine, theirs)
    scores_shape = (inputs[0].shape[0], inputs[0].shape[1], inputs[0].shape[2], inputs[1].shape[2])
    if math.prod(scores_shape) >= mask_kernels.NATIVE_MIN_NUMEL and mask_kernels._library() is not None:
        packed = [t for t in got[3] if t.dtype == torch.uint8]
        assert [t.shape for t in packed] == [((math.prod(scores_shape) + 7) // 8,)]
    else:
        assert [t.dtype for t in got[3] if t.shape == scores_shape].count(torch.bool) == 1
    assert torch.bool not in [t.dtype for t in expected[3] if t.shape == scores_shape]
    saved_bytes = [sum(t.numel() * t.element_size() for t in kept) for kept in (got[3], expected[3])]
    assert saved_bytes[0] < saved_bytes[1]


def test_sdpa_calls_the_mode_does_not_reproduce_run_as_they_were():
    """bf16 (SDPA's math path computes it in float32), no dropout, a negative scale, 3-d inputs: SDPA's own call."""
    (q, k, v), _ = _sdpa_inputs({})
    for dtype, dropout_p, options in ((torch.bfloat16, 0.2, {}), (torch.float32, 0.0, {}),
                                      (torch.float32, 0.2, {"scale": -0.3}), (torch.float32, 0.2, {"dims": 3})):
        qkv = [t.to(dtype) for t in (q, k, v)]
        if options.pop("dims", 4) == 3:
            qkv = [t[0] for t in qkv]
        qkv = [t.requires_grad_() for t in qkv]
        torch.manual_seed(0)
        expected = F.scaled_dot_product_attention(*qkv, dropout_p=dropout_p, **options)
        torch.manual_seed(0)
        with sdpa_keeping_bool_mask():
            got = F.scaled_dot_product_attention(*qkv, dropout_p=dropout_p, **options)
        assert torch.equal(got, expected) and got.grad_fn.name() == expected.grad_fn.name()


def _bert(attn_implementation: str):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=32, num_labels=3,
                        attn_implementation=attn_implementation)
    return BertForSequenceClassification(config)


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_a_quantized_bert_trains_bit_for_bit_keeping_bool_masks(attn_implementation):
    """A BERT with dropout everywhere: with and without ``dropout_masks``, the same loss and gradients bit for bit
    (same seed), and the step with them keeps no float mask: less memory for its backward."""
    model = _bert(attn_implementation)
    batch = {"input_ids": torch.randint(0, 120, (4, 16), generator=torch.Generator().manual_seed(1)),
             "attention_mask": torch.ones(4, 16, dtype=torch.long), "labels": torch.tensor([0, 1, 2, 0])}
    batch["attention_mask"][1, 10:] = 0
    results = {}
    for masks in (True, False):
        quantized = copy.deepcopy(model)
        report = quantize_model(quantized, CPTConfig(dropout_masks=masks, integer_matmul=False))
        set_precision(quantized, 6, 8)
        quantized.train()
        torch.manual_seed(2)
        loss, saved = _saved(lambda model=quantized: model(**batch).loss)
        loss.backward()
        results[masks] = (report, loss, {n: p.grad for n, p in quantized.named_parameters()},
                          sum(t.numel() * t.element_size() for t in saved), quantized)
    report, loss, gradients, saved_bytes, quantized = results[True]
    assert len(report.dropout_masks) == 8 and "dropouts that keep a bool mask" in str(report)
    assert results[False][0].dropout_masks == []
    assert torch.equal(loss, results[False][1])
    for name, expected in results[False][2].items():
        assert torch.equal(gradients[name], expected), name
    # the hidden dropouts (2 per layer, the embeddings', the pooled output's) and the probabilities' keep a byte a
    # value, not four
    hidden, probabilities = 4 * 16 * 32, 4 * 4 * 16 * 16
    assert results[False][3] - saved_bytes == 3 * (5 * hidden + 4 * 32 + 2 * probabilities)
    dequantize_model(quantized)
    assert all(type(m) is nn.Dropout for m in quantized.modules() if isinstance(m, nn.Dropout))


def test_dropout_masks_must_be_a_bool():
    with pytest.raises(ConfigError, match="dropout_masks"):
        CPTConfig(dropout_masks="yes")
