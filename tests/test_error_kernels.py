"""The fused error quantizers (hf_cpt/numerics/error_kernels.py, error_kernels.c, native.py): one formula, the same
values on every path (the formula run eagerly, torch.compile, the native C kernel)."""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_cpt.numerics import error_kernels, native
from hf_cpt.numerics.error_kernels import KERNEL_SOURCES, hashed_uniform_noise
from hf_cpt.numerics.errors import ErrorQuantization, quantize_error

from .fresh_python import run_python

GRIDS = [("token", "minmax"), ("tensor", "minmax"), ("token", "symmetric"), ("tensor", "symmetric")]


def test_hashed_noise_is_uniform():
    noise = hashed_uniform_noise(1_000_000, torch.tensor(99, dtype=torch.int32), torch.device("cpu"))
    assert noise.min() >= -0.5 and noise.max() < 0.5
    assert abs(noise.mean().item()) < 1e-3
    assert abs(noise.std().item() - (1 / 12) ** 0.5) < 1e-3
    other = hashed_uniform_noise(1_000_000, torch.tensor(100, dtype=torch.int32), torch.device("cpu"))
    assert abs(torch.corrcoef(torch.stack([noise, other]))[0, 1].item()) < 5e-3


def _lowbias32_noise(index: int, seed: int) -> float:
    """The hashed noise of one element, in Python integers (docs/method.md §2)."""
    mask = 0xFFFFFFFF
    h = (index ^ seed) & mask
    h ^= h >> 16
    h = (h * 0x7FEB352D) & mask
    h ^= h >> 15
    h = (h * 0x846CA68B) & mask
    h ^= h >> 16
    return (h >> 8) / (1 << 24) - 0.5


def test_hashed_noise_is_the_lowbias32_hash_of_index_and_seed():
    seed = 987654321
    noise = hashed_uniform_noise(70_000, torch.tensor(seed, dtype=torch.int32), torch.device("cpu"))
    for index in (0, 1, 2, 65_535, 65_536, 69_999):
        assert noise[index].item() == _lowbias32_noise(index, seed)


def _errors(shape, dtype, granularity):
    """Errors spanning five orders of magnitude across rows, with padding rows of zeros at the end."""
    grad = (torch.randn(shape) * torch.logspace(-5, 0, shape[0]).view(-1, 1)).to(dtype)
    grad[-7:] = 0.0
    return grad if granularity == "token" else grad.reshape(-1)


@pytest.mark.slow
@pytest.mark.parametrize("granularity, dtype, grid", [("token", torch.float32, "minmax"),
                                                      ("token", torch.bfloat16, "minmax"),
                                                      ("tensor", torch.float32, "minmax"),
                                                      ("token", torch.bfloat16, "symmetric"),
                                                      ("tensor", torch.float32, "symmetric")])
def test_compiled_error_kernel_gives_the_formulas_values_bit_for_bit(granularity, dtype, grid):
    """The torch.compile kernel (an accelerator's fused path) and the formula a compiled model traces (eager here)
    agree exactly: the noise depends only on the element index and the seed."""
    source, levels_of = KERNEL_SOURCES[granularity, grid]
    kernel = error_kernels._compiled_kernel(granularity, grid)
    levels, seed = levels_of(torch.tensor(6.0)), torch.tensor(4321, dtype=torch.int32)
    torch.manual_seed(0)
    for shape in [(1024, 96), (333, 257), (4096, 48)]:
        grad = _errors(shape, dtype, granularity)
        assert torch.equal(kernel(grad, levels, seed), source(grad, levels, seed))


def _native(granularity, grid):
    kernel = error_kernels._native_kernel(granularity, grid)
    if kernel is None:
        pytest.skip("no C compiler on this machine")
    return kernel


