#!/usr/bin/env bash
# What ordering SGLang's running decode batch by prefix group changes on this CPU: the
# real SGLang 0.5.23 server with Feather (gate "always", so admission is the same) with
# order_running on and off, two rounds each, arrivals over time (SGLang appends each
# round's admissions to the running batch, interleaving groups; Feather puts it back in
# group order before every decode step). Same client for all: feather bench --api sglang.
set -euo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/sglang/server.sh
out=$(benchmarks/run_set.sh sglang)
port=30188
workload=(--groups 4 --prompts-per-group 8 --prefix-len 4096 --output-len 48
          --request-rate 2 --seed 0)
for run in ordered-1 unordered-1 ordered-2 unordered-2; do
    order=$([[ $run == ordered-* ]] && echo true || echo false)
    options="{\"gate\": \"always\", \"order_running\": $order, \"stats_file\": \"$PWD/$out/ordering-$run.stats.json\"}"
    start_sglang $port "$out/ordering-$run.log" --schedule-policy feather \
        --feather-options "$options"
    .venv/bin/feather bench --base-url "http://127.0.0.1:$port" --api sglang "${workload[@]}" \
        --label "$run" --json "$out/ordering-$run.json" | tee "$out/ordering-$run.txt"
    sleep 12  # the idle scheduler saves its stats file within 10 s
    kill "$server"; wait "$server" || true
done
.venv/bin/python benchmarks/sglang/tables.py ordering $out
