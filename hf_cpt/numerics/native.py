"""Native CPU kernels: the package's C sources, built once per machine into a cached shared library.

Built in a fraction of a second with the system's C compiler (the one ``torch.compile`` needs on CPU too), cached
under ``$HF_CPT_CACHE`` (default ``~/.cache/hf_cpt``) keyed by the source, the flags and the CPU, and reused by later
processes. Without a compiler, or when the build fails, `load` returns None and the caller keeps its other path.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# Exact IEEE float32 arithmetic (no fused multiply-add, no fast-math), vectorized for this CPU.
FLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC", "-pthread")
NATIVE_FLAGS = ("-march=native",)
OPENMP_FLAGS = ("-fopenmp",)  # the kernels' slices on torch's OpenMP team (native_threads.h); tried first
DISABLE_VARIABLE = "HF_CPT_NATIVE_KERNELS"  # "0" turns the native kernels off (the callers' other path runs)
THREADS_VARIABLE = "HF_CPT_NATIVE_THREADS"  # how many threads a kernel splits its rows over


def threads() -> int:
    """The threads a native kernel splits its rows over: ``$HF_CPT_NATIVE_THREADS``, else torch's thread count where
    the kernels run on torch's OpenMP team (built with OpenMP), else one: inside a training step torch's idle OpenMP
    workers keep spinning on the other cores, so threads of a kernel's own wait for a core, and one measured faster
    there than two (docs/compatibility.md)."""
    value = os.environ.get(THREADS_VARIABLE)
    if value is None:
        return torch.get_num_threads() if _on_openmp_team else 1
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{THREADS_VARIABLE} must be a positive integer, got {value!r}")
    return int(value)


def takes(t: torch.Tensor, min_numel: int) -> bool:
    """Whether a native kernel may take ``t``: a contiguous CPU tensor of at least ``min_numel`` elements (below, the
    call costs more than it saves), outside a graph that torch.compile traces or exports (a kernel is an opaque call
    on raw pointers). Each caller checks its dtypes and layout."""
    return (t.device.type == "cpu" and t.is_contiguous() and t.numel() >= min_numel
            and not torch.compiler.is_dynamo_compiling() and not torch.compiler.is_exporting())


def cache_dir() -> Path:
    """Where built libraries live: ``$HF_CPT_CACHE``, else ``$XDG_CACHE_HOME/hf_cpt``, else ``~/.cache/hf_cpt``; a
    folder only this user can write (created so), each library beside the SHA-256 its build recorded."""
    if os.environ.get("HF_CPT_CACHE"):
        return Path(os.environ["HF_CPT_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hf_cpt"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _cpu_signature() -> str:
    # -march=native code may not run on another CPU sharing this cache (a network home): key the build on the CPU.
    try:
        with open("/proc/cpuinfo") as info:
            return next((line for line in info if line.startswith(("flags", "Features"))), platform.processor())
    except OSError:
        return platform.processor()


def _build(source: Path, target: Path, compiler: str) -> str | None:
    """Compile ``source`` into ``target`` (atomically: concurrent ranks may build the same library);
    the compiler's complaint on failure."""
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    complaint = None
    # a compiler without OpenMP or -march=native still builds the kernels, on POSIX threads or portable
    for flags in (FLAGS + OPENMP_FLAGS + NATIVE_FLAGS, FLAGS + OPENMP_FLAGS, FLAGS + NATIVE_FLAGS, FLAGS):
        with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as scratch:
            partial = Path(scratch.name)
        try:
            run = subprocess.run([compiler, *flags, str(source), "-o", str(partial), "-lm"],
                                 capture_output=True, text=True, timeout=120)
            if run.returncode == 0:
                _digest_file(target).write_text(_file_digest(partial))
                os.replace(partial, target)
                return None
            complaint = run.stderr.strip().splitlines()[-1] if run.stderr.strip() else f"exit {run.returncode}"
        except (OSError, subprocess.TimeoutExpired) as error:
            complaint = f"{type(error).__name__}: {error}"
        finally:
            partial.unlink(missing_ok=True)
    return complaint


def _target(source: Path) -> Path:
    # The key covers the package's headers too (every kernel includes them), so a changed header rebuilds all.
    headers = [header.read_text() for header in sorted(source.parent.glob("*.h"))]
    parts = [source.read_text(), *headers, *FLAGS, *OPENMP_FLAGS, *NATIVE_FLAGS, platform.machine(), _cpu_signature()]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    return cache_dir() / f"{source.stem}-{key}.so"


# The build outcome (None: built) of each library this process built, so a failed build is tried only once.
_built: dict[Path, str | None] = {}


def _missing() -> list[tuple[Path, Path]]:
    """(target, source) of each package library neither in the cache, nor tried by this process, nor building ahead
    (`build_ahead`), the largest source first: its build takes longest, so started first it ends with the others
    (and the rotation and codes kernels, the largest, are what a first forward needs)."""
    sources = sorted(Path(__file__).parent.glob("*.c"), key=lambda source: (-source.stat().st_size, source.name))
    targets = [(_target(source), source) for source in sources]
    return [(target, source) for target, source in targets
            if target not in _built and target not in _pending and not target.exists()]


