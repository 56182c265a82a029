"""Operations per training step on the path a GPU takes: plain model against its CPT 8/8 copy.

On a GPU each operation is one kernel launch, and at fine-tuning sizes a step is bound by launches, not by
arithmetic: the number of operations per step is what its time follows there. This counts them on the CPU, where
the count is the same: every dispatched torch operation of one training step (forward, backward, AdamW), without
views, allocations and host reads (no kernel). The C kernels for codes, ranges and rotations and the products on
integer codes are turned off (CPU-only), so that the quantized model runs the torch formulas a GPU runs. The fused
error quantizer stays the C kernel here and is not counted (one compiled kernel per quantized error on a GPU). Each
step is counted in float32 and under bf16 autocast (a GPU run with ``bf16=True``). Run:

    python bench/op_counts.py            # writes bench/results/op_counts.json; bench/report.py renders it

The counts do not depend on the machine's speed, so one process and one step per model suffice.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import overhead  # noqa: E402  (sets the offline environment first)
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

DEFAULT_OUTPUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "op_counts.json")
# No kernel runs for these: allocations (on a GPU the caching allocator hands out memory it holds), a view that
# dispatch does not mark as one, and a read of a value on the host (`.item()`; the quantized step's own come from the
# CPU's C error kernel reading its arguments, which a GPU does not run).
NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_unsafe_view",
             "_local_scalar_dense"}
MODELS = {"minilm": ("pretrained MiniLM, batch 32x128", overhead.minilm),
          "bert-base-16": ("BERT-base, batch 16x128", overhead.bert_base_16),
          "gpt2": ("GPT-2 small, batch 2x128", overhead.gpt2_small),
          "vit-s": ("ViT-S/16 (timm), batch 4x224^2", overhead.vit_small)}


class OperationCounter(TorchDispatchMode):
    """Counts the torch operations dispatched inside it that launch a kernel (views, allocations and host reads
    excluded)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not func.is_view and name not in NO_KERNEL:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def count_step(step) -> collections.Counter:
    step()  # the first step builds optimizer state and caches
    with OperationCounter() as counter:
        step()
    return counter.counts


def under_bf16_autocast(step):
    """``step`` under bf16 autocast (how a GPU run with ``bf16=True`` trains; on the CPU, CPU autocast's casts)."""
    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            step()
    return run


def count_model(kind: str) -> dict:
    """The operations of one training step of ``kind``'s plain model and of its CPT 8/8 copy, in float32 and under
    bf16 autocast, with the ten most frequent operations of the float32 quantized step."""
    name, builder = MODELS[kind]
    plain_step, quantized_step = overhead.model_steps(*builder(), fused=True)
    quantized_step = overhead.with_float_products(overhead.with_torch_formulas(quantized_step))
    plain, quantized = count_step(plain_step), count_step(quantized_step)
    plain_bf16 = count_step(under_bf16_autocast(plain_step))
    quantized_bf16 = count_step(under_bf16_autocast(quantized_step))
    return {"case": name, "plain_ops": sum(plain.values()), "quant_ops": sum(quantized.values()),
            "plain_ops_bf16": sum(plain_bf16.values()), "quant_ops_bf16": sum(quantized_bf16.values()),
            "top_quant_ops": dict(quantized.most_common(10))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--output", default=DEFAULT_OUTPUT)
    args = parser.parse_args()
    rows = []
    for kind in args.only:
        if kind == "minilm" and overhead.minilm_path() is None:
            print("minilm: the pretrained model is not installed (the bench extra); skipped")
            continue
        row = count_model(kind)
        rows.append(row)
        print(f"{row['case']:40s} plain {row['plain_ops']:6d}  CPT 8/8 {row['quant_ops']:6d}  "
              f"ratio {row['quant_ops'] / row['plain_ops']:.2f}  bf16 autocast: plain {row['plain_ops_bf16']:6d}  "
              f"CPT 8/8 {row['quant_ops_bf16']:6d}  ratio {row['quant_ops_bf16'] / row['plain_ops_bf16']:.2f}")
    command = "python bench/op_counts.py" + ("" if args.only == list(MODELS) else " --only " + " ".join(args.only))
    with open(args.output, "w") as f:
        json.dump({"command": command, "torch": torch.__version__, "rows": rows}, f, indent=1)
    print(f"results: {args.output}")


if __name__ == "__main__":
    main()
