#!/usr/bin/env bash
# Minority prefix groups on the real vLLM CPU engine (embedded model): a large group and
# small ones arriving together faster than the engine serves them. Each group's TTFT is
# in the printed blocks and in --json (ttft_by_group); fairness.md compares each group
# with the same group under FCFS (target: at most 1.25x, mean and p99).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=benchmarks/vllm
bench=(.venv/bin/feather bench --workload minority --seed 0 --save-detailed
       --schedulers fcfs,feather-chunk-loss,feather-bandit,feather-bandit-unbounded)
# (a) the reported case: 400 + 20 requests, 4.6K-token prompts (4K shared), 64 out, ~21/s.
"${bench[@]}" --groups 2 --prompts-per-group 400 --minority-size 20 --prefix-len 4096 \
    --suffix-len 512 --output-len 64 --request-rate 21 \
    --json $out/fairness-a.json | tee $out/fairness-a.txt
# (b) three small groups beside a large one, short (1K) prefixes.
"${bench[@]}" --groups 4 --prompts-per-group 300 --minority-size 10 --prefix-len 1024 \
    --suffix-len 64 --output-len 64 --request-rate 30 \
    --json $out/fairness-b.json | tee $out/fairness-b.txt
.venv/bin/python $out/fairness_table.py $out/fairness-a.json $out/fairness-b.json \
    | tee $out/fairness.md
