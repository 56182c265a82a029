"""`hf-cpt schedules` / `python -m hf_cpt schedules`: the table, the JSON and a real PNG."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hf_cpt.cli import main
from hf_cpt.schedules.shapes import FOLLOW_UP_SCHEDULES, available_schedules


def test_table_lists_every_schedule_with_its_group(capsys):
    assert main(["schedules", "--steps", "8000"]) == 0
    out = capsys.readouterr().out
    assert "3-8 bits forward, 8 bits backward, 8 cycles, 8000 steps" in out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert set(available_schedules()) <= set(rows)
    assert "| cost vs static 8/8 |" in out
    for name in ("RR", "RT-H"):
        assert rows[name].split("|")[5].strip() == "small"
    for name in ("CR", "CT", "LR", "LT", "ET-V", "RT-V"):
        assert rows[name].split("|")[5].strip() == "medium"
    for name in ("ER", "ET-H", "static"):
        assert rows[name].split("|")[5].strip() == "large"
    assert rows["static"].split("|")[3].strip() == "1.000"


def test_a_run_of_1e11_steps_is_answered_from_its_cycles(capsys):
    """Every schedule's steps at each precision and cost for a run of 10^11 steps (which walking the steps would
    never finish): counted per monotone piece of the cycles, they sum to the run."""
    assert main(["schedules", "--steps", "100000000000", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {row["schedule"] for row in rows} == set(available_schedules())
    assert all(sum(row["steps_at_bits"].values()) == 100_000_000_000 for row in rows)


def test_json_output_for_other_bounds_and_cycles(capsys):
    argv = ["schedules", "--bits-min", "4", "--bits-max", "6", "--cycles", "2", "--steps", "1000", "--grad-bits", "6"]
    assert main(argv + ["--names", "cpt", "CR", "--json", "--delay", "0.1"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [row["schedule"] for row in rows] == ["cpt", "CR"]
    assert all(row["bits_min"] == 4 and row["bits_max"] == 6 and row["num_cycles"] == 2 for row in rows)
    assert rows[0]["steps_at_bits"]["6"] >= 100  # the delay holds bits_max
    assert 0 < rows[1]["cost_vs_static"] < 1 and rows[1]["cost_group"] in ("small", "medium", "large")


def test_plot_writes_a_real_png(tmp_path, capsys):
    import matplotlib.image

    path = str(tmp_path / "schedules.png")
    names = ["cpt", "progressive", "fp32", *FOLLOW_UP_SCHEDULES]
    assert main(["schedules", "--steps", "4000", "--names", *names, "--plot", path]) == 0
    assert os.path.getsize(path) > 10_000
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(path)
    height, width = image.shape[:2]
    assert width > 1000 and height > 600  # 13 panels on a 4-column grid
    assert image[..., :3].std() > 0.05  # something is drawn


@pytest.mark.parametrize(
    "argv, message",
    [
        (["schedules", "--names", "zigzag"], "unknown schedule"),
        (["schedules", "--bits-min", "9"], "bits_min"),
        (["schedules", "--steps", "0"], "total_steps"),
        (["schedules", "--cycles", "0"], "num_cycles"),
        (["schedules", "--grad-bits", "0"], "grad_bits"),
        (["schedules", "--delay", "1"], "delay"),
        (["schedules", "--names", "CR", "--plot", "out.jpg"], ".png"),
    ],
)
def test_bad_arguments_exit_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_no_command_prints_help(capsys):
    assert main([]) == 1
    assert "schedules" in capsys.readouterr().out


def test_python_dash_m(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    result = subprocess.run(
        [sys.executable, "-m", "hf_cpt", "schedules", "--names", "RR", "ER", "--steps", "800"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "| RR |" in result.stdout and "| ER |" in result.stdout
