#!/usr/bin/env bash
# Issue 76 on one H100/H200 (`run` in the tool library): the CIFAR ResNet-20 at 4, 16, 64 and 160 epochs with the
# paper's 32 cycles, 4 seeds per cell, several processes sharing the GPU (each claims a (length, run, seed) before
# training it; the JSON resumes across runs of this script). Locally first:
#     python bench/gpu_bundle.py --bundle cifar10 --folder gpu_cifar    # gpu_cifar/cifar10_uint8.npz (54 MiB)
# then `run` with carry ["gpu_cifar"] and the command `bash bench/gpu_horizon.sh`; copy $OUT/horizon_gpu.json to
# bench/results/ and run `python bench/report.py`.
set -uo pipefail
OUT=${OUT:-outputs/gpu}
PROCESSES=${PROCESSES:-8}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_CPT_CUDA_KERNELS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
for worker in $(seq 1 "$PROCESSES"); do
    python bench/horizon.py --device cuda --images gpu_cifar/cifar10_uint8.npz --epochs 4 16 64 160 \
        --seeds 0 1 2 3 --runs fp32 static-8/8 cpt-3-8/8-n32 ct-3-8/8-n8-delay \
        --output "$OUT/horizon_gpu.json" --work_dir "outputs/horizon_$worker" > "$OUT/horizon_$worker.log" 2>&1 &
done
wait
tail -3 "$OUT"/horizon_*.log
