"""The attention products through transformers' attention interface: routed, quantized, counted."""

import pytest
import torch
from torch import nn
from transformers import BertForSequenceClassification, GPT2LMHeadModel

from hf_cpt import CPTConfig, dequantize_model, quantize_model, set_eval_precision, set_precision
from hf_cpt.cost import CostMeter
from hf_cpt.nn.attention import AttentionQuantizer, cpt_attention_forward
from hf_cpt.nn.precision import PrecisionState
from hf_cpt.numerics.fake_quant import quantize_ste

from .helpers import tiny_bert_config, tiny_gpt2_config


def reference_quantize(x, minimum, maximum, bits):
    scale = torch.clamp((maximum - minimum) / (2**bits - 1), min=1e-8)
    return scale * torch.round(torch.clamp((x - minimum) / scale, 0, 2**bits - 1)) + minimum


def reference_attention(q, k, v, mask, bits, per_token):
    """Quantized attention written out: Q, K, P per row (or tensor), V per channel (or tensor)."""
    def quantize(x, dim):
        if per_token:
            return reference_quantize(x, x.amin(dim, keepdim=True), x.amax(dim, keepdim=True), bits)
        return reference_quantize(x, x.min(), x.max(), bits)

    scores = quantize(q, -1) @ quantize(k, -1).transpose(-1, -2) / q.shape[-1] ** 0.5 + mask
    probabilities = torch.softmax(scores, dim=-1)
    return (quantize(probabilities, -1) @ quantize(v, -2)).transpose(1, 2)


def _models(attn_implementation):
    torch.manual_seed(0)
    bert_config, gpt2_config = tiny_bert_config(), tiny_gpt2_config()
    bert_config._attn_implementation = gpt2_config._attn_implementation = attn_implementation
    return {"bert": BertForSequenceClassification(bert_config).eval(), "gpt2": GPT2LMHeadModel(gpt2_config).eval()}


def _logits(model):
    ids = torch.randint(5, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, 6:] = 0  # padding: the mask must reach the attention function
    with torch.no_grad():  # the last hidden states (a random BERT's logits are too flat to compare)
        return model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]


@pytest.mark.parametrize("per_token", [False, True])
def test_quantized_attention_matches_an_independent_reference(per_token):
    torch.manual_seed(2)
    q, k, v = (torch.randn(2, 3, 5, 8) for _ in range(3))
    mask = torch.zeros(2, 1, 5, 5)
    mask[1, :, :, 3:] = torch.finfo(torch.float32).min
    precision = PrecisionState()
    precision.set_eval(4)
    module = nn.Module().eval()
    module.cpt_attention = AttentionQuantizer(precision, True, "token" if per_token else "tensor")
    got, _ = cpt_attention_forward(module, q, k, v, mask)
    torch.testing.assert_close(got, reference_attention(q, k, v, mask, 4, per_token), rtol=1e-5, atol=1e-6)


def test_fixed_attention_bits_hold_the_products_while_the_layers_change_and_follow_full_precision():
    torch.manual_seed(4)
    q, k, v = (torch.randn(2, 3, 5, 8) for _ in range(3))
    mask = torch.zeros(2, 1, 5, 5)
    precision = PrecisionState()
    module = nn.Module().eval()
    module.cpt_attention = AttentionQuantizer(precision, True, "token", fixed_bits=6)
    for layer_bits in (3, 8):  # the layers' eval bits change; the products stay at 6
        precision.set_eval(layer_bits)
        got, _ = cpt_attention_forward(module, q, k, v, mask)
        torch.testing.assert_close(got, reference_attention(q, k, v, mask, 6, True), rtol=1e-5, atol=1e-6)
        assert not torch.allclose(got, reference_attention(q, k, v, mask, layer_bits, True), atol=1e-4)
    precision.set_eval(None)  # layers in full precision: so are the products
    got, _ = cpt_attention_forward(module, q, k, v, mask)
    plain = torch.softmax(q @ k.transpose(-1, -2) / 8**0.5 + mask, dim=-1) @ v
    torch.testing.assert_close(got, plain.transpose(1, 2), rtol=1e-5, atol=1e-6)


