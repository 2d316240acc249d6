#!/usr/bin/env bash
# The vLLM benchmarks recorded in this folder (real vLLM 0.32.0 CPU engine, embedded
# 2-layer model, random weights). Each line is one `feather bench` invocation; every
# scheduler in it runs on a fresh engine, one after the other, in the same process.
set -euo pipefail
cd "$(dirname "$0")/../.."
bench=(.venv/bin/feather bench --output-len 64 --seed 0)
out=benchmarks/vllm

# (i) eight groups of 8K-token prefixes: mixed per-(layer, KV head) slices of 16 MiB.
"${bench[@]}" --groups 8 --prompts-per-group 16 --prefix-len 8192 \
    --schedulers fcfs,feather-always,feather-chunk-loss,feather-bandit \
    --json $out/multi-group.json --plot $out/multi-group.png | tee $out/multi-group.txt
# (ii) one shared prefix.
"${bench[@]}" --groups 1 --prompts-per-group 64 --prefix-len 8192 \
    --schedulers fcfs,feather-chunk-loss,feather-bandit,fcfs \
    --json $out/single-prefix.json | tee $out/single-prefix.txt
# (iii) no sharing.
"${bench[@]}" --workload no-sharing --groups 1 --prompts-per-group 64 --prefix-len 2016 \
    --schedulers fcfs,feather-chunk-loss,feather-bandit,fcfs \
    --json $out/no-sharing.json | tee $out/no-sharing.txt
# Scheduler CPU time next to engine step time: 1024 requests of 10K tokens waiting.
"${bench[@]}" --groups 8 --prompts-per-group 128 --prefix-len 10208 --output-len 4 \
    --schedulers fcfs,feather-chunk-loss --kv-cache-gib 2 \
    --json $out/queue-1024x10k.json | tee $out/queue-1024x10k.txt
