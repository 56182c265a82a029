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
    import dataclasses

    from hf_cpt import CPTConfig

    text = open(README).read()
    missing = [f.name for f in dataclasses.fields(CPTConfig) if f"| `{f.name}` |" not in text]
    assert not missing, f"CPTConfig fields missing from the README table: {missing}"


def test_install_line_names_the_project_repository():
    from hf_cpt.version import INSTALL_COMMAND

    text = open(README).read()
    assert INSTALL_COMMAND in text and "\npip install hf-cpt\n" not in text