def test_fixed_attention_bits_are_priced_at_their_bits():
    config = tiny_gpt2_config()
    ids = torch.randint(5, 100, (2, 7))
    gbitops = {}
    for attention_bits in (None, 8):
        torch.manual_seed(3)
        model = GPT2LMHeadModel(config).train()
        report = quantize_model(model, CPTConfig(quantize_attention=True, attention_bits=attention_bits))
        assert report.attention.endswith(f"at {'the forward bits' if attention_bits is None else '8 bits'}, counted "
                                         "there")
        meter = CostMeter(model, 8, 8)
        set_precision(model, 4, 8)
        model(input_ids=ids, labels=ids).loss.backward()
        meter.end_step(4, 8)
        gbitops[attention_bits] = meter.totals.to_dict()
    macs = config.n_layer * 2 * 2 * config.n_head * 7 * 7 * (config.n_embd // config.n_head)
    # the attention products alone differ: (8·8 + 2·8·8) against (4·4 + 2·8·4) bit operations per MAC
    extra = macs * ((8 * 8 + 2 * 8 * 8) - (4 * 4 + 2 * 8 * 4)) / 1e9
    assert gbitops[8]["gbitops"] - gbitops[None]["gbitops"] == pytest.approx(extra, rel=1e-6)
    assert gbitops[8]["static_gbitops"] == pytest.approx(gbitops[None]["static_gbitops"], rel=1e-9)


def _attention_gradients(quantize_errors: bool, grad_bits: int | None):
    torch.manual_seed(5)
    q, k, v = (torch.randn(2, 3, 6, 8, requires_grad=True) for _ in range(3))
    precision = PrecisionState()
    precision.set(4, grad_bits)
    module = nn.Module().train()
    module.cpt_attention = AttentionQuantizer(precision, True, "token", quantize_errors=quantize_errors)
    torch.manual_seed(6)  # the same stochastic rounding draws in every call
    output, _ = cpt_attention_forward(module, q, k, v, torch.zeros(2, 1, 6, 6))
    output.backward(torch.randn(output.shape, generator=torch.Generator().manual_seed(7)))
    return output.detach(), [t.grad for t in (q, k, v)]


def _training_attention(q, k, v, bits, per_token):
    """The training forward (errors unquantized) and the tensors autograd saved for its backward."""
    precision = PrecisionState()
    precision.set(bits, None)
    module = nn.Module().train()
    module.cpt_attention = AttentionQuantizer(precision, True, "token" if per_token else "tensor")
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        output, _ = cpt_attention_forward(module, q, k, v, torch.zeros(2, 1, 6, 6))
    return output, saved


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("dtype,bits", [(torch.float32, 4), (torch.bfloat16, 8), (torch.float32, 10)])
def test_training_products_keep_codes_and_give_autograds_gradients(per_token, dtype, bits):
    """Both products save their operands as uint8 codes (up to 8 bits) and still give, bit for bit, the output
    and gradients of torch.matmul on the fake-quantized operands (the path without saved codes)."""
    torch.manual_seed(8)
    q, k, v = (torch.randn(2, 3, 6, 8).to(dtype).requires_grad_() for _ in range(3))
    grad = torch.randn(2, 6, 3, 8, generator=torch.Generator().manual_seed(9)).to(dtype)
    output, saved = _training_attention(q, k, v, bits, per_token)
    output.backward(grad)
    got = [output.detach()] + [t.grad for t in (q, k, v)]

    bits_tensor = torch.tensor(float(bits))

    def quantize(x, reduced_dim):
        source = x.detach()
        if per_token:
            minimum, maximum = source.amin(reduced_dim, keepdim=True), source.amax(reduced_dim, keepdim=True)
            return quantize_ste(x, minimum, maximum, bits_tensor)
        return quantize_ste(x, source.min(), source.max(), bits_tensor)

    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    scores = quantize(q2, -1) @ quantize(k2.transpose(2, 3), -2) * 8**-0.5
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)
    expected_output = (quantize(weights, -1) @ quantize(v2, -2)).transpose(1, 2)
    expected_output.backward(grad)
    expected = [expected_output.detach()] + [t.grad for t in (q2, k2, v2)]
    for got_tensor, expected_tensor in zip(got, expected):
        torch.testing.assert_close(got_tensor, expected_tensor, rtol=0, atol=0)

    codes = [t for t in saved if t.dtype == torch.uint8]
    # full-size float tensors: of Q, K, V or of P (the softmax keeps its own output: one of P's size)
    floats = [t for t in saved if t.is_floating_point() and t.numel() in (q.numel(), 2 * 3 * 6 * 6)]
    if bits <= 8:
        assert sorted(tuple(t.shape) for t in codes) == sorted([(2, 3, 6, 8), (2, 3, 8, 6), (2, 3, 6, 6), (2, 3, 6, 8)])
        assert len(floats) == 1
    else:  # codes above 8 bits do not fit in uint8: the fake-quantized values are kept
        assert codes == [] and len(floats) == 5


def test_attention_errors_false_keeps_the_forward_and_leaves_the_errors_in_full_precision():
    output, kept = _attention_gradients(quantize_errors=False, grad_bits=2)
    no_error_quantization = _attention_gradients(quantize_errors=True, grad_bits=None)
    quantized = _attention_gradients(quantize_errors=True, grad_bits=2)
    torch.testing.assert_close(output, quantized[0], rtol=0, atol=0)  # the forward is the same quantized one
    for got, expected, coarse in zip(kept, no_error_quantization[1], quantized[1]):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        assert not torch.allclose(got, coarse, atol=1e-3)  # 2-bit errors would have changed every gradient


