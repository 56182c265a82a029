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