@pytest.mark.parametrize("granularity, grid", GRIDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_kernel_gives_the_formulas_values_bit_for_bit_at_every_thread_count(granularity, grid, dtype,
                                                                                  monkeypatch):
    """The C kernel (the CPU's fused path) equals the formula element for element, at 3 to 8 bits, for rows
    spanning five orders of magnitude, padding rows of zeros, odd shapes, and any number of threads."""
    source, levels_of = KERNEL_SOURCES[granularity, grid]
    kernel = _native(granularity, grid)
    torch.manual_seed(0)
    for bits, shape in [(3.0, (1024, 96)), (4.0, (333, 257)), (6.0, (4096, 48)), (8.0, (70_000, 3))]:
        grad = _errors(shape, dtype, granularity)
        levels, seed = levels_of(torch.tensor(bits)), torch.tensor(int(bits) * 977, dtype=torch.int32)
        expected = source(grad, levels, seed)
        for count in (1, 2, 3):
            monkeypatch.setenv(native.THREADS_VARIABLE, str(count))
            got = kernel(grad, levels, seed)
            assert got.dtype == grad.dtype and got.shape == grad.shape
            assert torch.equal(got, expected), (bits, shape, count)


@pytest.mark.parametrize("granularity, grid", GRIDS)
def test_native_kernel_propagates_a_non_finite_error_as_the_formula_does(granularity, grid):
    source, levels_of = KERNEL_SOURCES[granularity, grid]
    grad = _errors((512, 160), torch.float32, granularity)
    grad.view(512, 160)[3, 5], grad.view(512, 160)[9, 1] = float("nan"), float("inf")
    levels, seed = levels_of(torch.tensor(8.0)), torch.tensor(7, dtype=torch.int32)
    expected = source(grad, levels, seed)
    torch.testing.assert_close(_native(granularity, grid)(grad, levels, seed), expected, rtol=0, atol=0,
                               equal_nan=True)


def test_a_cpu_tensor_takes_the_native_kernel_and_other_devices_the_compiled_one(monkeypatch):
    _native("token", "minmax")
    compiled = error_kernels._compiled_kernel("token", "minmax")
    assert error_kernels.fused_kernel(torch.device("cpu"), "token") is error_kernels._native_kernels["token"]
    assert error_kernels.fused_kernel(torch.device("meta"), "token") is compiled
    with error_kernels.compiled_kernels_on_cpu():  # bench/overhead.py --compare-kernels
        assert error_kernels.fused_kernel(torch.device("cpu"), "token") is compiled
    assert error_kernels.fused_kernel(torch.device("cpu"), "token") is error_kernels._native_kernels["token"]
    monkeypatch.setattr(error_kernels, "_native_kernels", {"token": None})  # no C compiler on this machine
    assert error_kernels.fused_kernel(torch.device("cpu"), "token") is compiled


def test_a_failing_fused_kernel_falls_back_to_the_eager_quantizer_with_one_warning(monkeypatch, caplog):
    def broken(*args):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(error_kernels, "_native_kernels", {"token": broken})
    monkeypatch.setattr(error_kernels, "_fused_disabled_reason", None)
    grad = torch.randn(512, 256)
    scheme = ErrorQuantization("token")
    with caplog.at_level("WARNING", logger="hf_cpt.numerics.error_kernels"):
        results = [quantize_error(grad, torch.tensor(8.0), scheme) for _ in range(3)]
    assert [r.getMessage().count("no C++ compiler") for r in caplog.records] == [1]
    assert error_kernels._fused_disabled_reason == "RuntimeError: no C++ compiler"
    low, high = grad.amin(-1, keepdim=True), grad.amax(-1, keepdim=True)
    for q in results:
        codes = (q - low) / ((high - low) / 255)
        assert torch.allclose(codes, codes.round(), atol=1e-3)


def test_a_compiler_that_fails_leaves_no_library_and_one_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("HF_CPT_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a "compiler" that exits 1
    native.load.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="hf_cpt.numerics.native"):
            assert native.load("error_kernels") is None
        assert any("building the native error_kernels kernel with false failed" in r.getMessage()
                   for r in caplog.records)
        assert list(tmp_path.iterdir()) == []  # no partial library left behind
    finally:
        native.load.cache_clear()


# A backward step's errors, both granularities on both grids, in a fresh process; prints what ran.
_FRESH_PROCESS = """
import sys, torch
from hf_cpt.numerics import error_kernels
from hf_cpt.numerics.errors import ErrorQuantization, quantize_error
for granularity in ('tensor', 'token'):
    for grid in ('minmax', 'symmetric'):
        q = quantize_error(torch.randn(256, 512), torch.tensor(8.0), ErrorQuantization(granularity, range=grid))
        assert torch.isfinite(q).all()
native = sorted(name for name, kernel in error_kernels._native_kernels.items() if kernel is not None)
compiled = sorted(error_kernels._compiled_kernels)
print('native', native, 'compiled', compiled, 'inductor', 'torch._inductor' in sys.modules)
"""


def _fresh(env_changes, tmp_path):
    env = {**os.environ, "CUDA_HOME": str(tmp_path / "cuda"), **env_changes}  # a CUDA path without a CUDA runtime
    run = subprocess.run([sys.executable, "-c", _FRESH_PROCESS], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return run


@pytest.mark.slow
def test_a_cpu_run_builds_the_native_kernel_once_per_machine_and_loads_no_compiler_stack(tmp_path):
    if native._compiler() is None:
        pytest.skip("no C compiler on this machine")
    cache = tmp_path / "cache"
    first = _fresh({"HF_CPT_CACHE": str(cache)}, tmp_path)
    everything = "['tensor', 'tensor/symmetric', 'token', 'token/symmetric']"
    assert f"native {everything} compiled [] inductor False" in first.stdout
    assert "No CUDA runtime is found" not in first.stderr
    built = sorted(path.name for path in cache.iterdir())
    # every package library at once (concurrently: a run needs them all), one per C source, beside its digest
    sources = sorted(path.stem for path in Path(native.__file__).parent.glob("*.c"))
    libraries = [name for name in built if name.endswith(".so")]
    assert [name.rsplit("-", 1)[0] for name in libraries] == sources
    assert sorted(built) == sorted(libraries + [name[:-3] + ".sha256" for name in libraries])
    # A later process on the machine reuses the library: it needs no compiler at all.
    second = _fresh({"HF_CPT_CACHE": str(cache), "CC": str(tmp_path / "no-such-compiler")}, tmp_path)
    assert f"native {everything} compiled []" in second.stdout
    assert sorted(path.name for path in cache.iterdir()) == built


_LOAD = "from hf_cpt.numerics import native; print('loaded', native.load('error_kernels') is not None)"


@pytest.mark.slow
def test_a_library_changed_in_the_cache_is_rebuilt_and_a_cache_others_can_write_is_not_used(tmp_path):
    """Each cached library sits beside the SHA-256 its build recorded: a library whose bytes changed is rebuilt, not
    loaded. A cache folder another user could write (whoever writes it runs code in every process that loads the
    kernels) is not used at all: the kernels are off, with a warning naming the folder."""
    if native._compiler() is None:
        pytest.skip("no C compiler on this machine")
    cache = tmp_path / "cache"
    env = {**os.environ, "HF_CPT_CACHE": str(cache)}
    assert "loaded True" in run_python(["-c", _LOAD], env=env, timeout=300).stdout
    library = next(cache.glob("error_kernels-*.so"))
    recorded = library.with_suffix(".sha256").read_text()
    library.write_bytes(library.read_bytes() + b"tampered")
    again = run_python(["-c", _LOAD], env=env, timeout=300)
    assert "loaded True" in again.stdout and "does not match the digest recorded" in again.stderr
    assert hashlib.sha256(library.read_bytes()).hexdigest() == recorded  # rebuilt: the same bytes as built
    cache.chmod(0o777)
    shared = run_python(["-c", _LOAD], env=env, timeout=300)
    assert "loaded False" in shared.stdout and f"the kernel cache {cache} is writable by another user" in shared.stderr


_BUILD_AHEAD = """
import os, torch
from hf_cpt import quantize_model
from hf_cpt.numerics import native
quantize_model(torch.nn.Sequential(torch.nn.Linear(8, 8)))
started = bool(native._pending)
pid = os.fork()
if pid == 0:  # a forked child has no build thread to wait for
    os._exit(0 if not native._pending else 3)
child = os.waitpid(pid, 0)[1] == 0
for build in list(native._pending.values()):
    build.result()
print('started', started, 'child', child, 'loaded', native.load.cache_info().currsize)
"""


@pytest.mark.slow
def test_quantize_model_builds_the_kernels_ahead_of_the_first_step(tmp_path):
    """On a new machine the C build starts when the model is quantized, on a thread, and has built every library
    before any kernel ran; once they are all cached, nothing starts."""
    if native._compiler() is None:
        pytest.skip("no C compiler on this machine")
    cache = tmp_path / "cache"
    env = {**os.environ, "HF_CPT_CACHE": str(cache)}
    first = run_python(["-c", _BUILD_AHEAD], timeout=300, env=env)  # a process of the tests' server: no hf_cpt yet
    assert first.returncode == 0, first.stderr[-2000:]
    assert "started True child True loaded 0" in first.stdout
    sources = sorted(path.stem for path in Path(native.__file__).parent.glob("*.c"))
    assert sorted(path.name.rsplit("-", 1)[0] for path in cache.glob("*.so")) == sources
    again = run_python(["-c", _BUILD_AHEAD], timeout=300, env=env)
    assert "started False child True loaded 0" in again.stdout, again.stderr[-2000:]


_ONE_LIBRARY_AT_A_TIME = """
import os, threading
from hf_cpt.numerics import native
os.cpu_count = lambda: 4  # as many builds at once as the libraries, however many cores this machine has
held = threading.Event()
real = native._build
def build(source, target, compiler):  # the rotation kernels' build waits until this process lets it go on
    if source.stem == "rotation_kernels":
        held.wait(60)
    return real(source, target, compiler)
native._build = build
order = [source.stem for _, source in native._missing()]
native.build_ahead()
errors = native.load("error_kernels") is not None
rotation_building = not any(target.stem.startswith("rotation_kernels") for target in native._built)
held.set()
print("order", order, "errors", errors, "rotation still building", rotation_building,
      "rotation", native.load("rotation_kernels") is not None)
"""


@pytest.mark.slow
def test_load_waits_for_its_own_library_not_for_the_builds_started_ahead(tmp_path):
    """On a new machine the libraries build ahead, the largest first (the first forward needs the rotation and
    codes kernels); a kernel is loaded as soon as its own library is built, while the others still build."""
    if native._compiler() is None:
        pytest.skip("no C compiler on this machine")
    env = {**os.environ, "HF_CPT_CACHE": str(tmp_path / "cache")}
    run = run_python(["-c", _ONE_LIBRARY_AT_A_TIME], timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    sources = sorted(Path(native.__file__).parent.glob("*.c"), key=lambda source: -source.stat().st_size)
    order = [source.stem for source in sources]
    assert order[:2] == ["rotation_kernels", "code_kernels"]
    assert f"order {order} errors True rotation still building True rotation True" in run.stdout


@pytest.mark.slow
def test_without_the_native_kernel_the_compiled_one_runs_and_prints_no_cuda_warning(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("the warning concerns machines without a GPU")
    control = subprocess.run([sys.executable, "-c", "import torch.utils.cpp_extension"], capture_output=True,
                             text=True, env={**os.environ, "CUDA_HOME": str(tmp_path)}, timeout=300)
    assert "No CUDA runtime is found" in control.stderr  # what torch prints when nothing silences it
    run = _fresh({native.DISABLE_VARIABLE: "0"}, tmp_path)
    assert "native [] compiled ['tensor', 'tensor/symmetric', 'token', 'token/symmetric'] inductor True" in run.stdout
    assert "No CUDA runtime is found" not in run.stderr
