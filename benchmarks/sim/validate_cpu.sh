#!/usr/bin/env bash
# The simulator against the real vLLM CPU engine on this machine:
#  1. measure steps of four workloads on the real engine (FCFS and Feather), logging each
#     step's batch composition and time (FEATHER_STEP_LOG);
#  2. fit a profile with `feather calibrate` (vLLM's CPU kernel: per-(layer, KV head) reuse);
#  3. run two *other* workloads on the real engine (`feather bench`) and in the simulator
#     with the fitted profile and the engine's limits; compare throughput (validation.md).
# Starting values of this CPU's profile: cpu-hardware.json (the fit rescales them).
# Everything goes into the run set's folder, benchmarks/sim/results/$SET (default: the
# commit).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=$(benchmarks/run_set.sh sim)
steps=$out/cpu-steps.csv
rm -f "$steps"
bench=(.venv/bin/feather bench --schedulers fcfs,feather-always --seed 1)
fit_workloads=(
    "--groups 4 --prompts-per-group 16 --prefix-len 4096 --output-len 32"
    "--groups 8 --prompts-per-group 8 --prefix-len 8192 --output-len 32"
    "--groups 1 --prompts-per-group 48 --prefix-len 2048 --output-len 32"
    "--workload no-sharing --groups 1 --prompts-per-group 48 --prefix-len 1024 --output-len 32"
)
for args in "${fit_workloads[@]}"; do
    # shellcheck disable=SC2086
    FEATHER_STEP_LOG=$PWD/$steps "${bench[@]}" $args > /dev/null
done
.venv/bin/feather calibrate "$steps" --hardware benchmarks/sim/cpu-hardware.json --model tiny-llama \
    --granularity layer-head --out $out/cpu-profile.json | tee $out/cpu-calibrate.txt

sim=(.venv/bin/feather sim --profile $out/cpu-profile.json --schedulers fcfs,feather-always
     --block-tokens 128 --kv-cache-gib 4 --max-num-seqs 256 --max-num-batched-tokens 4096
     --seed 1)
validate=(
    "--groups 2 --prompts-per-group 32 --prefix-len 6144 --output-len 48"
    "--groups 16 --prompts-per-group 4 --prefix-len 3072 --output-len 48"
)
i=0
for args in "${validate[@]}"; do
    i=$((i + 1))
    # shellcheck disable=SC2086
    "${bench[@]}" $args --json $out/validate-$i-real.json > /dev/null
    # shellcheck disable=SC2086
    "${sim[@]}" $args --json $out/validate-$i-sim.json > /dev/null
done
.venv/bin/python benchmarks/sim/compare.py $out/validate-*-real.json | tee $out/validation.md
