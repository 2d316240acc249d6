#!/usr/bin/env bash
# Mooncake on the real CPU engine at a moderate load (cpu.sh's Mooncake line at
# --trace-speed 2.6 instead of 3.7: on a day when the machine is slow, FCFS's TPOT is
# then what 3.7 gives on a normal day), then the same taken apart: FCFS, Feather without
# its batch ordering (-noorder), without its shared-prefix attention (-noshared), and
# whole, 3 rounds each. About 45 minutes; run it alone on the machine. The run set goes
# into benchmarks/traces/results/$SET/ (default: cpu-moderate-<commit>): mooncake.* and
# mooncake-parts.*.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=$(benchmarks/run_set.sh traces cpu-moderate-)
trace=(--trace ../shared/traces/mooncake-synthetic.jsonl --start 2993 --max-requests 1000
       --token-scale 0.0625 --engine-arg block_size=32 --trace-speed 2.6)
two=fcfs,feather-model
.venv/bin/feather bench --seed 0 --schedulers $two,$two,$two "${trace[@]}" \
    --json $out/mooncake.json | tee $out/mooncake.txt
four=fcfs,feather-model-noorder,feather-model-noshared,feather-model
.venv/bin/feather bench --seed 0 --schedulers $four,$four,$four "${trace[@]}" \
    --json $out/mooncake-parts.json | tee $out/mooncake-parts.txt
for metric in mean_tpot_ms mean_ttft_ms p99_ttft_ms mean_e2el_ms output_throughput; do
    .venv/bin/python benchmarks/vllm/medians.py $out/mooncake-parts.json --metric $metric
done | tee $out/mooncake-parts.md
.venv/bin/python benchmarks/traces/tables.py
