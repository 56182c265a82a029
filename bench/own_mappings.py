"""What giving kept codes mappings of their own saves: each model step's peak memory with the codes its layers keep for
the backward made by `hf_cpt.numerics.scratch.kept` in mappings of their own from 256 KiB
(``HF_CPT_OWN_MAPPING_BYTES=262144``) and from torch's allocator (``HF_CPT_OWN_MAPPING_BYTES=0``, the default),
beside the plain model's, every side with the AdamW that transformers' Trainer makes by default (fused).

For each model case: how many code tensors one step keeps in mappings of their own and their MiB, then the peak
resident memory (VmHWM) of the plain model and of the CPT 8/8 model both ways, in fresh processes that train until
the peak settles, as `bench/overhead.py` measures it: under glibc's default allocator (``--processes`` per arm,
interleaved) and with its mmap threshold fixed (one each); with ``--repeats``, each step's time both ways beside the
plain step's (in one process, interleaved repeats, medians: the setting is read at each call). Resumable: a case
already in the output file is skipped (one measured without times gets them). ``python bench/report.py`` renders the
JSON into docs/benchmarks.md.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import overhead  # noqa: E402  (the bench's model builders and fresh-process peaks)
import setting_arms  # noqa: E402

from hf_cpt.numerics import code_kernels, scratch  # noqa: E402

CASES = {  # key -> the bench's model builder
    "resnet20": "resnet20", "resnet20-functional": "resnet20_functional", "resnet18": "resnet18",
    "gpt2": "gpt2_small", "bert-base-16": "bert_base_16", "vit-s": "vit_small", "minilm": "minilm",
}
ARMS = ("plain", "own mappings", "heap")
# the environments of the two CPT arms
MAPPED = {scratch.OWN_MAPPING_VARIABLE: str(scratch.SUGGESTED_OWN_MAPPING_BYTES)}
HEAP = {scratch.OWN_MAPPING_VARIABLE: "0"}
ADAMW = "fused"  # the model steps' AdamW (`overhead.ADAMW_CHOICES`): the Trainer's default, as users train


@contextlib.contextmanager
def setting(environment: dict):
    """This process's `scratch.OWN_MAPPING_VARIABLE` as ``environment`` sets it (read at each call), then as it was."""
    before = os.environ.get(scratch.OWN_MAPPING_VARIABLE)
    os.environ.update(environment)
    try:
        yield
    finally:
        if before is None:
            del os.environ[scratch.OWN_MAPPING_VARIABLE]
        else:
            os.environ[scratch.OWN_MAPPING_VARIABLE] = before


def codes_in_own_mappings(kind: str) -> dict[str, float]:
    """How many tensors of one training step (the second step's) `scratch.kept` put in mappings of their own, their
    MiB, and how many it took from torch's allocator."""
    counts = {"mapped": 0, "mapped_mib": 0.0, "heap": 0}
    kept = scratch.kept
    counting = setting_arms.counting_sizes(kept, scratch.SUGGESTED_OWN_MAPPING_BYTES, counts)

    build, batch = getattr(overhead, kind)()
    torch.manual_seed(0)
    step = overhead.training_step(overhead.cpt_copy(build(), True), batch)
    with setting(MAPPED):
        step()
        code_kernels.kept = counting
        try:
            step()
        finally:
            code_kernels.kept = kept
    return counts


def arm_peaks(kind: str, processes: int) -> dict:
    """``{"default": {arm: [MiB per process]}, "fixed": {arm: MiB}}`` of the plain model and of its CPT 8/8 copy both
    ways, the arms interleaved process by process."""
    sides = {"plain": (False, {}), "own mappings": (True, MAPPED), "heap": (True, HEAP)}
    default: dict = {arm: [] for arm in ARMS}
    for _ in range(processes):
        for arm, (quantized, env) in sides.items():
            default[arm].append(overhead.peak_memory_mib(kind, quantized, True, env=env)[0])
    fixed = {arm: overhead.peak_memory_mib(kind, quantized, True, env={**overhead.FIXED_MMAP_THRESHOLD, **env})[0]
             for arm, (quantized, env) in sides.items()}
    return {"default": default, "fixed": fixed}


def step_times_ms(kind: str, repeats: int) -> dict[str, float]:
    """Median milliseconds a training step takes: the plain model, the CPT 8/8 copy with its codes in mappings of their
    own, and the same copy with them from torch's allocator."""
    build, batch = getattr(overhead, kind)()
    plain, quantized = overhead.model_pair(build, True)
    step = overhead.training_step(quantized, batch)

    def under(environment: dict) -> Callable[[], None]:
        def run() -> None:
            with setting(environment):
                step()
        return run

    return setting_arms.step_times_ms(
        {"plain": overhead.training_step(plain, batch), "own mappings": under(MAPPED), "heap": under(HEAP)}, repeats)


def measure(key: str, processes: int) -> dict:
    return {"adamw": ADAMW, "codes": codes_in_own_mappings(CASES[key]), **arm_peaks(CASES[key], processes)}


def main() -> None:
    setting_arms.main(__doc__.split("\n\n")[0], list(CASES), os.path.join(HERE, "results", "own_mappings.json"),
                      measure, lambda key, repeats: step_times_ms(CASES[key], repeats),
                      skip=lambda key: setting_arms.missing_model(CASES[key]), adamw=ADAMW)


if __name__ == "__main__":
    main()
