"""bench/gpu.py, the GPU bench of issue 73, checked on a CPU: its rows, resumption and the docs table made from them
(the figures themselves come from one run on an H100/H200, bench/gpu_check.sh)."""

from __future__ import annotations

import json
import os

from .test_bench import ROOT, _load_report, _run_script


def test_the_gpu_bench_writes_a_row_per_variant_resumes_and_renders_its_table(tmp_path):
    output = tmp_path / "gpu.json"
    _run_script("gpu.py", ["--device", "cpu", "--smoke", "--part", "linear", "--output", str(output)])
    rows = json.loads(output.read_text())
    assert [(row["variant"], row.get("bits")) for row in rows] == [
        ("bf16", None), ("cpt-default", 8), ("cpt-default", 4), ("cpt-fastest", 8), ("cpt-fastest", 4),
        ("cpt-reference", 8)]
    assert {row["case"] for row in rows} == {"linear-256x64x96"} and rows[0]["time_ratio_vs_bf16"] == 1.0
    assert all(row["seconds"] > 0 and row["device"] == "cpu" for row in rows)
    # CPT saves uint8 codes for the backward where bf16 autocast saves 2-byte copies: about half, plus the scales
    assert all(0.5 < row["saved_ratio_vs_bf16"] < 0.6 for row in rows[1:])
    before = output.stat().st_mtime_ns
    run = _run_script("gpu.py", ["--device", "cpu", "--smoke", "--part", "linear", "--output", str(output)])  # resumed
    assert output.stat().st_mtime_ns == before and "linear-256x64x96" not in run.stdout
    table = _load_report().gpu_section(rows)
    assert table[0].startswith("Measured on cpu") and len(table) == 4 + len(rows)
    assert "| linear-256x64x96 | cpt-fastest | eager | 4 |" in "\n".join(table)


def test_the_gpu_bench_times_a_models_training_step_against_bf16_in_each_mode(tmp_path):
    output = tmp_path / "gpu.json"
    _run_script("gpu.py", ["--device", "cpu", "--smoke", "--part", "models", "--models", "minilm", "gpt2-medium",
                           "--no_compile", "--output", str(output)])
    rows = json.loads(output.read_text())
    assert [(row["case"], row["variant"], row["mode"]) for row in rows] == [
        ("minilm", "bf16", "eager"), ("minilm", "cpt-default", "eager"),
        ("gpt2-medium", "bf16", "eager"), ("gpt2-medium", "cpt-default", "eager")]
    assert all(row["seconds"] > 0 for row in rows) and rows[0]["time_ratio_vs_bf16"] == 1.0
    assert "| minilm | cpt-default | eager |  |" in "\n".join(_load_report().gpu_section(rows))


def test_the_gpu_check_runs_the_cuda_tests_then_the_bench():
    script = open(os.path.join(ROOT, "bench", "gpu_check.sh")).read()
    assert script.index("tests/test_cuda.py") < script.index("bench/gpu.py")
    assert "HF_CPT_CUDA_KERNELS=1" in script


def test_the_backward_page_judges_each_int8_run_against_the_seed_range_of_its_float_run():
    page = _load_report().backward_page  # the report puts bench/ on the import path first
    base = {"schedule": "cpt", "bits_min": 4, "bits_max": 8, "grad_bits": 8, "error_granularity": "token"}

    def run(seed, metric, **fields):
        return {"seed": seed, "metric": metric, "cpt_config": {**base, **fields}}

    ablation = {"a": run(0, 0.56), "b": run(1, 0.60),
                "c": run(0, 0.59, input_gradient_product="int8", weight_gradient_product="int8"),
                "d": run(1, 0.57, input_gradient_product="int8", weight_gradient_product="int8"),
                "e": run(0, 0.50, weight_gradient_product="int8")}
    verdicts = {name: (inside, [round(g, 6) for g in gaps])
                for name, _, _, _, inside, gaps in page.int8_verdicts(page.groups(ablation))}
    assert verdicts == {"CPT 4-8/8 (int8 input and weight gradients)": (True, [3.0, -3.0]),
                        "CPT 4-8/8 (int8 weight gradient)": (False, [-6.0])}


def test_the_backward_page_sets_clipped_and_ceil_runs_apart_and_pairs_each_with_its_twin():
    page = _load_report().backward_page
    base = {"schedule": "cpt", "bits_min": 4, "bits_max": 8, "grad_bits": 8, "error_granularity": "token"}

    def run(seed, metric, **fields):
        return {"seed": seed, "metric": metric, "cpt_config": {**base, **fields}}

    ablation = {"a": run(0, 0.56), "b": run(1, 0.60), "c": run(0, 0.58, weight_range="mse"),
                "d": run(1, 0.59, weight_range="mse"), "e": run(0, 0.50, rounding="ceil")}
    grouped = page.groups(ablation)
    assert sorted(name for name, _ in grouped) == ["CPT 4-8/8", "CPT 4-8/8 (ceil-rounded cycle)",
                                                   "CPT 4-8/8 (clipped weight ranges)"]
    assert page._variant_pairs(grouped) == [
        "- CPT 4-8/8 (ceil-rounded cycle) against the same run with the nearest-rounded cycle, seed by seed: -6.00 "
        "points (mean -6.00).",
        "- CPT 4-8/8 (clipped weight ranges) against the same run on min/max weight ranges, seed by seed: +2.00, "
        "-1.00 points (mean +0.50)."]


