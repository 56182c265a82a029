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
    before = _logits(model, batch)
    layer.weight.data[0, 0] += 0.0  # the same values: still frozen
    assert layer.frozen_codes(8) is not None and torch.equal(_logits(model, batch), before)
    layer.weight.data[3] *= 4.0
    assert layer.frozen_codes(8) is None
    assert not torch.equal(_logits(model, batch), before)
