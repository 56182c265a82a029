"""CPT combined with the rest of the stack: peft LoRA, bf16 autocast, gradient checkpointing, accumulation."""

import pytest
import torch
from transformers import BertForSequenceClassification, TrainingArguments

import hf_cpt
from hf_cpt import CPTConfig, CPTTrainer, quantize_model, save_quantized, set_eval_precision, set_precision
from hf_cpt.nn.base import QuantLayerMixin

from .helpers import tiny_bert_config


def _data(n=32, seq_len=12):
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 128, (n, seq_len), generator=generator)
    return [{"input_ids": row, "labels": int(row[0] % 3)} for row in ids]


def _args(tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=3, logging_steps=1,
                  save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True, seed=0, data_seed=0,
                  learning_rate=1e-3)
    values.update(overrides)
    return TrainingArguments(**values)


def _model():
    torch.manual_seed(0)
    return BertForSequenceClassification(tiny_bert_config())


def _losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_lora_after_quantization_saves_loads_merges_and_exports(tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    model = _model()
    quantize_model(model, CPTConfig())
    lora = LoraConfig(r=4, target_modules=["query", "value"], task_type="SEQ_CLS", init_lora_weights=False)
    peft_model = get_peft_model(model, lora)
    query = peft_model.base_model.model.bert.encoder.layer[0].attention.self.query
    assert isinstance(query.base_layer, QuantLayerMixin) and not isinstance(query.lora_A["default"], QuantLayerMixin)
    set_precision(peft_model, 4, 8)
    peft_model.train()
    batch = {"input_ids": torch.randint(5, 128, (4, 10))}
    peft_model(**batch).logits.sum().backward()
    assert query.lora_A["default"].weight.grad is not None and query.base_layer.weight.grad is None  # frozen base
    peft_model.eval()
    set_eval_precision(peft_model, 6)
    with torch.no_grad():
        expected = peft_model(**batch).logits

    peft_model.save_pretrained(tmp_path / "adapter")  # plain peft: adapters only, FP32
    base = _model()
    quantize_model(base, CPTConfig())
    reloaded = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    set_eval_precision(reloaded, 6)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch).logits, expected)

    merged = peft_model.merge_and_unload()
    assert isinstance(merged.bert.encoder.layer[0].attention.self.query, QuantLayerMixin)
    set_precision(merged, 6, 8)
    merged.train()
    merged(**batch)  # activation ranges of the per-tensor layers (none by default, but harmless)
    merged.eval()
    set_eval_precision(merged, 6)
    with torch.no_grad():
        reference = merged(**batch).logits
    save_quantized(merged, tmp_path / "merged", bits=6, model_card=False)
    from transformers import AutoModelForSequenceClassification

    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "merged")
    with torch.no_grad():
        got = loaded(**batch).logits
    assert float((got - reference).abs().max() / reference.abs().max()) <= 1e-5


def test_bf16_autocast_trains(tmp_path):
    trainer = CPTTrainer(model=_model(), args=_args(tmp_path, bf16=True), train_dataset=_data(),
                         cpt_config=CPTConfig(bits_min=4, num_cycles=1))
    trainer.train()
    losses = _losses(trainer)
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    assert trainer.cpt_callback.meter.totals.steps == 3


def test_gradient_checkpointing_gives_the_same_first_loss(tmp_path):
    config = CPTConfig(bits_min=4, num_cycles=1)
    plain = CPTTrainer(model=_model(), args=_args(tmp_path / "a"), train_dataset=_data(), cpt_config=config)
    plain.train()
    checkpointed = CPTTrainer(model=_model(), args=_args(tmp_path / "b", gradient_checkpointing=True),
                              train_dataset=_data(), cpt_config=config)
    checkpointed.train()
    assert _losses(checkpointed)[0] == pytest.approx(_losses(plain)[0], rel=1e-6)  # same forward
    assert all(torch.isfinite(torch.tensor(_losses(checkpointed))))


def test_gradient_accumulation_counts_every_micro_batch(tmp_path):
    config = CPTConfig(bits_min=4, num_cycles=1)
    accumulated = CPTTrainer(model=_model(), args=_args(tmp_path / "a", per_device_train_batch_size=4,
                                                        gradient_accumulation_steps=2),
                             train_dataset=_data(), cpt_config=config)
    accumulated.train()
    whole = CPTTrainer(model=_model(), args=_args(tmp_path / "b", per_device_train_batch_size=8),
                       train_dataset=_data(), cpt_config=config)
    whole.train()
    a, b = accumulated.cpt_callback.meter.totals, whole.cpt_callback.meter.totals
    assert a.steps == b.steps == 3 and a.steps_at_bits == b.steps_at_bits
    # the same GEMM work, and the same rotations: each weight is rotated once per step, not once per micro-batch
    assert a.bitops - a.rotation_bitops == pytest.approx(b.bitops - b.rotation_bitops, rel=1e-9)
    assert a.fp32_bitops == pytest.approx(b.fp32_bitops, rel=1e-9)
    assert a.rotation_bitops == pytest.approx(b.rotation_bitops, rel=1e-9) and a.rotation_bitops > 0
    assert hf_cpt.find_precision_state(accumulated.model).current[0] is not None


@pytest.mark.slow
def test_torch_compile_visits_every_bit_width_without_recompiling_for_them(tmp_path):
    """`torch_compile=True` under the Trainer: a run through bits 3..8 compiles no more graphs than a static one."""
    from torch._dynamo.utils import counters

    graphs = {}
    for schedule in ("static", "cpt"):
        torch._dynamo.reset()
        counters.clear()
        config = CPTConfig(schedule=schedule, bits_min=3, num_cycles=1, fidelity_threshold=None,
                           quantize_attention=True)
        trainer = CPTTrainer(model=_model(), args=_args(tmp_path / schedule, max_steps=12, torch_compile=True,
                                                        torch_compile_backend="eager"),
                             train_dataset=_data(96), cpt_config=config)
        trainer.train()
        bits = {h["cpt/bits"] for h in trainer.state.log_history if "cpt/bits" in h}
        assert bits == ({8} if schedule == "static" else set(range(3, 9))), bits
        assert all(torch.isfinite(torch.tensor(_losses(trainer))))
        graphs[schedule] = counters["stats"]["unique_graphs"]
        # 12 steps, 2 compilations: the first, and one for transformers' own `problem_type` guard (set by the first
        # step). Nothing of hf_cpt's state (bits, the weight-reuse epoch the Trainer advances each step) is a guard:
        # dynamo gives up compiling after 8 recompilations and would run the rest eagerly, silently.
        assert counters["frames"]["total"] <= 2, (schedule, dict(counters["frames"]))
    assert 0 < graphs["cpt"] <= graphs["static"], graphs  # bits are data, not guards: no graph per bit-width
    torch._dynamo.reset()
