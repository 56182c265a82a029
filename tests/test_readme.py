"""The README's Python examples run as written (offline)."""

import os
import re

import pytest

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def python_blocks():
    text = open(README).read()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_readme_example_runs(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(python_blocks()[index], f"README.md block {index}", "exec"), {"__name__": "__readme__"})


def test_every_config_field_is_documented():
    """The README's table names every top-level field; docs/configuration.md every setting by its flat name."""
    import dataclasses

    from hf_cpt import CPTConfig
    from hf_cpt.config import flat_settings

    text = open(README).read()
    missing = [f.name for f in dataclasses.fields(CPTConfig) if f"`{f.name}`" not in text.split("## Configuration")[1]]
    assert not missing, f"CPTConfig fields missing from the README table: {missing}"
    page = open(os.path.join(os.path.dirname(README), "docs", "configuration.md")).read()
    missing = [name for name, *_ in flat_settings() if f"| `{name}` |" not in page]
    assert not missing, f"settings missing from docs/configuration.md: {missing}"


def test_the_readme_is_read_in_five_minutes():
    text = open(README).read()
    assert len(text.encode()) <= 25_000 and text.count("\n") <= 260


def test_install_lines_name_what_exists(tmp_path):
    """The README's install commands: the clone's own `pip install .` and the wheel that `pip wheel` builds."""
    import subprocess
    import sys

    from hf_cpt.version import INSTALL_COMMAND, WHEEL_INSTALL_COMMAND, WHEEL_NAME

    text = open(README).read()
    assert INSTALL_COMMAND in text and WHEEL_INSTALL_COMMAND in text and "\npip install hf-cpt\n" not in text
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), root], check=True, capture_output=True, timeout=300)
    assert os.listdir(tmp_path) == [WHEEL_NAME]
