#!/usr/bin/env bash
# Feather vs SGLang's own policies on the real SGLang 0.5.23 server (CPU, embedded 2-layer
# model, random weights, torch-native attention), one server per policy, measured by the
# same client (`feather bench --api sglang`). The launcher puts the import-only torchvision
# stand-in that SGLang needs on this CPU machine on the path itself (never called).
set -euo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/sglang/server.sh
out=$(benchmarks/run_set.sh sglang)
port=30187
workload=(--groups 4 --prompts-per-group 16 --prefix-len 4096 --output-len 32 --seed 0)
# POLICIES replaces the list; routing-key is given each request's prefix group as its key
# (--routing-keys, what SGLang's own bench sends with --gsp-send-routing-key)
for policy in ${POLICIES:-fcfs lpm dfs-weight hrrn shortest-prefill-first routing-key feather}; do
    keys=(); [ "$policy" = routing-key ] && keys=(--routing-keys)
    start_sglang $port "$out/server-$policy.log" --schedule-policy $policy
    .venv/bin/feather bench --base-url "http://127.0.0.1:$port" --api sglang "${workload[@]}" \
        "${keys[@]}" --label "sglang-$policy" --json "$out/$policy.json" | tee "$out/$policy.txt"
    kill "$server"; wait "$server" || true
done
.venv/bin/python benchmarks/sglang/tables.py policies $out
