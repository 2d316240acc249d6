#!/usr/bin/env bash
# Urgent preemption on the real vLLM 0.32.0 CPU engine (embedded model): two cells, each
# with urgent preemption on (max_urgent_preemptions 1, the default) and off (0), each
# invocation running vLLM's own scheduler under --scheduling-policy priority beside
# Feather under the same policy:
#   seats:   4 groups x 16 requests of 2K-token prefixes, 256 output tokens, arriving at
#            64 req/s into 8 seats (max_num_seqs=8), 10% in class 0: urgent arrivals find
#            the seats held by class-1 decodes (however fast the engine: at 8 req/s and 64
#            output tokens a quiet engine kept up and nothing waited for a seat);
#   classes: priority.sh's two-class cell (8 x 16 of 8K, all at once, 10% in class 0),
#            where every class-0 request is admitted first and nothing is preempted for it.
# ROUNDS rounds (default 3), each running both schedulers. Results go into
# benchmarks/vllm/results/$SET/ (default: urgent-<commit>); urgent_table.py makes the table
# of per-round ratios from the seats-*.json and classes-*.json files.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=$(benchmarks/run_set.sh vllm urgent-)
schedulers=$(for _ in $(seq "${ROUNDS:-3}"); do printf 'priority,feather-model,'; done)
schedulers=${schedulers%,}
seats=(.venv/bin/feather bench --groups 4 --prompts-per-group 16 --prefix-len 2048
       --output-len 256 --high-priority-share 0.1 --request-rate 64 --seed 0
       --engine-arg max_num_seqs=8 --schedulers "$schedulers")
classes=(.venv/bin/feather bench --groups 8 --prompts-per-group 16 --prefix-len 8192
         --output-len 64 --high-priority-share 0.1 --seed 0 --schedulers "$schedulers")
for urgent in 1 0; do
    options="{\"max_urgent_preemptions\": $urgent}"
    "${seats[@]}" --feather-options "$options" --json "$out/seats-urgent$urgent.json" \
        | tee "$out/seats-urgent$urgent.txt"
    "${classes[@]}" --feather-options "$options" --json "$out/classes-urgent$urgent.json" \
        | tee "$out/classes-urgent$urgent.txt"
done
