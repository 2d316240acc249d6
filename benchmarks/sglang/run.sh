#!/usr/bin/env bash
# Feather vs SGLang's own policies on the real SGLang 0.5.23 server (CPU, embedded 2-layer
# model, random weights, torch-native attention), one server per policy, measured by the
# same client (`feather bench --api sglang`). The launcher puts the import-only torchvision
# stand-in that SGLang needs on this CPU machine on the path itself (never called).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=benchmarks/sglang
port=30187
workload=(--groups 4 --prompts-per-group 16 --prefix-len 4096 --output-len 32 --seed 0)
for policy in fcfs lpm dfs-weight feather; do
    .venv/bin/python -m feather_sched.integrations.sglang_launch \
        --model-path src/feather_sched/models/tiny-llama --device cpu --load-format dummy \
        --skip-tokenizer-init --attention-backend torch_native --host 127.0.0.1 \
        --port $port --schedule-policy $policy > "$out/server-$policy.log" 2>&1 &
    server=$!
    for _ in $(seq 1 60); do
        curl -sf -m 2 "http://127.0.0.1:$port/v1/models" > /dev/null && break
        sleep 3
    done
    .venv/bin/feather bench --base-url "http://127.0.0.1:$port" --api sglang "${workload[@]}" \
        --label "sglang-$policy" --json "$out/$policy.json" | tee "$out/$policy.txt"
    kill "$server"; wait "$server" || true
done
.venv/bin/python - <<'PY'
import json
runs = {p: json.load(open(f"benchmarks/sglang/{p}.json"))["runs"][f"sglang-{p}"]
        for p in ("fcfs", "lpm", "dfs-weight", "feather")}
base = runs["fcfs"]["output_throughput"]
print("| policy | output tok/s | vs fcfs | mean TTFT ms | mean TPOT ms |")
print("|---|---|---|---|---|")
for name, s in runs.items():
    print(f"| {name} | {s['output_throughput']:.1f} | {s['output_throughput'] / base:.2f}x | "
          f"{s['mean_ttft_ms']:.0f} | {s['mean_tpot_ms']:.1f} |")
PY
