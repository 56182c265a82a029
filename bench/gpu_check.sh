#!/usr/bin/env bash
# The prepared GPU check (one H100/H200, `run` in the tool library): the CUDA tests with the CUDA backend's kernels on,
# then bench/gpu.py where it exists. Logs and JSON go under $OUT (the device tool's folder; else outputs/gpu).
# The device image has its own torch / transformers: hf_cpt runs from this checkout (PYTHONPATH), not installed.
set -uo pipefail
OUT=${OUT:-outputs/gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_CPT_CUDA_KERNELS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
timeout 420 python -m pytest -q -p no:cacheprovider -x tests/test_cuda_kernels.py tests/test_cuda.py 2>&1 \
    | tee "$OUT/tests.log" | tail -20
if [ -f bench/gpu.py ]; then
    timeout 300 python bench/gpu.py --output "$OUT/gpu.json" 2>&1 | tail -20
fi
