"""Shared fixtures: tiny models built from configs, a tokenizer built locally, offline settings."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):  # `pytest -n N` (make test): one thread a worker, not N on each core
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from .helpers import SHARED_DATA, TinyCNN, tiny_bert_config, tiny_gpt2_config


@pytest.fixture(autouse=True)
def _environment_as_it_was():
    """Each test leaves os.environ as it found it: a Trainer or torch.distributed started in this process exports
    MASTER_ADDR, RANK, WORLD_SIZE and more, which later tests' child processes would inherit (and which would start
    the tests' Python server anew, tests/fresh_python.py)."""
    before = dict(os.environ)
    yield
    if dict(os.environ) != before:
        os.environ.clear()
        os.environ.update(before)


@pytest.fixture
def tiny_bert():
    from transformers import BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(tiny_bert_config())


@pytest.fixture
def tiny_gpt2():
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(tiny_gpt2_config())


@pytest.fixture
def tiny_cnn():
    torch.manual_seed(0)
    return TinyCNN()


@pytest.fixture
def shared_data_dir():
    if not os.path.isdir(SHARED_DATA):
        pytest.skip("../shared/data is not present on this machine")
    return os.path.abspath(SHARED_DATA)
