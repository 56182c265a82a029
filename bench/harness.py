"""What every results script shares: the JSON store (resumable), the environment record, and one
`CPTTrainer` run turned into a JSON entry (metric, cost meter, timing, curve, precision profile).

The scripts (`pretrained.py`, `cifar10.py`, `language_model.py`, `schedule_sweep.py`, `horizon.py`) write
JSON under ``bench/results/``; ``bench/report.py`` turns it into the docs. No figure is typed by hand.

Several processes may share one scan (one per core): each claims a (run, seed) before training it and
merges its entry into the file on disk under a lock, so none repeats or overwrites another's work.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

import hf_cpt  # noqa: E402
from hf_cpt import CPTConfig  # noqa: E402

DEFAULT_DATA = os.path.join(ROOT, "..", "shared", "data")
RESULTS_DIR = os.path.join(HERE, "results")
#: The inference precisions of every precision profile (None: full precision).
PROFILE_BITS = (3, 4, 5, 6, 7, 8, None)


def data_file(data_dir: str, *parts: str) -> str:
    """A file of ``../shared/data`` (or ``--data_dir``); a clear exit when it is missing."""
    path = os.path.join(data_dir, *parts)
    if not os.path.exists(path):
        sys.exit(f"data not found: {path} (pass --data_dir; see ../shared/data/README.md).")
    return path


def products_setting() -> dict:
    """How this CPU's quantized layers multiply in training by default, for a bench's JSON: ``integer_products``,
    whether it has int8 dot products; ``auto_products``, what ``integer_matmul="auto"`` resolves to (True: codes in
    every layer; recorded runs before 2026-12-04 may say "activations": codes where an activation recomputes its input
    from them, floats elsewhere)."""
    from hf_cpt.backends import backend_for

    cpu = backend_for("cpu")
    return {"integer_products": cpu.int8_gemm(), "auto_products": cpu.products_on_codes("auto")}


def load_results(path: str) -> dict:
    if os.path.isfile(path):
        with open(path) as f:
            return json.load(f)
    return {}


def save_results(path: str, results: dict) -> None:
    """Write atomically, so that an interrupted run never leaves a broken file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1)
    os.replace(tmp, path)