def _build_one(target: Path, source: Path, compiler: str) -> None:
    try:
        _built[target] = _build(source, target, compiler)
    except OSError as error:  # an unwritable cache directory
        _built[target] = f"{type(error).__name__}: {error}"


def _build_missing(compiler: str) -> None:
    """Build every package library missing from the cache, concurrently: a run soon needs all of them, and a new
    machine then waits for the slowest build instead of their sum."""
    missing = _missing()
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(missing))) as pool:
        for future in [pool.submit(_build_one, *job, compiler) for job in missing]:
            future.result()


# The builds `build_ahead` started on background threads, by library, until `load` has waited for each.
_pending: dict[Path, concurrent.futures.Future] = {}


def _forget_pending() -> None:  # a forked child has no build thread: it builds (or finds) the libraries itself
    _pending.clear()


os.register_at_fork(after_in_child=_forget_pending)


def build_ahead() -> None:
    """Start building the package's libraries missing from the cache on background threads, one per core at a time,
    the largest first, and return at once. `hf_cpt.quantize_model` calls it, so that on a new machine the build (a
    few seconds of compiler time) overlaps the rest of a run's setup instead of stalling its first training step;
    `load` waits for the library it loads where its build has not finished, not for the others."""
    if _pending or os.environ.get(DISABLE_VARIABLE) == "0":
        return
    missing = _missing()
    compiler = _compiler() if missing else None
    if compiler is None:
        return
    builder = concurrent.futures.ThreadPoolExecutor(max_workers=min(len(missing), os.cpu_count() or 1),
                                                    thread_name_prefix="hf_cpt-build")
    _pending.update((target, builder.submit(_build_one, target, source, compiler)) for target, source in missing)
    builder.shutdown(wait=False)  # its threads end with the builds


def _wait_for_pending(target: Path) -> None:
    pending = _pending.pop(target, None)
    if pending is not None:
        try:
            pending.result()
        except Exception as error:  # noqa: BLE001  (its outcome is recorded per library; load reports a failure)
            logger.info("hf_cpt: the background build of %s stopped (%s)", target.name, error)


def bind(name: str, entries: dict[str, tuple[list, type | None]]) -> ctypes.CDLL | None:
    """`load`, with the argument and result types of each entry point declared (``{entry: (argtypes, restype)}``),
    or None."""
    library = load(name)
    if library is not None:
        for entry, (argtypes, restype) in entries.items():
            function = getattr(library, entry)
            function.argtypes, function.restype = argtypes, restype
    return library


def _digest_file(library: Path) -> Path:
    return library.with_suffix(".sha256")


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _trusted(path: Path) -> bool:
    """Whether ``path`` is this user's and writable by no one else (whoever writes it runs code in every process)."""
    if not hasattr(os, "getuid"):
        return True
    info = path.stat()
    return info.st_uid == os.getuid() and not info.st_mode & 0o022


def _verified(target: Path) -> bool:
    """A cached library whose bytes are those its build recorded; any other is removed, to be rebuilt."""
    digest = _digest_file(target)
    if not digest.exists():  # built before digests were recorded
        logger.info("hf_cpt: %s has no recorded digest; rebuilding it", target)
    elif _trusted(digest) and digest.read_text().strip() == _file_digest(target):
        return True
    else:
        logger.warning("hf_cpt: %s does not match the digest recorded when it was built; rebuilding it", target)
    target.unlink(missing_ok=True)
    _built.pop(target, None)
    return False


@functools.cache
def load(name: str) -> ctypes.CDLL | None:
    """The shared library built from ``hf_cpt/numerics/<name>.c`` (built on first use, with the package's other
    libraries, then cached; or by `build_ahead`), or None."""
    if os.environ.get(DISABLE_VARIABLE) == "0":
        return None
    target = _target(Path(__file__).with_name(f"{name}.c"))
    _wait_for_pending(target)
    folder = cache_dir()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not _trusted(folder) or (target.exists() and not _trusted(target)):
        logger.warning("hf_cpt: the kernel cache %s is writable by another user (or not yours); the native kernels "
                       "are off. Set HF_CPT_CACHE to a folder only you can write.", folder)
        return None
    if not target.exists() or not _verified(target):
        compiler = _compiler()
        if compiler is None:
            logger.info("hf_cpt: no C compiler found (set CC); the native %s kernel is off", name)
            return None
        if target not in _built:
            _build_missing(compiler)
        complaint = _built.get(target, "not built")
        if complaint is not None:
            logger.warning("hf_cpt: building the native %s kernel with %s failed (%s); using the other path",
                           name, compiler, complaint)
            return None
    try:
        library = ctypes.CDLL(str(target))
    except OSError as error:
        logger.warning("hf_cpt: loading %s failed (%s); using the other path", target, error)
        return None
    global _on_openmp_team
    _on_openmp_team = bool(library.hf_cpt_openmp()) and _on_openmp_team is not False
    return library


# Whether every kernel library loaded so far splits its work on an OpenMP team (None: none loaded yet).
_on_openmp_team: bool | None = None
