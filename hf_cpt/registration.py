"""Registers ``quant_method="cpt"`` with transformers when transformers loads its quantizer registry.

``import hf_cpt`` stays cheap (no torch, no transformers): instead of importing transformers' quantizer
registry to register with it, a finder on ``sys.meta_path`` waits for that module to be imported (by
``from_pretrained``, or by anything else) and registers `CPTQuantizationConfig` / `CPTHfQuantizer` right
after it has run. If the registry is already imported, registration happens at once.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys

REGISTRY = "transformers.quantizers.auto"


def _register() -> None:
    importlib.import_module(f"{__package__}.serialization.loader")  # registers on import


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of `REGISTRY` so that registration follows its execution."""

    def find_spec(self, name, path, target=None):
        if name != REGISTRY:
            return None
        sys.meta_path.remove(self)  # once, and never in the way of the search below
        spec = next((s for s in (finder.find_spec(name, path, target) for finder in sys.meta_path
                                 if hasattr(finder, "find_spec")) if s is not None), None)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            _register()

        spec.loader.exec_module = exec_module
        return spec


def register_with_transformers() -> None:
    """Register now if transformers' quantizer registry is loaded, else as soon as it is."""
    if REGISTRY in sys.modules:
        _register()
    elif not any(isinstance(finder, _RegisterAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())