def test_the_gpu_finetune_bundle_carries_what_the_rte_and_bf16_runs_read(tmp_path, shared_data_dir):
    """Issue 75's preparation, at a tiny size on the CPU: the bundle (a float16 encoder, MNLI, RTE) feeds
    bench/pretrained.py with --task rte, a bf16-autocast FP32 run and a CPT variant among them."""
    import torch
    from transformers import BertModel

    from .helpers import save_local_bert

    source = tmp_path / "model"
    save_local_bert(source, BertModel)
    bundle = tmp_path / "gpu_data"
    _run_script("gpu_bundle.py", ["--bundle", "finetune", "--folder", str(bundle), "--model_path", str(source),
                                  "--data_dir", shared_data_dir])
    weights = BertModel.from_pretrained(bundle / "minilm").embeddings.word_embeddings.weight
    assert weights.dtype == torch.float16 and (bundle / "rte" / "dev.csv").exists()
    output = tmp_path / "rte.json"
    _run_script("pretrained.py", ["--part", "finetune", "--task", "rte", "--model_path", str(bundle / "minilm"),
                                  "--data_dir", str(bundle), "--output", str(output), "--max_steps", "2",
                                  "--eval_size", "16", "--seeds", "0", "--no_profile", "--runs", "bf16",
                                  "cpt-4-8/8-error-token-ceil", "--work_dir", str(tmp_path / "work")])
    results = json.loads(output.read_text())
    assert results["finetune_settings"]["task"] == "rte"
    assert set(results["finetune"]) == {"bf16/seed0", "cpt-4-8/8-error-token-ceil/seed0"}
    assert all(0 <= entry["metric"] <= 1 and entry["steps"] == 2 for entry in results["finetune"].values())


def test_device_images_crop_and_flip_each_sample_of_a_batch_where_the_images_are():
    import sys

    import torch

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import cifar10

    images = torch.randint(0, 256, (6, 3, 32, 32), dtype=torch.uint8)
    data = cifar10.DeviceImages(images, torch.arange(6), augment=True, device="cpu")
    torch.manual_seed(0)
    batch = data.collate([5, 0, 3])
    assert batch["pixel_values"].shape == (3, 3, 32, 32) and batch["labels"].tolist() == [5, 0, 3]
    for got, index in zip(batch["pixel_values"], [5, 0, 3]):
        padded = torch.nn.functional.pad(data.images[index], (4, 4, 4, 4))
        windows = [padded[:, top:top + 32, left:left + 32] for top in range(9) for left in range(9)]
        assert any(torch.equal(got, w) or torch.equal(got, w.flip(-1)) for w in windows)
    plain = cifar10.DeviceImages(images, torch.arange(6), augment=False, device="cpu").collate([2])
    assert torch.equal(plain["pixel_values"][0], data.images[2])


def test_the_horizon_trains_from_the_bundled_image_array(tmp_path, shared_data_dir):
    bundle = tmp_path / "bundle"
    _run_script("gpu_bundle.py", ["--bundle", "horizon", "--folder", str(bundle), "--limit", "4", "--data_dir",
                                  shared_data_dir])
    assert (bundle / "wikitext-2" / "test.txt").exists()
    output = tmp_path / "horizon.json"
    _run_script("horizon.py", ["--images", str(bundle / "cifar10_uint8.npz"), "--epochs", "1", "--max_steps", "2",
                               "--seeds", "0", "--runs", "fp32", "--output", str(output), "--work_dir",
                               str(tmp_path / "work")])
    results = json.loads(output.read_text())
    assert results["data"] == {"train": 40, "test": 40} and results["epochs-1"]["fp32/seed0"]["steps"] == 2


def test_a_language_model_run_stops_once_its_validation_loss_stalls():
    import sys

    from transformers import TrainerControl

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import language_model

    callback, control = language_model.StopWhenValidationStalls(2), TrainerControl()
    stops = []
    for loss in (3.0, 2.0, 2.5, 1.9, 2.1, 2.2):
        callback.on_evaluate(None, None, control, metrics={"eval_loss": loss})
        stops.append(control.should_training_stop)
    assert stops == [False, False, False, False, False, True]  # two evaluations without a new best
