#!/usr/bin/env bash
# Minority prefix groups on the real vLLM CPU engine (embedded model): a large group and
# small ones arriving together faster than the engine serves them. Each group's TTFT is
# in the printed blocks and in --json (ttft_by_group); fairness.md compares each group
# with the same group under FCFS (target: at most 1.25x, mean and p99). Results go into
# benchmarks/vllm/results/$SET/ (default: the commit).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=$(benchmarks/run_set.sh vllm)
bench=(.venv/bin/feather bench --workload minority --seed 0 --save-detailed
       --schedulers fcfs,feather-chunk-loss,feather-bandit,feather-bandit-unbounded)
# (a) the reported case: 400 + 20 requests, 4.6K-token prompts (4K shared), 64 out, ~21/s.
"${bench[@]}" --groups 2 --prompts-per-group 400 --minority-size 20 --prefix-len 4096 \
    --suffix-len 512 --output-len 64 --request-rate 21 \
    --json $out/fairness-400+20.json | tee $out/fairness-400+20.txt
# (b) three small groups beside a large one, short (1K) prefixes.
"${bench[@]}" --groups 4 --prompts-per-group 300 --minority-size 10 --prefix-len 1024 \
    --suffix-len 64 --output-len 64 --request-rate 30 \
    --json $out/fairness-300+3x10.json | tee $out/fairness-300+3x10.txt
.venv/bin/python benchmarks/vllm/fairness_table.py $out/fairness-400+20.json \
    $out/fairness-300+3x10.json | tee $out/fairness.md