def test_attention_errors_in_full_precision_are_priced_at_32_bits():
    config = tiny_gpt2_config()
    ids = torch.randint(5, 100, (2, 7))
    gbitops = {}
    for attention_errors in (True, False):
        torch.manual_seed(3)
        model = GPT2LMHeadModel(config).train()
        report = quantize_model(model, CPTConfig(quantize_attention=True, attention_errors=attention_errors))
        assert report.attention.endswith("errors in full precision, counted there") != attention_errors
        meter = CostMeter(model, 8, 8)
        set_precision(model, 4, 8)
        model(input_ids=ids, labels=ids).loss.backward()
        meter.end_step(4, 8)
        gbitops[attention_errors] = meter.totals.to_dict()["gbitops"]
    macs = config.n_layer * 2 * 2 * config.n_head * 7 * 7 * (config.n_embd // config.n_head)
    # the attention products alone differ: (4·4 + 2·32·4) against (4·4 + 2·8·4) bit operations per MAC
    extra = macs * (2 * 32 * 4 - 2 * 8 * 4) / 1e9
    assert gbitops[False] - gbitops[True] == pytest.approx(extra, rel=1e-6)


def test_attention_errors_false_needs_quantized_attention():
    with pytest.raises(ValueError, match=r"CPTConfig.attention_errors=False needs quantize_attention=True"):
        CPTConfig(attention_errors=False)


def test_attention_bits_need_quantized_attention_and_a_bit_width():
    with pytest.raises(ValueError, match=r"CPTConfig.attention_bits \(8\) needs quantize_attention=True"):
        CPTConfig(attention_bits=8)
    with pytest.raises(ValueError, match="CPTConfig.attention_bits must be an integer"):
        CPTConfig(quantize_attention=True, attention_bits=8.5)


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_full_precision_routing_keeps_the_model_and_dequantize_restores_it(attn_implementation):
    for name, model in _models(attn_implementation).items():
        expected = _logits(model)
        report = quantize_model(model, CPTConfig())
        assert model.config._attn_implementation == "cpt", name
        assert report.attention.startswith(f"full precision ({attn_implementation})"), report.attention
        set_eval_precision(model, None)
        torch.testing.assert_close(_logits(model), expected, rtol=1e-5, atol=1e-5)
        dequantize_model(model)
        assert model.config._attn_implementation == attn_implementation
        torch.testing.assert_close(_logits(model), expected, rtol=1e-5, atol=1e-5)


def test_quantized_attention_is_the_same_from_eager_and_sdpa_models_and_changes_the_output():
    outputs = {}
    for attn_implementation in ("eager", "sdpa"):
        for name, model in _models(attn_implementation).items():
            plain = _logits(model)
            quantize_model(model, CPTConfig(quantize_attention=True, bits_min=3))
            set_eval_precision(model, 3)
            outputs[attn_implementation, name] = _logits(model)
            model.cpt_attention.quantize = False  # the same layers, attention in full precision
            assert not torch.allclose(_logits(model), outputs[attn_implementation, name], atol=1e-4)
            model.cpt_attention.quantize = True
            assert torch.isfinite(outputs[attn_implementation, name]).all() and not torch.equal(
                plain, outputs[attn_implementation, name])
    for name in ("bert", "gpt2"):
        torch.testing.assert_close(outputs["eager", name], outputs["sdpa", name], rtol=1e-5, atol=1e-5)


def test_attention_training_step_quantizes_the_errors_and_counts_the_macs():
    torch.manual_seed(3)
    config = tiny_gpt2_config()
    heads, width = config.n_head, config.n_embd
    ids = torch.randint(5, 100, (2, 7))
    counted = {}
    for quantize in (False, True):
        torch.manual_seed(3)
        model = GPT2LMHeadModel(config).train()
        for module in model.modules():
            if isinstance(module, nn.Dropout):
                module.p = 0.0
        quantize_model(model, CPTConfig(quantize_attention=quantize))
        meter = CostMeter(model, 8, 8)
        set_precision(model, 4, 8)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        attention = model.cpt_attention
        counted[quantize] = (attention.quantized_macs.count, attention.float_macs.count)
        meter.end_step(4, 8)
        counted[quantize, "totals"] = meter.totals.to_dict()
    per_layer = 2 * 2 * heads * 7 * 7 * (width // heads)  # Q·Kᵀ and P·V, batch 2, 7 tokens
    assert counted[False] == (0, config.n_layer * per_layer)
    assert counted[True] == (config.n_layer * per_layer, 0)
    # FP32 attention shows in the share of MACs that ran in full precision; quantized, it does not
    assert counted[False, "totals"]["full_precision_mac_share"] > counted[True, "totals"]["full_precision_mac_share"]
    assert counted[True, "totals"]["gbitops"] < counted[False, "totals"]["gbitops"]


def test_models_without_the_attention_interface_are_named():
    model = nn.Sequential(nn.Linear(4, 4))
    report = quantize_model(model, CPTConfig())
    assert report.attention.startswith("not counted (Sequential is not a transformers PreTrainedModel")
    with pytest.raises(ValueError, match="quantize_attention=True cannot be applied: Sequential"):
        quantize_model(nn.Sequential(nn.Linear(4, 4)), CPTConfig(quantize_attention=True))


@pytest.mark.parametrize("quantize_attention, attention_bits", [(False, None), (True, None), (True, 8)])
def test_a_saved_model_reloads_with_the_same_attention(tmp_path, quantize_attention, attention_bits):
    from transformers import AutoModelForCausalLM

    from hf_cpt import save_quantized

    model = _models("sdpa")["gpt2"]
    quantize_model(model, CPTConfig(quantize_attention=quantize_attention, attention_bits=attention_bits))
    model.train()
    set_precision(model, 4, 8)
    ids = torch.randint(5, 100, (2, 9))
    model(input_ids=ids, labels=ids).loss.backward()  # ranges and a trained state
    model.eval()
    set_eval_precision(model, 6)
    expected = _logits(model)
    save_quantized(model, tmp_path, bits=6, model_card=False)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    loaded_attention = getattr(loaded, "cpt_attention", None)
    assert (loaded_attention is not None and loaded_attention.quantize) == quantize_attention
    assert loaded.config.quantization_config.attention_bits == attention_bits
    assert (loaded_attention.fixed_bits if loaded_attention is not None else None) == attention_bits
    torch.testing.assert_close(_logits(loaded), expected, rtol=1e-5, atol=1e-5)


class _QuantizedGradient(torch.autograd.Function):
    """Identity forward; the reference error quantizer (nearest rounding, per row) on the gradient."""

    @staticmethod
    def forward(ctx, x, quantize):
        ctx.quantize = quantize
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.quantize(grad), None


def _row_error_quantizer(grid, bits):
    def quantize(e):
        if grid == "symmetric":
            half = 2 ** (bits - 1) - 1
            scale = torch.clamp(e.abs().amax(-1, keepdim=True) / half, min=1e-8)
            return torch.clamp(torch.round(e / scale), -half, half) * scale
        return reference_quantize(e, e.amin(-1, keepdim=True), e.amax(-1, keepdim=True), bits)
    return quantize


@pytest.mark.parametrize("error_range, grid", [("auto", "symmetric"), ("minmax", "minmax")])
def test_attention_errors_use_the_zero_centred_grid_by_default(error_range, grid):
    """The errors of both attention products, per row, on the grid error_range gives the attention (default:
    zero-centred, docs/backward.md); the layers keep the min/max grid."""
    from hf_cpt.numerics.errors import ErrorQuantization

    torch.manual_seed(4)
    q, k, v = (torch.randn(2, 3, 6, 8, requires_grad=True) for _ in range(3))
    mask = torch.zeros(2, 1, 6, 6)
    mask[1, :, :, 4:] = torch.finfo(torch.float32).min  # padded keys: their score errors are exactly zero
    errors = ErrorQuantization("auto", "nearest", range=error_range)
    precision = PrecisionState(errors=errors)
    precision.set(8, 5)
    module = nn.Module().train()
    module.cpt_attention = AttentionQuantizer(precision, True, "token")
    upstream = torch.randn(2, 6, 3, 8)
    out, _ = cpt_attention_forward(module, q, k, v, mask)
    out.backward(upstream)
    got = [t.grad.clone() for t in (q, k, v)]
    assert precision.errors.for_activations("token").range == "minmax"

    quantize_error = _row_error_quantizer(grid, 5)
    inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]

    def forward_quantize(x, dim):  # the forward's fake quantization, straight-through
        low, high = x.amin(dim, keepdim=True).detach(), x.amax(dim, keepdim=True).detach()
        return x + (reference_quantize(x, low, high, 8) - x).detach()

    rq, rk, rv = inputs
    scores = _QuantizedGradient.apply(forward_quantize(rq, -1) @ forward_quantize(rk, -1).transpose(-1, -2),
                                      quantize_error)
    probabilities = torch.softmax(scores / 8**0.5 + mask, dim=-1)
    output = _QuantizedGradient.apply(forward_quantize(probabilities, -1) @ forward_quantize(rv, -2), quantize_error)
    output.transpose(1, 2).backward(upstream)
    for mine, theirs in zip(got, inputs):
        torch.testing.assert_close(mine, theirs.grad, rtol=1e-4, atol=1e-6)
