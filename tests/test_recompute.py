"""Activations that recompute their input from a product's codes in backward (hf_cpt/nn/recompute.py)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from hf_cpt import CPTConfig, dequantize_model, quantize_model, set_precision
from hf_cpt.cost import CostMeter
from hf_cpt.nn.recompute import RECOMPUTABLE, RecomputedActivationMixin
from hf_cpt.utils import ConfigError

from .helpers import tiny_bert_config, tiny_gpt2_config


def _bert(intermediate: int = 64, **overrides):
    from transformers import BertForSequenceClassification

    config = tiny_bert_config()
    config.intermediate_size = intermediate
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    return BertForSequenceClassification(config)


def _gpt2():
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(tiny_gpt2_config())


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64))


def _quantized(model, recompute: bool, **options):
    model = copy.deepcopy(model)
    report = quantize_model(model, CPTConfig(**{"recompute_activation_inputs": recompute, "integer_matmul": True,
                                                **options}))
    set_precision(model, 8, 8)
    model.train()
    return model, report


def _batch(model, tokens: int = 16):
    ids = torch.arange(4 * tokens).reshape(4, tokens) % 128
    if hasattr(model, "bert"):
        return {"input_ids": ids, "attention_mask": (ids % 7 != 3).long(), "labels": torch.tensor([0, 1, 2, 0])}
    return {"input_ids": ids, "labels": ids}


def _gradients(model, batch, autocast: bool = False):
    torch.manual_seed(1)  # the stochastic rounding of errors
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(**batch).loss
    loss.backward()
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def _assert_same_gradients(expected: dict, got: dict) -> None:
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


def _recomputed_macs(model) -> int:
    return next(m.cpt_precision for m in model.modules() if hasattr(m, "cpt_precision")).recomputed_macs


@pytest.mark.parametrize("build, tokens, autocast", [
    (_bert, 16, False),  # small products: the torch formulas
    (lambda: _bert(intermediate=512), 32, False),  # native kernels (>= 16384 values)
    (_gpt2, 16, False),  # GPT-2's tanh GELU, a Python formula: all its intermediate tensors go
    (_llama, 16, False),  # SiLU of the gate projection
    (_bert, 16, True),  # bf16 outputs under autocast
])
def test_gradients_are_those_of_the_kept_input_bit_for_bit(build, tokens, autocast):
    model = build()
    plain, _ = _quantized(model, recompute=False)
    recomputing, report = _quantized(model, recompute=True)
    assert report.recomputing and not _quantized(model, recompute=False)[1].recomputing
    batch = _batch(model, tokens)
    _assert_same_gradients(_gradients(plain, batch, autocast), _gradients(recomputing, batch, autocast))
    assert _recomputed_macs(recomputing) > 0


def test_gradients_are_the_same_under_gradient_checkpointing():
    """A checkpointed block runs its forward again in backward, saving each tensor once per forward."""
    model = _bert()
    batch = _batch(model)
    gradients = []
    for recompute in (False, True):
        quantized, _ = _quantized(model, recompute)
        quantized.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        gradients.append(_gradients(quantized, batch))
    assert quantized.bert.encoder.layer[0].intermediate.dense.cpt_precision.recomputed_macs > 0
    for name in gradients[0]:
        assert torch.equal(gradients[0][name], gradients[1][name]), name


def _kept_bytes(model, batch) -> int:
    """Bytes of the distinct storages one training forward saves for backward, parameters excluded."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in parameters:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**batch)
    return sum(kept.values())


def test_the_activation_keeps_no_float_input_and_the_backward_runs_each_product_once_more():
    model = _bert(intermediate=64)
    batch = _batch(model)
    plain, _ = _quantized(model, recompute=False)
    recomputing, report = _quantized(model, recompute=True)
    layers, tokens = model.config.num_hidden_layers, batch["input_ids"].numel()
    # GELU kept its float32 input ([tokens, intermediate]) in each layer; the pooler's tanh kept its output
    expected = layers * tokens * 64 * 4 + 4 * model.config.hidden_size * 4
    assert _kept_bytes(plain, batch) - _kept_bytes(recomputing, batch) == expected
    precision = next(m.cpt_precision for m in recomputing.modules() if hasattr(m, "cpt_precision"))
    _gradients(recomputing, batch)
    hidden = model.config.hidden_size
    assert precision.recomputed_macs == layers * tokens * hidden * 64 + 4 * hidden * hidden  # FFN-in, pooler
    assert "activations that recompute their input where a product on codes feeds them: 3" in str(report)


