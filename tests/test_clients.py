"""hf_cpt models in clients the project did not write: peft's LoRA on a base loaded from a packed checkpoint, merged
and saved (docs/checkpoints.md)."""

from __future__ import annotations

import json

import pytest
import torch

from hf_cpt import CPTConfig, quantize_model, save_quantized, set_precision

from .fresh_python import run_python
from .helpers import tiny_bert_config


def _trained_packed_checkpoint(path) -> dict:
    """A tiny BERT quantized, trained a few steps at 8 bits and saved packed; the batch it is evaluated on."""
    from transformers import BertForSequenceClassification

    torch.manual_seed(0)
    model = BertForSequenceClassification(tiny_bert_config())
    quantize_model(model, CPTConfig())
    set_precision(model, 8, 8)
    model.train()
    batch = {"input_ids": torch.randint(5, 128, (4, 12)), "labels": torch.tensor([0, 1, 1, 0])}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    save_quantized(model, path, 8, model_card=False)
    return batch


def _lora_trained_on_loaded_base(path, batch):
    """The packed checkpoint loaded as users load it, LoRA added and trained a few steps (in training mode the base's
    layers quantize their master weights; in eval they compute with the loaded codes)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification

    base = AutoModelForSequenceClassification.from_pretrained(path)
    torch.manual_seed(1)
    peft_model = get_peft_model(base, LoraConfig(r=4, target_modules=["query", "value", "dense"],
                                                 task_type="SEQ_CLS"))
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=5e-2)
    peft_model.train()
    for _ in range(5):
        peft_model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return peft_model.eval()


def _logits(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=batch["input_ids"]).logits


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("safe_merge", [False, True])
def test_a_lora_merged_into_a_packed_loaded_base_keeps_the_fine_tune_saved_and_reloaded_elsewhere(tmp_path,
                                                                                                  safe_merge):
    """peft merges with ``weight.data += delta``, which moves no version counter: the loaded layers must still see
    the edit and leave their frozen codes. The merged model computes the unmerged LoRA model's function up to the
    8-bit quantization of the merged weight, far from the base's; saved packed and loaded in a fresh process it
    computes what the merged model does."""
    batch = _trained_packed_checkpoint(tmp_path / "base")
    peft_model = _lora_trained_on_loaded_base(tmp_path / "base", batch)
    unmerged = _logits(peft_model, batch)
    with peft_model.disable_adapter():
        base = _logits(peft_model, batch)
    fine_tune = _relative(base, unmerged)
    assert fine_tune > 0.05  # the adapters changed the model

    merged = peft_model.merge_and_unload(safe_merge=safe_merge)
    assert all(not name.endswith(("lora_A", "lora_B")) for name, _ in merged.named_modules())
    got = _logits(merged, batch)
    assert _relative(got, unmerged) < fine_tune / 5, (_relative(got, unmerged), fine_tune)
    save_quantized(merged, tmp_path / "merged", 8, model_card=False)
    torch.save(batch["input_ids"], tmp_path / "ids.pt")
    code = (
        "import json, sys, torch, hf_cpt; from transformers import AutoModelForSequenceClassification as A; "
        f"m = A.from_pretrained({str(tmp_path / 'merged')!r}).eval(); "
        f"ids = torch.load({str(tmp_path / 'ids.pt')!r}); "
        "print(json.dumps(m(input_ids=ids).logits.tolist()))"
    )
    result = run_python(["-c", code], check=True)
    reloaded = torch.tensor(json.loads(result.stdout.strip().splitlines()[-1]))
    assert _relative(reloaded, got) <= 1e-5


def test_an_edit_through_data_unfreezes_a_loaded_layer(tmp_path):
    """Any edit of a loaded layer's master weight is honoured, through ``.data`` too; the codes stay frozen while the
    weight is unchanged."""
    from transformers import AutoModelForSequenceClassification

    batch = _trained_packed_checkpoint(tmp_path)
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    layer = model.bert.encoder.layer[0].attention.self.query
    assert layer.frozen_codes(8) is not None
    assert "cpt_frozen_fingerprint" in dict(layer.named_buffers())  # moves with the model (.to("cuda"))
    before = _logits(model, batch)
    layer.weight.data[0, 0] += 0.0  # the same values: still frozen
    assert layer.frozen_codes(8) is not None and torch.equal(_logits(model, batch), before)
    layer.weight.data[3] *= 4.0
    assert layer.frozen_codes(8) is None
    assert not torch.equal(_logits(model, batch), before)


WORDS = "the a cat dog sat ran on in mat park big small red blue quickly slowly".split()


def _tiny_llama(vocab_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                        max_position_embeddings=64, tie_word_embeddings=False))


# TRL's default (bf16=True) leaves the trained model's forward under accelerate's autocast: a reloaded float32 model
# is compared under the same autocast (docs/clients.md). The test trains in FP32, where the two agree bit for bit.
BF16 = False


def test_trl_sft_trainer_with_the_callback_trains_says_how_to_save_and_the_saved_model_reloads_exactly(
        tmp_path, caplog):
    """TRL's SFTTrainer with `CPTCallback`, as its users write it (TRL's defaults): the cost logs appear; its
    save_model cannot be reached, so the callback says once how to save the trained model; saved that way, the model
    reloads in a fresh process computing what the trained one does."""
    import logging

    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from hf_cpt import CPTCallback

    from .helpers import build_word_tokenizer

    tokenizer = build_word_tokenizer(WORDS, str(tmp_path))
    tokenizer.eos_token = "[SEP]"
    rng = torch.Generator().manual_seed(0)
    texts = [" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (8,), generator=rng)) for _ in range(16)]
    model = _tiny_llama(len(tokenizer))
    config = CPTConfig(bits_min=4, bits_max=8, num_cycles=1, fidelity_threshold=None)
    quantize_model(model, config)
    args = SFTConfig(output_dir=str(tmp_path / "out"), max_steps=4, per_device_train_batch_size=4, logging_steps=1,
                     report_to=[], save_strategy="no", max_length=16, use_cpu=True, dataloader_num_workers=0,
                     bf16=BF16)
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"text": texts}),
                         processing_class=tokenizer, callbacks=[CPTCallback(config)])
    with caplog.at_level(logging.WARNING, logger="hf_cpt.integrations.callback"):
        trainer.train()
    steps = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["cpt/bits"] for h in steps] == [4, 5, 6, 7]  # the cycle, logged at every step
    assert caplog.text.count("this Trainer's save_model() writes the FP32 master weights") == 1
    assert "hf_cpt.save_quantized(trainer.model, output_dir, bits=8)" in caplog.text

    save_quantized(trainer.model, tmp_path / "saved", 8, model_card=False)
    ids = tokenizer(texts[:2], return_tensors="pt", padding=True)["input_ids"]
    trained = trainer.model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
        expected = trained(input_ids=ids).logits.float()
    torch.save(ids, tmp_path / "ids.pt")
    code = (
        "import json, torch, hf_cpt; from transformers import AutoModelForCausalLM as A; "
        f"m = A.from_pretrained({str(tmp_path / 'saved')!r}).eval(); ids = torch.load({str(tmp_path / 'ids.pt')!r}); "
        f"ctx = torch.autocast('cpu', dtype=torch.bfloat16, enabled={args.bf16}); "
        "ctx.__enter__(); print(json.dumps(m(input_ids=ids).logits.float().tolist()))"
    )
    reloaded = torch.tensor(json.loads(run_python(["-c", code], check=True).stdout.strip().splitlines()[-1]))
    assert _relative(reloaded, expected) <= 1e-5


def test_adapters_added_after_quantize_model_are_quantized_and_reload_with_peft_exactly(tmp_path):
    """The documented order (`quantize_model` with ``quantize_adapters=True``, then ``get_peft_model``, then the
    Trainer): the run starts by quantizing the adapters, which train at the schedule's bits; saved with peft's own
    ``save_pretrained`` and loaded with ``PeftModel.from_pretrained`` onto the quantized base, the adapters are
    quantized as they load, and the loaded model computes what the trained one does, bit for bit."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import BertForSequenceClassification, TrainingArguments

    from hf_cpt import CPTTrainer, quantize_adapters
    from hf_cpt.nn.base import QuantLayerMixin

    def base():
        torch.manual_seed(0)
        model = BertForSequenceClassification(tiny_bert_config())
        quantize_model(model, config)
        return model

    config = CPTConfig(bits_min=6, bits_max=8, num_cycles=1, quantize_adapters=True, fidelity_threshold=None)
    lora = LoraConfig(r=4, target_modules=["query", "value"], task_type="SEQ_CLS")
    model = get_peft_model(base(), lora)
    query = model.base_model.model.bert.encoder.layer[0].attention.self.query
    assert not isinstance(query.lora_A["default"], QuantLayerMixin)  # not yet: added after quantize_model
    rows = [{"input_ids": torch.randint(5, 128, (12,)), "labels": torch.tensor(i % 2)} for i in range(16)]
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=4, per_device_train_batch_size=4,
                             learning_rate=5e-2, report_to=[], save_strategy="no", use_cpu=True)
    CPTTrainer(model=model, args=args, cpt_config=config, train_dataset=rows).train()
    assert isinstance(query.lora_A["default"], QuantLayerMixin) and isinstance(query.lora_B["default"], QuantLayerMixin)
    model.eval()
    batch = {"input_ids": torch.stack([row["input_ids"] for row in rows[:4]])}
    expected = _logits(model, batch)
    with model.disable_adapter():
        assert _relative(_logits(model, batch), expected) > 1e-3  # the adapters trained

    model.save_pretrained(tmp_path / "adapter")  # plain peft, both ways
    loaded = PeftModel.from_pretrained(base(), tmp_path / "adapter")
    adapters = [module for name, module in loaded.named_modules()
                if name.endswith(("lora_A.default", "lora_B.default"))]
    assert len(adapters) == 8 and all(isinstance(module, QuantLayerMixin) for module in adapters)
    assert quantize_adapters(loaded, config).quantized == []  # nothing left to do
    set_precision(loaded, None)
    assert torch.equal(_logits(loaded.eval(), batch), expected)


