#!/usr/bin/env bash
# Two vLLM replicas (embedded model, Feather scheduler, 1 CPU each) on Ray Serve behind
# one endpoint, under each request router in turn: Ray's
# PowerOfTwoChoicesRequestRouter (Serve's default), Ray's PrefixCacheAffinityRouter and
# FeatherRequestRouter. The same multi-group workload goes through each (feather bench
# against the endpoint); prints vLLM's benchmark block per router and a table, and writes
# <router>.json, ray_serve.md and ray_serve.png into the run set's folder,
# benchmarks/replicas/results/$SET/ (default: the commit; RATE= empty: all at once).
# Needs scripts/setup.sh --vllm --ray.
# Each replica's KV cache (KV_GIB, default 1/16 GiB = 16K tokens) holds half the groups'
# prefixes: a router that keeps groups together avoids recomputing evicted prefixes.
#   N_GROUPS=8 PER_GROUP=8 PREFIX=2048 OUTPUT=32 RATE=4 KV_GIB=0.0625 \
#       benchmarks/replicas/ray_serve.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/replicas/serve_lib.sh
out=$(benchmarks/run_set.sh replicas)
port=${PORT:-8731}
url=http://127.0.0.1:$port
routers=${ROUTERS:-power-of-two prefix-affinity feather}
workload=(--groups "${N_GROUPS:-8}" --prompts-per-group "${PER_GROUP:-8}"
          --prefix-len "${PREFIX:-2048}" --suffix-len 32 --output-len "${OUTPUT:-32}"
          --seed 0)
rate=${RATE-4}
[ -n "$rate" ] && workload+=(--request-rate "$rate")
results=()
for router in $routers; do
    start_server "${TMPDIR:-/tmp}/feather-ray_serve-$router.log" --replicas 2 \
        --router "$router" --kv-cache-gib "${KV_GIB:-0.0625}" --max-model-len 4096 \
        --enforce-eager --host 127.0.0.1 --port "$port"
    .venv/bin/feather bench --base-url "$url" --label "ray-$router" "${workload[@]}" \
        --json "$out/$router.json"
    stop_server
    results+=("$out/$router.json")
done
.venv/bin/feather report "${results[@]}" --plot "$out/ray_serve.png" --markdown "$out/ray_serve.md"
