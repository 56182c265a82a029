"""`hf_cpt.diagnostics.environment` and ``hf-cpt env``: the allocator a process really calls, the libraries found to
preload, and the report."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from hf_cpt.cli import main
from hf_cpt.diagnostics import environment

GLIBC_LINUX = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


def allocator_of_a_fresh_process(preload: str | None) -> list:
    """[`cpu_allocator`, `malloc_library`] of a new interpreter, with ``preload`` in LD_PRELOAD (None: nothing)."""
    env = {key: value for key, value in os.environ.items() if key != "LD_PRELOAD"}
    if preload:
        env["LD_PRELOAD"] = preload
    code = ("import json; from hf_cpt.diagnostics import environment as e; "
            "print(json.dumps([e.cpu_allocator(), e.malloc_library()]))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_library_search_takes_the_first_name_found_skips_unset_folders_and_finds_nothing_elsewhere(tmp_path,
                                                                                                  monkeypatch):
    for name in ("libtcmalloc_minimal.so.4.5.10", "libtcmalloc_minimal.so.4", "libtcmalloc_minimal_debug.so.4"):
        (tmp_path / name).write_bytes(b"")
    monkeypatch.delenv("CONDA_PREFIX", raising=False)
    names = environment.ALLOCATORS["tcmalloc"]
    assert environment.find_library(names, ("$CONDA_PREFIX/lib", str(tmp_path))) == str(
        tmp_path / "libtcmalloc_minimal.so.4")
    assert environment.find_library(environment.ALLOCATORS["jemalloc"], (str(tmp_path),)) is None
    monkeypatch.setattr(environment, "LIBRARY_FOLDERS", (str(tmp_path),))
    assert environment.installed_allocators() == {"tcmalloc": str(tmp_path / "libtcmalloc_minimal.so.4")}


def test_allocator_names_come_from_the_library_file():
    assert environment.cpu_allocator("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2") == "jemalloc"
    assert environment.cpu_allocator("/opt/lib/libtcmalloc_minimal.so.4") == "tcmalloc"
    assert environment.cpu_allocator("/opt/lib/libmimalloc.so.2") == "mimalloc"
    assert environment.cpu_allocator("/opt/lib/libsomething.so") == "libsomething.so"


@pytest.mark.skipif(not GLIBC_LINUX, reason="glibc's malloc: Linux with glibc")
def test_a_process_without_a_preload_runs_on_glibcs_malloc():
    allocator, library = allocator_of_a_fresh_process(None)
    assert allocator == "glibc" and os.path.basename(library).startswith("libc")


@pytest.mark.skipif(not GLIBC_LINUX, reason="LD_PRELOAD and glibc's malloc: Linux with glibc")
def test_a_preloaded_allocator_is_the_one_the_process_calls():
    installed = environment.installed_allocators()
    if not installed:
        pytest.skip(f"no jemalloc, tcmalloc or mimalloc in {environment.LIBRARY_FOLDERS}")
    for allocator, path in installed.items():
        assert allocator_of_a_fresh_process(path) == [allocator, path]


def test_env_command_prints_every_setting_and_the_allocator_hint_under_glibc(capsys, monkeypatch):
    monkeypatch.setattr(environment, "malloc_library", lambda: "/lib/x86_64-linux-gnu/libc.so.6")
    monkeypatch.setattr(environment.platform, "libc_ver", lambda: ("glibc", "2.36"))
    monkeypatch.setattr(environment, "installed_allocators", lambda: {"jemalloc": "/x/libjemalloc.so.2"})
    assert main(["env", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {"hf_cpt", "torch", "transformers", "accelerate", "python", "platform", "accelerator",
                           "CUDA backend", "CPU products", "C kernels", "threads", "memory allocator"}
    assert report["memory allocator"].startswith("glibc (/lib/x86_64-linux-gnu/libc.so.6): a CPU run's peak memory")
    assert report["memory allocator"].endswith("installed here: LD_PRELOAD=/x/libjemalloc.so.2")
    monkeypatch.setattr(environment, "malloc_library", lambda: "/x/libjemalloc.so.2")
    assert main(["env"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "- memory allocator: jemalloc (/x/libjemalloc.so.2)" in lines and len(lines) == len(report)


def test_env_says_whether_the_cuda_backend_is_on(monkeypatch):
    from hf_cpt.backends import CUDA_KERNELS_VARIABLE

    monkeypatch.delenv(CUDA_KERNELS_VARIABLE, raising=False)
    assert environment.environment_report()["CUDA backend"].startswith("off: the reference formulas on CUDA tensors")
    monkeypatch.setenv(CUDA_KERNELS_VARIABLE, "1")
    monkeypatch.setattr(environment, "_version", lambda name: "not installed" if name == "triton" else "1.0")
    assert "Triton is not installed" in environment.environment_report()["CUDA backend"]
