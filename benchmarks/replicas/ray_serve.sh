#!/usr/bin/env bash
# Two vLLM replicas (embedded model, Feather scheduler, 1 CPU and 1 GiB KV each) on Ray
# Serve behind one endpoint, under each request router in turn: Ray's
# PowerOfTwoChoicesRequestRouter (Serve's default), Ray's PrefixCacheAffinityRouter and
# FeatherRequestRouter. The same multi-group workload goes through each (feather bench
# against the endpoint); prints vLLM's benchmark block per router and a table, and writes
# ray_serve-<router>.json and ray_serve.md here. Needs scripts/setup.sh --vllm --ray.
#   N_GROUPS=8 PER_GROUP=8 PREFIX=2048 OUTPUT=32 RATE=4 benchmarks/replicas/ray_serve.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
out=benchmarks/replicas
port=${PORT:-8731}
url=http://127.0.0.1:$port
routers=${ROUTERS:-power-of-two prefix-affinity feather}
workload=(--groups "${N_GROUPS:-8}" --prompts-per-group "${PER_GROUP:-8}"
          --prefix-len "${PREFIX:-2048}" --suffix-len 32 --output-len "${OUTPUT:-32}"
          --request-rate "${RATE:-4}" --seed 0)
results=()
for router in $routers; do
    log=$out/ray_serve-$router.log
    .venv/bin/feather serve --replicas 2 --router "$router" --kv-cache-gib 1 \
        --enforce-eager --host 127.0.0.1 --port "$port" >"$log" 2>&1 &
    server=$!
    trap 'kill $server 2>/dev/null || true' EXIT
    for _ in $(seq 300); do
        curl -sf "$url/v1/models" >/dev/null && break
        kill -0 $server 2>/dev/null || { echo "server for $router died, see $log" >&2; exit 1; }
        sleep 2
    done
    .venv/bin/feather bench --base-url "$url" --label "ray-$router" "${workload[@]}" \
        --json "$out/ray_serve-$router.json"
    kill -TERM $server
    wait $server || true
    trap - EXIT
    results+=("$out/ray_serve-$router.json")
done
.venv/bin/feather report "${results[@]}" --plot "$out/ray_serve.png" --markdown "$out/ray_serve.md"