@contextlib.contextmanager
def locked(path: str):
    """Hold an exclusive lock on a results file (``<path>.lock``) while reading and writing it."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _claim_file(path: str, section: str, key: str) -> str:
    return os.path.join(path + ".claims", section, key.replace("/", "_"))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def claim(path: str, section: str, key: str) -> bool:
    """Claim one (run, seed) for this process; False when it is finished on disk or a live process holds it.

    A claim left by a process that died (killed, interrupted) is taken over, so a scan stays resumable.
    """
    with locked(path):
        if key in load_results(path).get(section, {}):
            return False
        claim_path = _claim_file(path, section, key)
        if os.path.isfile(claim_path):
            with open(claim_path) as f:
                owner = int(f.read().strip() or 0)
            if owner not in (0, os.getpid()) and _alive(owner):
                return False
        os.makedirs(os.path.dirname(claim_path), exist_ok=True)
        with open(claim_path, "w") as f:
            f.write(str(os.getpid()))
    return True


def record(path: str, results: dict, section: str, key: str, entry: dict) -> None:
    """Merge one finished entry into the file on disk (keeping other processes' entries) and release its
    claim; ``results`` becomes the merged content."""
    with locked(path):
        merged = load_results(path)
        for name, value in results.items():
            merged.setdefault(name, value)
        merged.setdefault(section, {})[key] = entry
        merged["environment"] = environment()
        save_results(path, merged)
        claim_path = _claim_file(path, section, key)
        if os.path.isfile(claim_path):
            os.remove(claim_path)
    results.clear()
    results.update(merged)


def check_settings(results: dict, key: str, settings: dict, path: str) -> None:
    """Refuse to mix runs made with other settings into one file (they would not be comparable)."""
    if results.get(key, settings) != settings:
        sys.exit(f"{path} holds runs made with {results[key]}, not {settings}; use another --output.")
    results[key] = settings


def environment() -> dict:
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "hf_cpt": hf_cpt.__version__,
            "python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
            "threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def accuracy(eval_pred) -> dict:
    logits, labels = eval_pred
    return {"accuracy": float((np.argmax(logits, axis=-1) == labels).mean())}


def train_and_record(trainer, metric: str, profile: bool, transform: Callable[[float], float] | None = None,
                     profile_dataset=None, **extra: Any) -> dict:
    """Train, evaluate at the config's eval precision and (optionally) at every `PROFILE_BITS` precision.

    ``metric`` names the eval metric recorded ("accuracy", "loss"); ``transform`` maps it (perplexity
    from loss). The entry holds the cost meter's report, the training curve with the bits of each
    logged step, seconds per step and the fidelity measured at the start. ``profile_dataset``
    (default: the eval dataset) is what the profile evaluates at each precision.
    """
    transform = transform or (lambda v: v)
    config = trainer.cpt_config
    start = time.perf_counter()
    output = trainer.train()
    seconds = time.perf_counter() - start
    metrics = trainer.evaluate()
    entry = {
        **extra,
        "cpt_config": config.to_dict(),
        "metric": transform(metrics[f"eval_{metric}"]),
        "eval_bits": config.eval_precision,
        "steps": output.global_step,
        "train_seconds": seconds,
        "seconds_per_step": seconds / max(output.global_step, 1),
        "training_loss": output.training_loss,
        "cost": trainer.cpt_callback.cost_report(),
        "fidelity_at_start": trainer.cpt_callback.fidelity,
        "curve": [{"step": h["step"], "loss": h["loss"], "bits": h.get("cpt/bits")}
                  for h in trainer.state.log_history if "loss" in h],
    }
    if profile:
        rows = trainer.evaluate_precisions(list(PROFILE_BITS), eval_dataset=profile_dataset)
        entry["profile"] = {str(row["bits"]): transform(row[metric]) for row in rows}
    return entry


def with_cycles(runs: dict[str, dict], cycles: int) -> dict[str, dict]:
    """The runs with ``num_cycles=cycles`` for every cyclic schedule."""
    return {name: fields if fields["schedule"] in ("fp32", "static") else {**fields, "num_cycles": cycles}
            for name, fields in runs.items()}


def run_all(results: dict, path: str, runs: dict[str, dict], seeds: list[int],
            build_trainer: Callable[[CPTConfig, int, str], Any], metric: str, label: str, profile: bool,
            transform: Callable[[float], float] | None = None, profile_dataset=None, section: str = "runs",
            desc: str = "runs", skip_profile: tuple[str, ...] = ()) -> None:
    """Train every (run, seed) not yet in ``results[section]``, saving the JSON after each (resumable); a
    (run, seed) another live process has claimed is left to it.

    ``build_trainer(config, seed, work_name)`` returns a `CPTTrainer` for one run; ``label`` names the
    metric in the progress line; runs whose schedule is in ``skip_profile`` get no precision profile.
    """
    done = results.setdefault(section, {})
    todo = [(name, seed) for seed in seeds for name in runs if f"{name}/seed{seed}" not in done]
    for name, seed in tqdm(todo, desc=desc):
        key = f"{name}/seed{seed}"
        if not claim(path, section, key):
            tqdm.write(f"{key}: finished or under way in another process, skipped")
            continue
        torch.manual_seed(seed)
        trainer = build_trainer(CPTConfig(**runs[name]), seed, key.replace("/", "_"))
        entry = train_and_record(trainer, metric, profile and trainer.cpt_config.schedule not in skip_profile,
                                 transform, profile_dataset, run=name, seed=seed)
        entry["quantized_layers"] = len(trainer.cpt_report.quantized)
        record(path, results, section, key, entry)
        tqdm.write(f"{key}: {label} {entry['metric']:.4f}, {entry['seconds_per_step']:.2f} s/step, "
                   f"cost vs FP32 {entry['cost']['cost_vs_fp32']:.4f}")
        del trainer
