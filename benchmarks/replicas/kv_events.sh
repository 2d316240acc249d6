#!/usr/bin/env bash
# The precise index on real engines: two vLLM replicas (embedded model, Feather scheduler,
# 1 CPU each, KV events on) on Ray Serve behind one endpoint, a workload whose prefixes
# exceed what the replicas keep, routed in turn by FeatherRequestRouter on its precise
# index (the replicas' vLLM KV events), on its approximate index (routing history) and by
# Ray's PrefixCacheAffinityRouter, ROUNDS times over. Each run: feather bench against the
# endpoint (prefix-cache hits: the share of prompt tokens vLLM reports cached for each
# request, usage.prompt_tokens_details.cached_tokens; TTFT mean and p90); writes
# <router>-round<k>.json (and the router's view, <router>-round<k>-router.json) into the
# run set's folder, benchmarks/replicas/results/$SET/ (default: the commit), then
# kv_events.md: per router the median over rounds (kv_events.py). INGRESSES=K: K ingress
# replicas share the requests, each routing with its own router (name the set for it,
# e.g. SET=<commit>/two-ingresses). Needs scripts/setup.sh --vllm --ray.
# Defaults: 24 groups x 6 requests of 2K-token prefixes (48K prefix tokens) at 2 req/s
# against 16K-token KV caches (KV_GIB=0.0625): a replica keeps about a sixth of them.
#   ROUNDS=3 N_GROUPS=24 PER_GROUP=6 PREFIX=2048 OUTPUT=16 RATE=2 KV_GIB=0.0625 \
#       benchmarks/replicas/kv_events.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/replicas/serve_lib.sh
out=$(benchmarks/run_set.sh replicas)
ingresses=${INGRESSES:-1}
port=${PORT:-8731}
url=http://127.0.0.1:$port
routers=${ROUTERS:-feather:precise feather:approximate prefix-affinity}
workload=(--groups "${N_GROUPS:-24}" --prompts-per-group "${PER_GROUP:-6}"
          --prefix-len "${PREFIX:-2048}" --suffix-len 32 --output-len "${OUTPUT:-16}"
          --request-rate "${RATE:-2}" --metric-percentiles 90,99)
for round in $(seq "${ROUNDS:-3}"); do
    for entry in $routers; do
        router=${entry%%:*}
        options='{}'
        [ "$entry" != "$router" ] && options="{\"index\": \"${entry#*:}\"}"
        label=${entry/:/-}
        start_server "${TMPDIR:-/tmp}/feather-kv_events-$label.log" --replicas 2 \
            --ingresses "$ingresses" --router "$router" --router-options "$options" \
            --kv-cache-gib "${KV_GIB:-0.0625}" --max-model-len 4096 --enforce-eager \
            --host 127.0.0.1 --port "$port"
        .venv/bin/feather bench --base-url "$url" --label "$label" --seed "$round" \
            "${workload[@]}" --json "$out/$label-round$round.json"
        curl -s "$url/feather/router" > "$out/$label-round$round-router.json" || true
        stop_server
    done
done
.venv/bin/python benchmarks/replicas/kv_events.py "${out#benchmarks/replicas/results/}"
