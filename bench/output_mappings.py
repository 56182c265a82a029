"""What handing blocks on in mappings of their own saves and costs: each model step's peak memory and time with the
outputs and input gradients of 1 MiB or more that quantized Linear and Conv1D layers, GELUs and dropouts make in CPU
training in mappings of their own (`CPTConfig.output_mappings`, the default) and from torch's allocator, beside the
plain model's, every side with the AdamW that transformers' Trainer makes by default (fused).

For each model case: how many blocks one step maps and their MiB, then the peak resident memory (VmHWM) of the plain
model and of the CPT 8/8 model both ways, in fresh processes that train until the peak settles, as
`bench/overhead.py` measures it: under glibc's default allocator (``--processes`` per arm, interleaved) and with its
mmap threshold fixed (one each); with ``--repeats``, each step's time both ways beside the plain step's (one process,
interleaved repeats, medians). Resumable: a case already in the output file is skipped (one measured without times
gets them). ``python bench/report.py`` renders the JSON into docs/benchmarks.md.
"""

from __future__ import annotations

import copy
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import overhead  # noqa: E402  (the bench's model builders and fresh-process peaks)
import setting_arms  # noqa: E402

from hf_cpt.numerics import scratch  # noqa: E402

CASES = {  # key -> the bench's model builder (the CNN: its convolutions take no mappings, docs/method.md §2)
    "bert-base-16": "bert_base_16", "minilm": "minilm", "vit-s": "vit_small", "gpt2": "gpt2_small",
    "resnet20": "resnet20",
}
ARMS = ("plain", "own mappings", "heap")
HEAP = {"output_mappings": False}
ADAMW = "fused"  # the model steps' AdamW (`overhead.ADAMW_CHOICES`): the Trainer's default, as users train


def blocks_mapped(kind: str) -> dict[str, float]:
    """How many blocks one training step (the second step's) hands on in mappings of their own, their MiB, and how
    many smaller ones it asked for that torch's allocator served."""
    counts = {"mapped": 0, "mapped_mib": 0.0, "heap": 0}
    handed_on = scratch.handed_on
    counting = setting_arms.counting_sizes(handed_on, scratch.HANDED_ON_MAPPING_BYTES, counts)
    build, batch = getattr(overhead, kind)()
    torch.manual_seed(0)
    step = overhead.training_step(overhead.cpt_copy(build(), True), batch)
    step()
    scratch.handed_on = counting  # read through the module by every caller
    try:
        step()
    finally:
        scratch.handed_on = handed_on
    return counts


def step_times_ms(kind: str, repeats: int) -> dict[str, float]:
    """Median milliseconds a training step takes: the plain model, its CPT 8/8 copy handing blocks on in mappings of
    their own, and a second copy with the same weights taking them from torch's allocator."""
    build, batch = getattr(overhead, kind)()
    plain, mapped = overhead.model_pair(build, True)
    heap = overhead.cpt_copy(copy.deepcopy(plain), True, **HEAP)
    return setting_arms.step_times_ms({"plain": overhead.training_step(plain, batch),
                                       "own mappings": overhead.training_step(mapped, batch),
                                       "heap": overhead.training_step(heap, batch)}, repeats)


def measure(key: str, processes: int) -> dict:
    return {"adamw": ADAMW, "blocks": blocks_mapped(CASES[key]),
            **setting_arms.arm_peaks(CASES[key], processes, {}, [HEAP], ARMS)}


def main() -> None:
    setting_arms.main(__doc__.split("\n\n")[0], list(CASES), os.path.join(HERE, "results", "output_mappings.json"),
                      measure, lambda key, repeats: step_times_ms(CASES[key], repeats),
                      skip=lambda key: setting_arms.missing_model(CASES[key]), adamw=ADAMW)


if __name__ == "__main__":
    main()
