#!/usr/bin/env bash
# The vLLM benchmarks recorded in this folder (real vLLM 0.32.0 CPU engine, embedded
# 2-layer model, random weights). Each line is one `feather bench` invocation; every
# scheduler in it runs on a fresh engine, one after the other, in the same process, and a
# name given again runs again (labelled name#2, ...): medians.py takes the median and
# spread of the repeated runs and of the per-round ratios to FCFS. Results go into
# benchmarks/vllm/results/$SET/ (default: the commit).
set -euo pipefail
cd "$(dirname "$0")/../.."
bench=(.venv/bin/feather bench --output-len 64 --seed 0)
out=$(benchmarks/run_set.sh vllm)
medians=(.venv/bin/python benchmarks/vllm/medians.py)

# (i) eight groups of 8K-token prefixes, three rounds: FCFS, ordering alone (always),
# the default (bandit, overtaking bound on) and the bandit without the bound.
round=fcfs,feather-always,feather-bandit,feather-bandit-unbounded
"${bench[@]}" --groups 8 --prompts-per-group 16 --prefix-len 8192 \
    --schedulers $round,$round,$round \
    --json $out/multi-group.json --plot $out/multi-group.png | tee $out/multi-group.txt
"${medians[@]}" $out/multi-group.json | tee $out/multi-group.md
# (ii) one shared prefix, (iii) no sharing: two rounds of FCFS and the default.
"${bench[@]}" --groups 1 --prompts-per-group 64 --prefix-len 8192 \
    --schedulers fcfs,feather-bandit,fcfs,feather-bandit \
    --json $out/single-prefix.json | tee $out/single-prefix.txt
"${medians[@]}" $out/single-prefix.json | tee $out/single-prefix.md
"${bench[@]}" --workload no-sharing --groups 1 --prompts-per-group 64 --prefix-len 2016 \
    --schedulers fcfs,feather-bandit,fcfs,feather-bandit \
    --json $out/no-sharing.json | tee $out/no-sharing.txt
"${medians[@]}" $out/no-sharing.json | tee $out/no-sharing.md
# Scheduler CPU time next to engine step time: 1024 requests of 10K tokens waiting.
"${bench[@]}" --groups 8 --prompts-per-group 128 --prefix-len 10208 --output-len 4 \
    --schedulers fcfs,feather-chunk-loss --kv-cache-gib 2 \
    --json $out/queue-1024x10k.json | tee $out/queue-1024x10k.txt
