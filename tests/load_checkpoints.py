"""Load a batch of CPT checkpoints in this (fresh) process, as a user on another machine does.

Run by tests/test_serialization_fresh_process.py: ``python tests/load_checkpoints.py manifest.json``. For each
entry it loads ``entry["path"]`` with ``import hf_cpt`` and ``from_pretrained`` (with the entry's keyword
arguments), compares the outputs on the saved inputs with the trained model's, and prints one JSON line per
entry. ``resave`` saves the loaded model again (a second hop), after a few more training steps with
``train_more``; the outputs that checkpoint must reproduce go to ``<resave>.io.pt``.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch


def main(manifest_path: str) -> None:
    import transformers

    import hf_cpt  # noqa: F401  (registers the cpt quantization method)
    from hf_cpt.convert import quant_layers

    for entry in json.load(open(manifest_path)):
        auto_class = getattr(transformers, entry["auto_class"])
        kwargs = dict(entry.get("load_kwargs", {}))
        if "torch_dtype" in kwargs:
            kwargs["torch_dtype"] = getattr(torch, kwargs["torch_dtype"])
        model = auto_class.from_pretrained(entry["path"], **kwargs)
        io = torch.load(entry["io"])
        inputs, expected = io["inputs"], io["expected"].cpu()
        device = next(model.parameters()).device  # device_map="cuda" puts the model on a GPU
        with torch.no_grad():
            got = model(**{k: v.to(device) for k, v in inputs.items()}).logits.cpu()
        result = {
            "name": entry["name"],
            "max_rel_diff": float((got.float() - expected).abs().max() / expected.abs().max()),
            "device": str(device),
            "dtype": str(next(model.parameters()).dtype),
            "training": model.training,
            "layers_frozen": sum(1 for _, layer in quant_layers(model) if "_frozen" in layer.__dict__),
            "format_version": model.config.quantization_config.format_version,
            # how the loaded model would quantize errors if trained further
            "errors": list(dataclasses.astuple(hf_cpt.find_precision_state(model).errors)),
            "weight_range": hf_cpt.find_precision_state(model).weight_range,
        }
        if entry.get("train_more"):
            result.update(train_further(model, inputs, entry))
        if entry.get("resave"):
            model.save_pretrained(entry["resave"])
            if not entry.get("train_more"):  # the second hop must still reproduce the trained model
                torch.save(io, entry["resave"] + ".io.pt")
        print("RESULT " + json.dumps(result), flush=True)


def train_further(model, inputs, entry) -> dict:
    """A few CPT steps on the loaded model: weights move, the frozen codes give way to the master weights."""
    import hf_cpt
    from hf_cpt.convert import quant_layers

    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    hf_cpt.set_precision(model, 6, 8)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(3):
        loss = model(**inputs).logits.float().pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    model.eval()
    with torch.no_grad():
        expected = model(**inputs).logits
    torch.save({"inputs": inputs, "expected": expected}, entry["resave"] + ".io.pt")
    moved = sum(not torch.equal(p, before[name]) for name, p in model.named_parameters())
    still_frozen = sum(1 for _, layer in quant_layers(model) if layer.frozen_codes(entry["bits"]) is not None)
    return {"losses": losses, "parameters_moved": moved, "still_frozen_after_training": still_frozen}


if __name__ == "__main__":
    main(sys.argv[1])
