"""Size of packed CPT checkpoints relative to the FP32 safetensors, at 8 and 4 bits.

Models are built from their configs (``BertConfig()``, ``GPT2Config()``, timm ResNet-50; random weights:
sizes do not depend on the values), converted with `hf_cpt.quantize_model` and given activation ranges
by one training-mode forward. Columns:

* ``exact+emb``: the default export (exact) of a model trained with ``quantize_embeddings=True``
  (embedding tables trained quantized, stored as their exact codes). Targets: 8-bit <= 0.27,
  4-bit <= 0.15.
* ``exact``: the default export of a model whose embeddings trained in FP32 (kept exact: larger).
* ``rounded``: the lossy opt-in ``float_weight_bits="auto"`` (FP32-trained weights rounded after
  training), for comparison.

    python bench/checkpoint_size.py                # BERT-base, GPT-2 (124M), ResNet-50 shapes
    python bench/checkpoint_size.py --large        # also BERT-large and GPT-2 medium shapes
    python bench/checkpoint_size.py --models bert-base
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

import hf_cpt  # noqa: E402
from hf_cpt.serialization.save import checkpoint_size, plain_model

TARGETS = {8: 0.27, 4: 0.15}


def bert(large: bool = False):
    from transformers import BertConfig, BertForSequenceClassification

    size = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096) if large else {}
    model = BertForSequenceClassification(BertConfig(num_labels=3, **size))
    return model, {"input_ids": torch.randint(0, 30522, (1, 16))}


def gpt2(medium: bool = False):
    from transformers import GPT2Config, GPT2LMHeadModel

    size = dict(n_embd=1024, n_layer=24, n_head=16) if medium else {}
    return GPT2LMHeadModel(GPT2Config(**size)), {"input_ids": torch.randint(0, 50257, (1, 16))}


def resnet50():
    from transformers import TimmWrapperConfig, TimmWrapperForImageClassification

    model = TimmWrapperForImageClassification(TimmWrapperConfig(architecture="resnet50", num_labels=1000))
    return model, {"pixel_values": torch.randn(2, 3, 64, 64)}


MODELS = {
    "bert-base": lambda: bert(),
    "gpt2": lambda: gpt2(),
    "resnet50": resnet50,
    "bert-large": lambda: bert(large=True),
    "gpt2-medium": lambda: gpt2(medium=True),
}


def _calibrated(name: str, quantize_embeddings: bool):
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    hf_cpt.quantize_model(model, hf_cpt.CPTConfig(quantize_embeddings=quantize_embeddings))
    model.train()
    hf_cpt.set_precision(model, 8, 8)
    with torch.no_grad():
        model(**inputs)  # activation ranges
    model.eval()
    return model


def measure(name: str, workdir: str) -> dict:
    model = _calibrated(name, quantize_embeddings=False)
    params = sum(p.numel() for p in model.parameters())
    fp32_dir = os.path.join(workdir, "fp32")
    with plain_model(model):
        model.save_pretrained(fp32_dir)
    fp32 = checkpoint_size(fp32_dir)
    row = {"model": name, "params": params, "fp32_mb": fp32 / 1e6}
    quantized_embeddings = _calibrated(name, quantize_embeddings=True)
    for bits in (8, 4):
        for label, source, float_weight_bits in (("exact+emb", quantized_embeddings, None), ("exact", model, None),
                                                 ("rounded", model, "auto")):
            directory = os.path.join(workdir, f"{bits}-{label}")
            start = time.perf_counter()
            hf_cpt.save_quantized(source, directory, bits, float_weight_bits=float_weight_bits, model_card=False)
            row[f"{bits}-{label}"] = checkpoint_size(directory) / fp32
            row[f"{bits}-{label}-s"] = time.perf_counter() - start
            shutil.rmtree(directory)
    shutil.rmtree(fp32_dir)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["bert-base", "gpt2", "resnet50"])
    parser.add_argument("--large", action="store_true", help="also BERT-large and GPT-2 medium shapes")
    args = parser.parse_args()
    names = list(args.models) + (["bert-large", "gpt2-medium"] if args.large else [])
    print(f"hf_cpt {hf_cpt.__version__}, torch {torch.__version__}; size / FP32 safetensors size")
    header = (
        f"{'model':<12} {'params':>8} {'FP32 MB':>8} | {'8 exact+emb':>11} {'8 exact':>7} {'8 rounded':>9} | "
        f"{'4 exact+emb':>11} {'4 exact':>7} {'4 rounded':>9} | targets (exact+emb) 8<=0.27, 4<=0.15"
    )
    print(header)
    print("-" * len(header))
    for name in names:
        with tempfile.TemporaryDirectory() as workdir:
            row = measure(name, workdir)
        ok = row["8-exact+emb"] <= TARGETS[8] and row["4-exact+emb"] <= TARGETS[4]
        print(
            f"{row['model']:<12} {row['params'] / 1e6:>7.1f}M {row['fp32_mb']:>8.1f} | {row['8-exact+emb']:>11.3f} "
            f"{row['8-exact']:>7.3f} {row['8-rounded']:>9.3f} | {row['4-exact+emb']:>11.3f} {row['4-exact']:>7.3f} "
            f"{row['4-rounded']:>9.3f} | {'met' if ok else 'NOT met'} (packing {row['8-exact+emb-s']:.1f} s)",
            flush=True,
        )
    print(
        "\nexact+emb: trained with quantize_embeddings=True, default (exact) export; exact: embeddings trained in "
        "FP32 and kept exact; rounded: float_weight_bits='auto' (lossy, measured at export)."
    )


if __name__ == "__main__":
    main()
