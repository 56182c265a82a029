"""What on this machine decides a CPT run's speed and memory, as ``hf-cpt env`` prints it: library versions, the
accelerator, how the layers multiply on this CPU, whether the C kernels build, the threads, and the memory allocator.

The allocator matters on CPU: glibc's heap keeps freed holes resident, so a step's peak follows the order of
allocations as much as the memory in use; under jemalloc or tcmalloc, preloaded, the bench's peaks followed the
memory in use (docs/benchmarks.md, "The allocator").
"""

from __future__ import annotations

import ctypes
import glob
import importlib.metadata
import os
import platform

# Preloadable allocators -> the names their libraries ship under (tcmalloc's minimal build has no profiler).
ALLOCATORS = {"jemalloc": ("jemalloc",), "tcmalloc": ("tcmalloc", "tcmalloc_minimal"), "mimalloc": ("mimalloc",)}
# Where they are installed: a conda or virtual environment, the user's, the system's (Debian's multiarch folders too).
LIBRARY_FOLDERS = ("$CONDA_PREFIX/lib", "$VIRTUAL_ENV/lib", "~/.local/lib", "/usr/local/lib", "/usr/local/lib64",
                   "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib")
ALLOCATOR_HINT = ("a CPU run's peak memory includes the holes glibc's heap keeps resident; with jemalloc or tcmalloc "
                  "preloaded (LD_PRELOAD) the bench's peaks followed the memory in use, and the quantized models' "
                  "savings showed in them (docs/benchmarks.md, \"The allocator\")")


def find_library(names: tuple[str, ...], folders: tuple[str, ...] | None = None) -> str | None:
    """The first ``lib<name>.so*`` of ``names`` in ``folders`` (default `LIBRARY_FOLDERS`; variables and ``~``
    expanded; a folder whose variable is unset is skipped; of one name's files, the shortest name), or None."""
    for name in names:
        for folder in LIBRARY_FOLDERS if folders is None else folders:
            folder = os.path.expanduser(os.path.expandvars(folder))
            if "$" in folder:
                continue
            found = sorted(glob.glob(os.path.join(folder, f"lib{name}.so*")), key=len)
            if found:
                return found[0]
    return None


def installed_allocators() -> dict[str, str]:
    """The preloadable allocators found on this machine (`ALLOCATORS`, `LIBRARY_FOLDERS`): name -> library."""
    found = {allocator: find_library(names) for allocator, names in ALLOCATORS.items()}
    return {allocator: path for allocator, path in found.items() if path is not None}


class _SymbolInfo(ctypes.Structure):  # dladdr's Dl_info
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def malloc_library() -> str | None:
    """The path of the shared library whose ``malloc`` this process calls: the one the dynamic loader binds, so a
    preloaded allocator where ``LD_PRELOAD`` names one (None where the loader cannot say, e.g. on Windows)."""
    try:
        process = ctypes.CDLL(None)
        address = ctypes.cast(process.malloc, ctypes.c_void_p).value
        info = _SymbolInfo()
        if not process.dladdr(ctypes.c_void_p(address), ctypes.byref(info)) or not info.dli_fname:
            return None
    except (OSError, AttributeError, TypeError):
        return None
    return os.fsdecode(info.dli_fname)


def cpu_allocator(library: str | None = None) -> str | None:
    """The name of the malloc this process runs on (of ``library``, default `malloc_library`): ``"jemalloc"``,
    ``"tcmalloc"`` or ``"mimalloc"``; ``"glibc"`` for glibc's own; else the library's file name (None: unknown)."""
    library = malloc_library() if library is None else library
    if library is None:
        return None
    name = os.path.basename(library)
    for allocator in ALLOCATORS:
        if allocator in name:
            return allocator
    if name.startswith("libc.so") or name.startswith("libc-"):
        return "glibc" if platform.libc_ver()[0] == "glibc" else "libc"
    return name


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _kernel_threads(native) -> str:
    """The threads a C kernel splits its rows over here, and on which (a kernel library loaded to know)."""
    if native.load("code_kernels") is None:
        return "none: the torch formulas run"
    return f"{native.threads()}, " + ("on torch's OpenMP team" if native._on_openmp_team else "POSIX threads")


def environment_report() -> dict[str, str]:
    """``hf-cpt env``'s lines: what each setting is on this machine and what it means for a CPT run."""
    import torch

    from ..backends import CUDA_KERNELS_VARIABLE as switch
    from ..backends import backend_for
    from ..backends.cpu import INT8_DOT_VARIABLE
    from ..numerics import native
    from ..version import __version__

    if torch.cuda.is_available():
        accelerator = f"CUDA, {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    else:
        accelerator = "none (CPU)"
    forced = f" (${INT8_DOT_VARIABLE}={os.environ[INT8_DOT_VARIABLE]})" if INT8_DOT_VARIABLE in os.environ else ""
    products = (f"on integer codes: int8 dot products{forced}" if backend_for("cpu").products_on_codes("auto") else
                f"on fake-quantized floats: no int8 dot products{forced} (integer_matmul=True trades time for "
                "memory)")
    if os.environ.get(native.DISABLE_VARIABLE) == "0":
        kernels = f"off (${native.DISABLE_VARIABLE}=0): torch formulas"
    else:
        compiler = native._compiler()
        kernels = (f"built with {compiler}, cached in {native.cache_dir()}" if compiler else
                   f"no C compiler: torch formulas, unless {native.cache_dir()} holds kernels built before")
    library = malloc_library()
    allocator = cpu_allocator(library)
    memory = f"{allocator or 'unknown'}" + (f" ({library})" if library else "")
    if allocator == "glibc":
        installed = installed_allocators()
        memory += f": {ALLOCATOR_HINT}; " + (
            "installed here: " + ", ".join(f"LD_PRELOAD={path}" for path in installed.values()) if installed else
            "none is installed in " + ", ".join(LIBRARY_FOLDERS))
    triton = _version("triton")
    cuda_backend = (f"off: the reference formulas on CUDA tensors (${switch}=1 turns on the Triton kernels and int8 "
                    "products, not yet run on a GPU)" if os.environ.get(switch) != "1" else
                    f"on (${switch}=1), Triton {triton}" if triton != "not installed" else
                    f"${switch}=1 but Triton is not installed: the reference formulas")
    return {"hf_cpt": __version__, "torch": torch.__version__, "transformers": _version("transformers"),
        "accelerate": _version("accelerate"), "python": platform.python_version(), "platform": platform.platform(),
        "accelerator": accelerator, "CUDA backend": cuda_backend, "CPU products": products, "C kernels": kernels,
        "threads": f"{torch.get_num_threads()} (a C kernel's: {_kernel_threads(native)})", "memory allocator": memory}
