"""CPT combined with the rest of the stack: peft LoRA, bf16 autocast, gradient checkpointing, accumulation, compile.

Each composition is a function of the device it runs on: the tests here run them on the CPU, tests/test_cuda.py on a
GPU with the CUDA backend (`COMPOSITIONS`)."""

import pytest
import torch
from transformers import BertForSequenceClassification, TrainingArguments

import hf_cpt
from hf_cpt import CPTConfig, CPTTrainer, quantize_model, save_quantized, set_eval_precision, set_precision
from hf_cpt.nn.attention import find_attention_quantizer
from hf_cpt.nn.base import QuantLayerMixin

from .helpers import tiny_bert_config


def _data(n=32, seq_len=12):
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 128, (n, seq_len), generator=generator)
    return [{"input_ids": row, "labels": int(row[0] % 3)} for row in ids]


def _args(tmp_path, device="cpu", **overrides):
    values = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=3, logging_steps=1,
                  save_strategy="no", report_to="none", use_cpu=device == "cpu", disable_tqdm=True, seed=0,
                  data_seed=0, learning_rate=1e-3)
    values.update(overrides)
    return TrainingArguments(**values)


def _model(layers: int = 2):
    torch.manual_seed(0)
    return BertForSequenceClassification(tiny_bert_config(layers=layers))


def _losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_lora_after_quantization_saves_loads_merges_and_exports(tmp_path):
    lora_after_quantization(tmp_path, "cpu")


def lora_after_quantization(tmp_path, device: str) -> None:
    from peft import LoraConfig, PeftModel, get_peft_model

    model = _model().to(device)
    quantize_model(model, CPTConfig())
    lora = LoraConfig(r=4, target_modules=["query", "value"], task_type="SEQ_CLS", init_lora_weights=False)
    peft_model = get_peft_model(model, lora)
    query = peft_model.base_model.model.bert.encoder.layer[0].attention.self.query
    assert isinstance(query.base_layer, QuantLayerMixin) and not isinstance(query.lora_A["default"], QuantLayerMixin)
    set_precision(peft_model, 4, 8)
    peft_model.train()
    batch = {"input_ids": torch.randint(5, 128, (4, 10), device=device)}
    peft_model(**batch).logits.sum().backward()
    assert query.lora_A["default"].weight.grad is not None and query.base_layer.weight.grad is None  # frozen base
    peft_model.eval()
    set_eval_precision(peft_model, 6)
    with torch.no_grad():
        expected = peft_model(**batch).logits

    peft_model.save_pretrained(tmp_path / "adapter")  # plain peft: adapters only, FP32
    base = _model().to(device)
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

    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "merged", device_map=device)
    with torch.no_grad():
        got = loaded(**batch).logits
    assert float((got - reference).abs().max() / reference.abs().max()) <= 1e-5


def test_bf16_autocast_trains(tmp_path):
    bf16_autocast_trains(tmp_path, "cpu")


def bf16_autocast_trains(tmp_path, device: str) -> None:
    trainer = CPTTrainer(model=_model(), args=_args(tmp_path, device, bf16=True), train_dataset=_data(),
                         cpt_config=CPTConfig(bits_min=4, num_cycles=1))
    trainer.train()
    losses = _losses(trainer)
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    assert trainer.cpt_callback.meter.totals.steps == 3


def test_gradient_checkpointing_gives_the_same_first_loss(tmp_path):
    gradient_checkpointing_gives_the_same_first_loss(tmp_path, "cpu")


def gradient_checkpointing_gives_the_same_first_loss(tmp_path, device: str) -> None:
    config = CPTConfig(bits_min=4, num_cycles=1)
    plain = CPTTrainer(model=_model(), args=_args(tmp_path / "a", device), train_dataset=_data(), cpt_config=config)
    plain.train()
    checkpointed = CPTTrainer(model=_model(), args=_args(tmp_path / "b", device, gradient_checkpointing=True),
                              train_dataset=_data(), cpt_config=config)
    checkpointed.train()
    assert _losses(checkpointed)[0] == pytest.approx(_losses(plain)[0], rel=1e-6)  # same forward
    assert all(torch.isfinite(torch.tensor(_losses(checkpointed))))


def test_gradient_accumulation_counts_every_micro_batch(tmp_path):
    gradient_accumulation_counts_every_micro_batch(tmp_path, "cpu")


