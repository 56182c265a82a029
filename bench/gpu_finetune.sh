#!/usr/bin/env bash
# Issue 75 on one H100/H200 (`run` in the tool library): the MiniLM fine-tune, 16 seeds per setting, several
# processes sharing the GPU (each claims a (run, seed) before training it; the JSON resumes). Locally first:
#     python bench/gpu_bundle.py --bundle finetune          # gpu_data/: the float16 MiniLM, MNLI, RTE (47 MiB)
# then `run` with carry ["gpu_data"] and the command `bash bench/gpu_finetune.sh`; copy $OUT/*.json to bench/results/
# and run `python bench/report.py`. STAGE=rte runs the second task for the settings named in RTE_RUNS.
set -uo pipefail
OUT=${OUT:-outputs/gpu}
PROCESSES=${PROCESSES:-8}
SEEDS=${SEEDS:-$(seq 100 115)}
STAGE=${STAGE:-mnli}
RTE_RUNS=${RTE_RUNS:-fp32 static-8/8-error-token cpt-4-8/8-error-token}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_CPT_CUDA_KERNELS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [ "$STAGE" = mnli ]; then
    ARGS=(--runs gpu_scan --output "$OUT/finetune_gpu.json")
else
    ARGS=(--task rte --runs $RTE_RUNS --output "$OUT/finetune_gpu_rte.json")
fi
for worker in $(seq 1 "$PROCESSES"); do
    python bench/pretrained.py --part finetune --device cuda --no_profile --model_path gpu_data/minilm \
        --data_dir gpu_data --seeds $SEEDS --work_dir "outputs/finetune_$worker" "${ARGS[@]}" \
        > "$OUT/finetune_${STAGE}_$worker.log" 2>&1 &
done
wait
tail -3 "$OUT"/finetune_*.log
