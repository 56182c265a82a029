#!/usr/bin/env bash
# The prepared GPU check (one H100/H200, `run` in the tool library), under 8 minutes: the CUDA tests with the CUDA
# backend's kernels on, then the GPU bench. Logs and JSON go under $OUT (the device tool's folder; else outputs/gpu);
# copy $OUT/gpu.json to bench/results/gpu.json and run `python bench/report.py` for the docs.
# The device image has its own torch / transformers: hf_cpt runs from this checkout (PYTHONPATH), not installed.
# torchao's rows need its wheel, fetched beforehand where a registry is reachable (`pip download --no-deps torchao -d
# wheels/`; ignored by git; pass "wheels" in `carry`), installed here without deps.
set -uo pipefail
OUT=${OUT:-outputs/gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_CPT_CUDA_KERNELS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
if compgen -G "wheels/torchao-*.whl" > /dev/null; then
    python -m pip install -q --no-deps wheels/torchao-*.whl 2>&1 | tail -2
fi
# tests/test_cuda.py runs the interpreter tests' comparisons on the GPU (the interpreter ones are CPU work: CI's), then
# the compositions (LoRA, autocast, checkpointing, accumulation, compile, FSDP2): four workers where pytest-xdist is
# installed (one GPU holds them all), the slowest tests named.
WORKERS=$(python -c "import xdist" 2>/dev/null && echo "-n 4")
timeout 200 python -m pytest -q -p no:cacheprovider ${WORKERS:-} --durations=8 tests/test_cuda.py 2>&1 \
    | tee "$OUT/tests.log" | tail -30
timeout 260 python bench/gpu.py --output "$OUT/gpu.json" 2>&1 | tee "$OUT/bench.log" | tail -30
