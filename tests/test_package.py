"""The package's structure: public API importable, dependency arrows one way (no import cycles)."""

import ast
import os

import hf_cpt

PACKAGE = os.path.dirname(hf_cpt.__file__)


def _imports() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name in os.listdir(PACKAGE):
        if name.endswith(".py") and name != "__init__.py":
            tree = ast.parse(open(os.path.join(PACKAGE, name)).read())
            graph[name[:-3]] = {
                node.module or "__init__" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level
            }
    return graph


def test_no_module_imports_the_package_or_forms_a_cycle():
    graph = _imports()
    assert not [m for m, deps in graph.items() if "__init__" in deps], "a module imports the package itself"

    def reaches(start, target, seen=()):
        return any(dep == target or (dep not in seen and reaches(dep, target, seen + (dep,)))
                   for dep in graph.get(start, ()))

    cycles = [m for m in graph if reaches(m, m)]
    assert not cycles, f"import cycles through {cycles}"


def test_public_api_is_exported():
    missing = [name for name in hf_cpt.__all__ if not hasattr(hf_cpt, name)]
    assert not missing and "output_fidelity" in hf_cpt.__all__


def test_import_does_not_load_the_trainer_until_it_is_used():
    """`import hf_cpt` stays light: transformers' Trainer (seconds to import) loads on first use of CPTTrainer."""
    import subprocess
    import sys

    script = (
        "import sys, hf_cpt; before = {'hf_cpt.integrations.trainer', 'transformers.trainer'} & set(sys.modules); "
        "trainer = hf_cpt.CPTTrainer; from hf_cpt import CPTCallback; "
        "print(sorted(before), trainer.__module__, CPTCallback.__module__, 'CPTTrainer' in dir(hf_cpt))"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    expected = ["[]", "hf_cpt.integrations.trainer", "hf_cpt.integrations.callback", "True"]
    assert result.stdout.split() == expected, result.stderr[-2000:]


def test_import_loads_neither_torch_nor_transformers_and_cpt_registers_when_transformers_needs_it():
    """`import hf_cpt` is as light as `import transformers`; the `cpt` quantization method is registered when
    transformers loads its quantizer registry (after hf_cpt, as `from_pretrained` does) or at once (before)."""
    import subprocess
    import sys

    lookup = ("from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING as c, "
              "AUTO_QUANTIZER_MAPPING as q; print(c['cpt'].__name__, q['cpt'].__name__)")
    after = f"import sys, hf_cpt; print(sorted({{'torch', 'transformers'}} & set(sys.modules))); {lookup}"
    before = f"import transformers.quantizers.auto; import hf_cpt; {lookup}"
    outputs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
               for script in (after, before)]
    assert outputs[0].stdout.split() == ["[]", "CPTQuantizationConfig", "CPTHfQuantizer"], outputs[0].stderr[-2000:]
    assert outputs[1].stdout.split() == ["CPTQuantizationConfig", "CPTHfQuantizer"], outputs[1].stderr[-2000:]


def test_unknown_names_raise_attribute_error():
    import pytest

    with pytest.raises(AttributeError, match="has no attribute 'CPTTrainerr'"):
        hf_cpt.CPTTrainerr  # noqa: B018
