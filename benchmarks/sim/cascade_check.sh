#!/usr/bin/env bash
# The simulator's cascade term against the CPU shared-prefix path on the real engine:
#  1. log the steps of two workloads on the real vLLM CPU engine (FEATHER_STEP_LOG), once
#     with vLLM's attention (fcfs, feather-model-noshared) and once with Feather's
#     shared-prefix attention (fcfs-shared, feather-model);
#  2. fit a profile to each: the plain model to the plain steps, the cascade model
#     (`feather calibrate --cascade`) to the shared-prefix steps;
#  3. cascade_check.py: how well the plain profile with the cascade term predicts the
#     shared-prefix steps, how well the cascade fit does, and what the simulator predicts
#     for the real engine's measured ratios (benchmarks/vllm's shared-4x16 rounds).
# Everything goes into the run set's folder, benchmarks/sim/results/$SET (default: the
# commit).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=$(benchmarks/run_set.sh sim)
workloads=(
    "--groups 4 --prompts-per-group 16 --prefix-len 8192 --output-len 64"
    "--groups 8 --prompts-per-group 8 --prefix-len 4096 --output-len 64"
)
for mode in off on; do
    steps=$out/cpu-shared-$mode-steps.csv
    rm -f "$steps"
    schedulers=fcfs,feather-model-noshared
    [ $mode = on ] && schedulers=fcfs-shared,feather-model
    for args in "${workloads[@]}"; do
        # shellcheck disable=SC2086
        FEATHER_STEP_LOG=$PWD/$steps .venv/bin/feather bench --schedulers $schedulers \
            --seed 1 $args > /dev/null
    done
done
calibrate=(.venv/bin/feather calibrate --hardware benchmarks/sim/cpu-hardware.json --model tiny-llama
           --granularity layer-head)
"${calibrate[@]}" $out/cpu-shared-off-steps.csv --out $out/cpu-shared-off-profile.json \
    | tee $out/cascade-check-calibrate.txt
"${calibrate[@]}" $out/cpu-shared-on-steps.csv --cascade --out $out/cpu-shared-on-profile.json \
    | tee -a $out/cascade-check-calibrate.txt
.venv/bin/python benchmarks/sim/cascade_check.py --set "${out#benchmarks/sim/results/}" | tee $out/cascade-check.md
