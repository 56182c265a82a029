#!/usr/bin/env bash
# Issue 76 on one H100/H200 (`run` in the tool library): the CIFAR ResNet-20 at 4, 16, 64 and 160 epochs with the
# paper's 32 cycles, 4 seeds per cell, several processes sharing the GPU (each claims a (length, run, seed) before
# training it; the JSON resumes across runs of this script). Locally first:
#     python bench/gpu_bundle.py --bundle horizon --folder gpu_cifar    # CIFAR-10 as one array, WikiText-2 (57 MiB)
# then `run` with carry ["gpu_cifar"] and the command `bash bench/gpu_horizon.sh`; copy $OUT/*.json to
# bench/results/ and run `python bench/report.py`. STAGE=lm: the Llama-style language model instead (3 processes).
set -uo pipefail
OUT=${OUT:-outputs/gpu}
PROCESSES=${PROCESSES:-8}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_CPT_CUDA_KERNELS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [ "${STAGE:-cifar}" = lm ]; then
    for seed in 0 1 2; do
        python bench/language_model.py --device cuda --model llama-70m --until_stalled 2 --epochs 40 --no_profile \
            --data_dir gpu_cifar --runs fp32 static-8/8-full cpt-4-8/8-full --seeds "$seed" \
            --output "$OUT/language_model_gpu.json" --work_dir "outputs/lm_$seed" > "$OUT/lm_$seed.log" 2>&1 &
    done
    wait
    tail -3 "$OUT"/lm_*.log
    exit 0
fi
for worker in $(seq 1 "$PROCESSES"); do
    python bench/horizon.py --device cuda --images gpu_cifar/cifar10_uint8.npz --epochs 4 16 64 160 \
        --seeds 0 1 2 3 --runs fp32 static-8/8 cpt-3-8/8-n32 ct-3-8/8-n8-delay \
        --output "$OUT/horizon_gpu.json" --work_dir "outputs/horizon_$worker" > "$OUT/horizon_$worker.log" 2>&1 &
done
wait
tail -3 "$OUT"/horizon_*.log