def gradient_accumulation_counts_every_micro_batch(tmp_path, device: str) -> None:
    config = CPTConfig(bits_min=4, num_cycles=1)
    accumulated = CPTTrainer(model=_model(), args=_args(tmp_path / "a", device, per_device_train_batch_size=4,
                                                        gradient_accumulation_steps=2),
                             train_dataset=_data(), cpt_config=config)
    accumulated.train()
    whole = CPTTrainer(model=_model(), args=_args(tmp_path / "b", device, per_device_train_batch_size=8),
                       train_dataset=_data(), cpt_config=config)
    whole.train()
    a, b = accumulated.cpt_callback.meter.totals, whole.cpt_callback.meter.totals
    assert a.steps == b.steps == 3 and a.steps_at_bits == b.steps_at_bits
    # the same GEMM work, and the same rotations: each weight is rotated once per step, not once per micro-batch
    assert a.bitops - a.rotation_bitops == pytest.approx(b.bitops - b.rotation_bitops, rel=1e-9)
    assert a.fp32_bitops == pytest.approx(b.fp32_bitops, rel=1e-9)
    assert a.rotation_bitops == pytest.approx(b.rotation_bitops, rel=1e-9) and a.rotation_bitops > 0
    assert hf_cpt.find_precision_state(accumulated.model).current[0] is not None


def _assert_compiled_once(counters, model) -> None:
    """One graph, and the model's forward compiled once."""
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert counters["frames"]["total"] == 1, dict(counters["frames"])


@pytest.mark.slow
def test_torch_compile_visits_every_bit_width_and_accumulates_without_recompiling(tmp_path):
    compile_visits_every_bit_width(tmp_path, "cpu")


def compile_visits_every_bit_width(tmp_path, device: str) -> None:
    """`torch_compile=True` under the Trainer, two micro-batches per step: a run through bits 3..8 compiles its
    graph once, and its cost meter counts the MACs the same run counts eagerly."""
    from torch._dynamo.utils import counters

    totals = {}
    for compiled in (True, False):
        torch._dynamo.reset()
        counters.clear()
        # float products: an eager run on codes recomputes its activations' inputs, which a compiled graph does not
        config = CPTConfig(schedule="cpt", bits_min=3, num_cycles=1, fidelity_threshold=None,
                           quantize_attention=True, integer_matmul=False)
        compile_args = {"torch_compile": True, "torch_compile_backend": "eager"} if compiled else {}
        model = _model(layers=1)  # one block: dynamo's tracing takes seconds a block
        model.config.problem_type = "single_label_classification"  # else set by the first call: a guard that fails
        trainer = CPTTrainer(model=model, args=_args(tmp_path / str(compiled), device, max_steps=12,
                                                        per_device_train_batch_size=4, gradient_accumulation_steps=2,
                                                        **compile_args),
                             train_dataset=_data(96), cpt_config=config)
        trainer.train()
        bits = {h["cpt/bits"] for h in trainer.state.log_history if "cpt/bits" in h}
        assert bits == set(range(3, 9)), bits
        assert all(torch.isfinite(torch.tensor(_losses(trainer))))
        totals[compiled] = trainer.cpt_callback.meter.totals
        if compiled:
            # One compilation: nothing of hf_cpt's state is a guard, not the bits, not the weight-reuse epoch the
            # Trainer advances, not the MACs the cost meter and the attention count in every micro-batch
            # (`hf_cpt.nn.tally`). Dynamo gives up compiling after 8 recompilations and would run the rest eagerly,
            # silently.
            _assert_compiled_once(counters, model)
    compiled, eager = totals[True], totals[False]
    assert compiled.quantized_macs == eager.quantized_macs > 0 and compiled.float_macs == eager.float_macs > 0
    assert compiled.bitops - compiled.rotation_bitops == eager.bitops - eager.rotation_bitops
    # A compiled forward quantizes each weight anew (no reuse across an accumulated step's micro-batches: the epoch
    # would be a guard), and the meter counts those rotations.
    assert compiled.rotation_bitops > eager.rotation_bitops
    torch._dynamo.reset()


def test_a_compiled_model_outside_the_trainer_is_not_recompiled_by_the_counts_of_its_forwards():
    """A loop of its own around a compiled model (no Trainer to reset the counts between steps): the attention's MAC
    count grows with every training forward and is no guard of the graph (`hf_cpt.nn.tally`)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = _model(layers=1)  # one block: dynamo's tracing takes seconds a block
    model.config.problem_type = "single_label_classification"  # else set by the first call: a guard that fails
    quantize_model(model, CPTConfig())
    model.train()
    compiled = torch.compile(model, backend="eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    ids, labels = torch.randint(5, 128, (2, 8)), torch.tensor([0, 1])
    attention = find_attention_quantizer(model)
    for step, bits in enumerate((4, 6, 8, 5)):
        set_precision(model, bits, 8)
        compiled(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
        if step == 0:
            per_forward = attention.float_macs.count
    assert per_forward > 0 and attention.float_macs.count == 4 * per_forward  # counted in every compiled forward
    _assert_compiled_once(counters, model)
    torch._dynamo.reset()


# What tests/test_cuda.py runs on a GPU: each composition above, as a function of the device.
COMPOSITIONS = {"lora": lora_after_quantization, "bf16-autocast": bf16_autocast_trains,
                "gradient-checkpointing": gradient_checkpointing_gives_the_same_first_loss,
                "gradient-accumulation": gradient_accumulation_counts_every_micro_batch,
                "compile": compile_visits_every_bit_width}
