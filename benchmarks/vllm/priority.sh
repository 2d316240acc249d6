#!/usr/bin/env bash
# Two priority classes on the real vLLM 0.32.0 CPU engine (embedded model): 8 groups x 16
# requests of 8K-token prefixes, 64 output tokens, all at once; 10% of the requests (a
# seeded random choice across the groups) in class 0, the rest in class 1.
#   (a) vLLM's own scheduler under --scheduling-policy priority against Feather under the
#       same policy (shared-prefix attention at each scheduler's default), four rounds;
#   (b) the same workload in one class: FCFS against Feather, four rounds (the grouping
#       gain without classes).
# priority_table.py gives the per-round ratios: class-0 TTFT (target <= 1.1x vLLM's),
# class-1 throughput (>= 1.0x) and the share of the one-class gain kept (>= 90%).
# Results go into benchmarks/vllm/results/$SET/ (default: the commit).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=$(benchmarks/run_set.sh vllm)
bench=(.venv/bin/feather bench --groups 8 --prompts-per-group 16 --prefix-len 8192
       --output-len 64 --seed 0)
"${bench[@]}" --high-priority-share 0.1 \
    --schedulers priority,feather-model,priority,feather-model,priority,feather-model,priority,feather-model \
    --json $out/priority-classes.json | tee $out/priority-classes.txt
"${bench[@]}" --schedulers fcfs,feather-model,fcfs,feather-model,fcfs,feather-model,fcfs,feather-model \
    --json $out/priority-one-class.json | tee $out/priority-one-class.txt
.venv/bin/python benchmarks/vllm/priority_table.py $out/priority-classes.json \
    $out/priority-one-class.json | tee $out/priority.md
