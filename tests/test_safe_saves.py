"""Saves over an earlier checkpoint that stop half way, or run two at once, never leave a mix that loads
(docs/checkpoints.md, "What is checked")."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import hf_cpt.serialization.save as save_module
from hf_cpt import CPTConfig, export_portable, quantize_model, save_quantized, set_precision

from .helpers import tiny_bert_config

BATCH = torch.randint(5, 100, (3, 9))


def _model(seed: int):
    from transformers import BertForSequenceClassification

    torch.manual_seed(seed)
    model = BertForSequenceClassification(tiny_bert_config())
    quantize_model(model, CPTConfig())
    set_precision(model, 8, 8)
    model.train()(input_ids=BATCH)  # activation ranges
    return model.eval()


def _loaded_logits(path) -> torch.Tensor | None:
    """The logits of the checkpoint at ``path`` as a user loads it, None where it refuses to load."""
    from transformers import AutoModelForSequenceClassification

    try:
        model = AutoModelForSequenceClassification.from_pretrained(path)
    except (OSError, ValueError, RuntimeError):
        return None
    with torch.no_grad():
        return model.eval()(input_ids=BATCH).logits


def _stopping(real, calls: dict):
    """``real`` (a file operation) that raises as a kill would stop the process, at call number ``calls["stop_at"]``
    of all the operations sharing ``calls``."""
    def operation(*args, **kwargs):
        if calls["n"] == calls["stop_at"]:
            raise KeyboardInterrupt("stopped")
        calls["n"] += 1
        return real(*args, **kwargs)
    return operation


@pytest.mark.parametrize("write", [save_quantized, export_portable])
def test_a_save_interrupted_at_any_file_leaves_the_old_checkpoint_the_new_one_or_one_that_refuses(tmp_path, write,
                                                                                                 monkeypatch):
    """The save is stopped before each of its file operations in turn (as a kill would stop it): the folder then
    loads as the old checkpoint, exactly, or as the new one, or not at all; never the old weights under the new
    config or the reverse. A later save into the folder completes and leaves no staging folder behind."""
    old_model, new_model = _model(0), _model(1)
    path = tmp_path / "ckpt"
    outcomes = set()
    for stop_at in range(12):
        write(old_model, path, 8, model_card=False)
        old = _loaded_logits(path)
        calls = {"n": 0, "stop_at": stop_at}
        monkeypatch.setattr(save_module.os, "replace", _stopping(os.replace, calls))
        monkeypatch.setattr(save_module.os, "remove", _stopping(os.remove, calls))
        finished = True
        try:
            write(new_model, path, 8, model_card=False)
        except KeyboardInterrupt:
            finished = False
        monkeypatch.undo()
        got = _loaded_logits(path)
        if got is None:
            outcomes.add("refuses")
        elif torch.equal(got, old):
            outcomes.add("old")
        else:
            write(new_model, tmp_path / "reference", 8, model_card=False)
            assert torch.equal(got, _loaded_logits(tmp_path / "reference")), f"a mix after {stop_at} operations"
            outcomes.add("new")
        if finished:  # stopped at no operation: every later point would finish too
            break
    assert outcomes == {"old", "refuses", "new"}
    write(new_model, path, 8, model_card=False)
    assert [name for name in os.listdir(path) if name.startswith(".hf_cpt-save-")] == []


def test_kill_9_during_a_save_over_an_earlier_export_never_leaves_a_mix(tmp_path):
    """A user's process killed (SIGKILL) while it saves over an earlier export: the folder loads as one of the two
    checkpoints or refuses to load, and the next save removes the staging folder the killed process left."""
    path, reference = tmp_path / "ckpt", tmp_path / "reference"
    save_quantized(_model(0), path, 8, model_card=False)
    save_quantized(_model(1), reference, 8, model_card=False)
    old, new = _loaded_logits(path), _loaded_logits(reference)
    code = (
        "import sys, torch\n"
        f"sys.path.insert(0, {os.path.dirname(os.path.dirname(__file__))!r})\n"
        "from tests.test_safe_saves import _model\n"
        "from hf_cpt import save_quantized\n"
        "model = _model(1)\n"
        "print('saving', flush=True)\n"
        f"while True:\n    save_quantized(model, {str(path)!r}, 8, model_card=False)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "saving"
    time.sleep(1.5)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    got = _loaded_logits(path)
    assert got is None or torch.equal(got, old) or torch.equal(got, new)
    save_quantized(_model(0), path, 8, model_card=False)  # the next save clears what the killed one left behind
    assert [name for name in os.listdir(path) if name.startswith(".hf_cpt-save-")] == []
    assert torch.equal(_loaded_logits(path), old)


def test_two_saves_into_one_folder_at_once_leave_one_whole_checkpoint(tmp_path):
    """Two threads save different models into one folder at the same time, five times each: the folder then holds
    one of them whole (its config with its weights)."""
    models = [_model(0), _model(1)]
    for index, model in enumerate(models):
        save_quantized(model, tmp_path / f"reference{index}", 8, model_card=False)
    references = [_loaded_logits(tmp_path / f"reference{index}") for index in range(2)]
    errors = []

    def saves(model):
        try:
            for _ in range(5):
                save_quantized(model, tmp_path / "shared", 8, model_card=False)
        except Exception as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=saves, args=(model,)) for model in models]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    got = _loaded_logits(tmp_path / "shared")
    assert any(torch.equal(got, reference) for reference in references)


def test_a_save_leaves_files_it_does_not_write_in_the_folder(tmp_path):
    """A Trainer's output folder holds more than the checkpoint (runs/, checkpoint-N/, notes): a save replaces the
    checkpoint's files, removes stale shards of an older one and the staging folders of killed saves, and leaves the
    rest."""
    path = tmp_path / "out"
    (path / "checkpoint-500").mkdir(parents=True)
    (path / "notes.txt").write_text("mine")
    (path / "model-00002-of-00002.safetensors").write_text("a stale shard of an older save")
    (path / ".hf_cpt-save-999999999-dead").mkdir()  # left by a killed save (no such process)
    (path / ".hf_cpt-save-1-live").mkdir()  # a save of a running process (pid 1) in progress
    save_quantized(_model(0), path, 8, model_card=False)
    assert not (path / ".hf_cpt-save-999999999-dead").exists() and (path / ".hf_cpt-save-1-live").is_dir()
    assert (path / "notes.txt").read_text() == "mine" and (path / "checkpoint-500").is_dir()
    assert not (path / "model-00002-of-00002.safetensors").exists() and _loaded_logits(path) is not None
