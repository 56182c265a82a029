"""Metric scripts shipped with hf_cpt, loaded the `evaluate` way, online or offline.

``evaluate.load("accuracy")`` fetches its script from the Hugging Face Hub, so it fails on a machine
without network access. The scripts here are local copies; `load_metric` always loads them with
``evaluate.load(<path to the script>)``, so a run gives the same numbers online and offline.
"""

from __future__ import annotations

import os
from typing import Any

METRICS_DIR = os.path.dirname(os.path.abspath(__file__))


def available_metrics() -> list[str]:
    """Names of the metric scripts shipped in this folder."""
    return sorted(
        name[:-3] for name in os.listdir(METRICS_DIR) if name.endswith(".py") and not name.startswith("_")
    )


def metric_path(name: str) -> str:
    """Path of the shipped script of metric ``name``."""
    path = os.path.join(METRICS_DIR, f"{name}.py")
    if not os.path.isfile(path):
        raise ValueError(f"hf_cpt ships no metric named {name!r}; available: {available_metrics()}.")
    return path


def load_metric(name: str, **kwargs: Any):
    """``evaluate.load`` of a shipped metric script; kwargs go to ``evaluate.load``.

    Results are kept in memory by default, so several processes (``accelerate launch``) may compute
    the metric at the same time without sharing cache files.
    """
    import evaluate

    kwargs.setdefault("keep_in_memory", True)
    return evaluate.load(metric_path(name), **kwargs)
