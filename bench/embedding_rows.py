"""What handing an embedding's gradient over as rows saves: each model step's peak memory with the tables whose
gradient adds to another's handing autograd only their looked-up rows (`CPTConfig.embedding_row_gradients`, the
default) and with aten's dense table gradient instead, beside the plain model's.

GPT-2 ties its output head to its token table, so the table's gradient has two parts in every backward. Its step runs
with torch's AdamW as the other benches do (on the CPU one parameter at a time, with temporaries the size of each
parameter), with the fused AdamW that transformers' Trainer makes by default (``optim="adamw_torch_fused"``, no such
temporaries), and as 4 accumulated micro-batches (where the untied position table's gradient adds to ``.grad`` too).
Peak resident memory (VmHWM) in fresh processes that train until the peak settles, as `bench/overhead.py` measures
it: under glibc's default allocator (``--processes`` per arm, interleaved) and with its mmap threshold fixed (one
each); with ``--repeats``, each step's time both ways beside the plain step's (one process, interleaved repeats,
medians). Resumable: a case already in the output file is skipped (one measured without times gets them). ``python
bench/report.py`` renders the JSON into docs/benchmarks.md.
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

from hf_cpt.nn import embedding_rows  # noqa: E402

CASES = {  # key -> (the bench's model builder, AdamW's settings, micro-batches a step)
    "gpt2": ("gpt2_small", {}, 1), "gpt2-fused-adamw": ("gpt2_small", {"fused": True}, 1),
    "gpt2-accumulate": ("gpt2_small", {}, 4),
}
DENSE = {"embedding_row_gradients": False}


def lookups_as_rows(kind: str) -> dict[str, int]:
    """How many of one training step's embedding lookups (the second step's, of all its micro-batches) hand their
    gradient over as rows, and how many tables can."""
    counts: collections.Counter = collections.Counter()
    rows_gradient = embedding_rows.rows_gradient

    def counting(*args, **kwargs):
        counts["as rows"] += 1
        return rows_gradient(*args, **kwargs)

    build, batch = getattr(overhead, kind)()
    torch.manual_seed(0)
    model = overhead.cpt_copy(build(), True)
    step = overhead.training_step(model, batch)
    step()
    embedding_rows.rows_gradient = counting
    try:
        step()
    finally:
        embedding_rows.rows_gradient = rows_gradient
    tables = sum(isinstance(m, embedding_rows.EmbeddingAddingRows) for m in model.modules())
    return {"as rows": counts["as rows"], "tables": tables}


def step_times_ms(kind: str, repeats: int) -> dict[str, float]:
    """Median milliseconds a training step takes: the plain model, the CPT 8/8 copy handing rows over, and the same
    copy forming dense table gradients (as ``embedding_row_gradients=False``)."""
    build, batch = getattr(overhead, kind)()
    plain, quantized = overhead.model_pair(build, True)
    as_rows = overhead.training_step(quantized, batch)

    def dense() -> None:
        present = embedding_rows._other_part_present
        embedding_rows._other_part_present = lambda *args: False
        try:
            as_rows()
        finally:
            embedding_rows._other_part_present = present

    return setting_arms.step_times_ms({"plain": overhead.training_step(plain, batch), "as rows": as_rows,
                                       "dense": dense}, repeats)


def _case(key: str) -> str:
    """The case's model builder, with the bench's steps (and their fresh processes) set to its AdamW and
    micro-batches."""
    kind, adamw, micro_batches = CASES[key]
    overhead.ADAMW_OPTIONS, overhead.MICRO_BATCHES = adamw, micro_batches
    return kind


def measure(key: str, processes: int) -> dict:
    kind = _case(key)
    return {"adamw": CASES[key][1], "micro_batches": CASES[key][2], "lookups": lookups_as_rows(kind),
            **setting_arms.arm_peaks(kind, processes, {}, [DENSE], ("plain", "as rows", "dense"))}


def main() -> None:
    setting_arms.main(__doc__.split("\n\n")[0], list(CASES), os.path.join(HERE, "results", "embedding_rows.json"),
                      measure, lambda key, repeats: step_times_ms(_case(key), repeats))


if __name__ == "__main__":
    main()