def test_a_reader_without_hf_cpt_names_it_first_and_an_older_cpt_file_still_loads(tmp_path):
    """transformers (and lm-eval, which asks transformers for the config) print the quant_method in the first line
    they print about a packed checkpoint: it names hf-cpt and the fix, before any load report. A file written before
    the name changed (quant_method "cpt") loads with hf_cpt as before."""
    batch = _trained_packed_checkpoint(tmp_path / "packed")
    code = (
        "from transformers import AutoModelForSequenceClassification as A\n"
        f"try:\n    A.from_pretrained({str(tmp_path / 'packed')!r})\nexcept RuntimeError:\n    print('REFUSED')\n"
        "from transformers.quantizers.auto import AutoQuantizationConfig\n"
        "import json\n"
        f"config = json.load(open({str(tmp_path / 'packed' / 'config.json')!r}))['quantization_config']\n"
        "try:\n    AutoQuantizationConfig.from_dict(config)\nexcept ValueError as error:\n"
        "    print('LM-EVAL PATH:', str(error).splitlines()[0])\n"
    )
    result = run_python(["-c", code])
    lines = [line for line in (result.stderr + result.stdout).splitlines() if line.strip()]
    assert "REFUSED" in result.stdout
    hint = "needs hf-cpt (pip install hf-cpt), then import hf_cpt"
    assert hint in lines[0], lines[:3]  # the first line printed, before the load report
    assert hint in result.stdout.split("LM-EVAL PATH:")[1]

    from transformers import AutoModelForSequenceClassification

    expected = _logits(AutoModelForSequenceClassification.from_pretrained(tmp_path / "packed"), batch)
    config_file = tmp_path / "packed" / "config.json"
    config = json.loads(config_file.read_text())
    config["quantization_config"]["quant_method"] = "cpt"  # as files written before 2026-12-04 hold it
    config_file.write_text(json.dumps(config))
    assert torch.equal(_logits(AutoModelForSequenceClassification.from_pretrained(tmp_path / "packed"), batch),
                       expected)
