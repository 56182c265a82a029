"""What quantizing errors in place saves: each model step's peak memory with its layers' errors quantized over the
gradient autograd hands them (`CPTConfig.errors_in_place`, the default) and into a reused buffer instead.

For each model case: how many of one step's quantized errors go in place (not: a gradient that another node reads too,
or that a hook keeps, or that arrives as a view: it goes into the buffer, or over the copy the kernel makes of a
non-contiguous one), then the peak resident memory (VmHWM) of the plain model and of the CPT 8/8
model both ways, in fresh processes that train until the peak settles, as `bench/overhead.py` measures it: under
glibc's default allocator (``--processes`` per arm, interleaved) and with its mmap threshold fixed (one each); with
``--repeats``, each step's time both ways beside the plain step's (in one process, interleaved repeats, medians).
Resumable: a case already in the output file is skipped (one measured without times gets them). ``python
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

from hf_cpt.nn import products  # noqa: E402
from hf_cpt.numerics import errors  # noqa: E402

CASES = {  # key -> (the bench's model builder, CPTConfig fields beside the defaults)
    "resnet20": ("resnet20", {}), "resnet18": ("resnet18", {}), "gpt2": ("gpt2_small", {}),
    "vit-s": ("vit_small", {}), "bert-base-16": ("bert_base_16", {}),
    "bert-base-16-attention": ("bert_base_16", {"quantize_attention": True}), "minilm": ("minilm", {}),
}
IN_A_BUFFER = {"errors_in_place": False}


def errors_in_place(kind: str, options: dict | None = None) -> dict[str, int]:
    """How many of one training step's quantized errors (the second step's) go in place, and how many do not."""
    counts: collections.Counter = collections.Counter()
    quantize = products.quantize_error

    def counting(*args, **kwargs):
        counts["in place" if kwargs.get("overwrite") else "not in place"] += 1
        return quantize(*args, **kwargs)

    build, batch = getattr(overhead, kind)()
    torch.manual_seed(0)
    step = overhead.training_step(overhead.cpt_copy(build(), True, **(options or {})), batch)
    step()
    products.quantize_error = errors.quantize_error = counting  # the layers' errors and the attention's
    try:
        step()
    finally:
        products.quantize_error = errors.quantize_error = quantize
    return {"in place": counts["in place"], "not in place": counts["not in place"]}


def step_times_ms(kind: str, repeats: int, options: dict | None = None) -> dict[str, float]:
    """Median milliseconds a training step takes: the plain model, the CPT 8/8 copy with its errors in place, and the
    same copy with no error quantized in place (as ``errors_in_place=False``, without a second copy of the model)."""
    build, batch = getattr(overhead, kind)()
    plain, quantized = overhead.model_pair(build, True, **(options or {}))
    in_place = overhead.training_step(quantized, batch)

    def in_a_buffer() -> None:
        held_alone = products.error_held_alone, errors.error_held_alone
        products.error_held_alone = errors.error_held_alone = lambda error: False
        try:
            in_place()
        finally:
            products.error_held_alone, errors.error_held_alone = held_alone

    return setting_arms.step_times_ms(
        {"plain": overhead.training_step(plain, batch), "in place": in_place, "in a buffer": in_a_buffer}, repeats)


def measure(key: str, processes: int) -> dict:
    kind, options = CASES[key]
    return {"options": options, "errors": errors_in_place(kind, options),
            **setting_arms.arm_peaks(kind, processes, options, [{**options, **IN_A_BUFFER}],
                                     ("plain", "in place", "in a buffer"))}


def main() -> None:
    setting_arms.main(
        __doc__.split("\n\n")[0], list(CASES), os.path.join(HERE, "results", "errors_in_place.json"), measure,
        lambda key, repeats: step_times_ms(CASES[key][0], repeats, CASES[key][1]),
        skip=lambda key: setting_arms.missing_model(CASES[key][0]))


if __name__ == "__main__":
    main()