def test_the_cost_meter_prices_the_recomputed_products_at_the_forward_bits():
    model = _bert()
    batch = _batch(model)
    totals = {}
    for recompute in (False, True):
        quantized, _ = _quantized(model, recompute)
        meter = CostMeter(quantized, static_bits=8, static_grad_bits=8)
        _gradients(quantized, batch)
        meter.end_step(6, 8)
        totals[recompute] = meter.totals
    precision = next(m.cpt_precision for m in quantized.modules() if hasattr(m, "cpt_precision"))
    assert totals[True].bitops - totals[False].bitops == precision.recomputed_macs * 6 * 6
    assert totals[True].static_bitops - totals[False].static_bitops == precision.recomputed_macs * 8 * 8
    assert totals[True].fp32_bitops == totals[False].fp32_bitops  # a plain run keeps the input


class _Block(nn.Module):
    def __init__(self, activation: nn.Module, edit: bool = False):
        super().__init__()
        self.up, self.act, self.down, self.edit = nn.Linear(32, 64), activation, nn.Linear(64, 32), edit

    def forward(self, x):
        h = self.up(x)
        if self.edit:
            h.mul_(1.0)  # edited in place after the product: no longer what the codes give
        return self.down(self.act(h))


@pytest.mark.parametrize("activation, edit", [(nn.ReLU(inplace=True), False), (nn.GELU(), True)])
def test_an_inplace_activation_or_an_edited_input_keeps_its_input(activation, edit):
    torch.manual_seed(0)
    block = _Block(activation, edit)
    quantized, report = _quantized(block, recompute=True)
    assert report.recomputing == ["act"]
    x = torch.randn(8, 16, 32, requires_grad=True)  # the first layer keeps its weight codes
    torch.manual_seed(1)  # the stochastic rounding of errors
    quantized(x).sum().backward()
    assert quantized.up.cpt_precision.recomputed_macs == 0
    reference, _ = _quantized(block, recompute=False)
    torch.manual_seed(1)
    reference(x).sum().backward()
    assert torch.equal(reference.up.weight.grad, quantized.up.weight.grad)


def test_a_bias_edited_between_forward_and_backward_does_not_change_the_gradients():
    """The recomputation uses the bias of the forward (an optimizer or FSDP may change or free the parameter)."""
    torch.manual_seed(0)
    block, x = _Block(nn.GELU()), torch.randn(8, 16, 32, requires_grad=True)
    gradients = {}
    for recompute in (False, True):
        quantized, _ = _quantized(block, recompute)
        torch.manual_seed(1)
        loss = quantized(x).sum()
        with torch.no_grad():
            quantized.up.bias.add_(1.0)
        loss.backward()
        gradients[recompute] = quantized.up.weight.grad
    assert quantized.up.cpt_precision.recomputed_macs > 0
    assert torch.equal(gradients[False], gradients[True])


def test_outputs_are_tagged_only_in_training_products():
    torch.manual_seed(0)
    quantized, _ = _quantized(_Block(nn.GELU()), recompute=True)
    x = torch.randn(8, 16, 32, requires_grad=True)  # the first layer keeps its weight codes
    assert hasattr(quantized.up(x), RECOMPUTABLE)
    with torch.no_grad():
        assert not hasattr(quantized.up(x), RECOMPUTABLE)
    quantized.eval()
    assert not hasattr(quantized.up(x), RECOMPUTABLE)
    off, _ = _quantized(_Block(nn.GELU()), recompute=False)
    assert not hasattr(off.up(x), RECOMPUTABLE)


def test_dequantize_restores_the_activation_and_a_converted_model_pickles():
    quantized, _ = _quantized(_bert(), recompute=True)
    act = quantized.bert.encoder.layer[0].intermediate.intermediate_act_fn
    from transformers.activations import GELUActivation

    assert isinstance(act, RecomputedActivationMixin) and isinstance(act, GELUActivation)
    copied = pickle.loads(pickle.dumps(quantized))
    assert type(copied.bert.encoder.layer[0].intermediate.intermediate_act_fn) is type(act)
    dequantize_model(quantized)
    assert type(act) is GELUActivation


def test_the_setting_is_validated():
    with pytest.raises(ConfigError, match="recompute_activation_inputs"):
        CPTConfig(recompute_activation_inputs="yes")
    with pytest.raises(ConfigError, match="integer_matmul 'activations' was removed: use True"):
        CPTConfig(integer_matmul="activations")
    with pytest.raises(ConfigError, match="integer_matmul must be one of"):
        CPTConfig(integer_matmul="sometimes")
