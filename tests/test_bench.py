"""The benchmark scripts run end to end on a tiny slice, so that they cannot rot."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from .helpers import build_word_tokenizer, tiny_bert_config

ROOT = os.path.join(os.path.dirname(__file__), "..")


@pytest.mark.slow
def test_pretrained_benchmark_smoke(tmp_path, shared_data_dir):
    from transformers import BertForSequenceClassification

    model_dir = tmp_path / "model"
    torch.manual_seed(0)
    config = tiny_bert_config()
    config.vocab_size, config.max_position_embeddings = 200, 512
    BertForSequenceClassification(config).save_pretrained(model_dir)
    build_word_tokenizer(["the", "a", "man", "woman", "is", "not", "dog"], str(model_dir))
    output = tmp_path / "results.json"
    command = [sys.executable, os.path.join(ROOT, "bench", "pretrained.py"), "--model_path", str(model_dir),
               "--data_dir", shared_data_dir, "--output", str(output), "--no_gpt2", "--train_size", "64",
               "--eval_size", "64", "--max_steps", "2", "--seeds", "0", "--runs", "static-8/8", "cpt-4-8/8",
               "--work_dir", str(tmp_path / "work")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.load(open(output))
    assert set(results["fidelity"]) == {"model (local)"}
    assert set(results["fidelity"]["model (local)"]) == {"paper", "per-token", "rotated", "rotated-per-token"}
    assert set(results["finetune"]) == {"static-8/8/seed0", "cpt-4-8/8/seed0"}
    entry = results["finetune"]["cpt-4-8/8/seed0"]
    assert entry["steps"] == 2 and entry["cost"]["steps"] == 2 and set(entry["profile"]) >= {"3", "8", "fp32"}
    # resumable: a second run skips what is finished
    again = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert again.returncode == 0 and "accuracy" not in again.stdout
    # and the generator turns the JSON into a page and the README's summary
    spec = importlib.util.spec_from_file_location("bench_report", os.path.join(ROOT, "bench", "report.py"))
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    page = report.pretrained_page(results)
    assert "| `rotated-per-token` |" in page and "| cpt-4-8/8 | 0 |" in page
    assert any("cpt-4-8/8" in line for line in report.readme_summary(results))
