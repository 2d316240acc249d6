#!/usr/bin/env bash
# Public traces and real prompt text on the real vLLM 0.32.0 CPU engine (the embedded
# 2-layer model, random weights, bf16, vLLM's CPU defaults): vLLM's own scheduler (fcfs)
# and Feather with its defaults (feather-model), alternated in 3 rounds in one invocation
# per workload, every run a fresh engine; tables.py gives medians and per-round ratios.
#   mooncake    the Mooncake synthetic trace's last 1,000 requests (where its sharing is:
#               69% of prompt tokens, 338 prefix groups), hash blocks of 512 tokens scaled
#               to 32 (--token-scale 0.0625, with vLLM blocks of 32 tokens: the engine's
#               cache sees exactly the trace's sharing), sped up 3.7x
#   bfcl-tools  BFCL's 1,053 tool-calling prompts, tool documentation first, Poisson
#   sharegpt    500 ShareGPT conversations (vLLM's sampling), Poisson
# Loads: 0.8x FCFS's request throughput with every request at once, measured once with
# the same flags and --schedulers fcfs (mooncake --trace-speed 1e9: 19.18 req/s; bfcl-tools:
# 20.75; sharegpt, 200 requests: 10.92), so about 1 minute a run.
# The run set goes into benchmarks/traces/results/$SET/ (WORKLOAD.json and .txt each),
# by default cpu-<commit>; name a set on another machine by it and the commit (e.g.
# SET=amx-$(git rev-parse --short HEAD)): only the three workloads then run, with that
# machine's loads in MOONCAKE_SPEED, BFCL_RATE and SHAREGPT_RATE.
# The KV cache (4 GiB: about 1M tokens of the embedded model) holds 39x the Mooncake
# prompts an H100 holds for Llama-3-8B, so nothing waits for KV. MOONCAKE_KV_GIB and
# TEXT_KV_GIB size it to the simulated H100's room instead (its 427K tokens: 0.102 GiB at
# Mooncake's token scale, 1.63 GiB for the real text), for a set at the simulator's
# saturated load (1.5x FCFS's capacity measured with the same pool).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=$(benchmarks/run_set.sh traces cpu-)
two=fcfs,feather-model
bench=(.venv/bin/feather bench --seed 0 --schedulers $two,$two,$two)
run() {
    local name=$1
    shift
    "${bench[@]}" "$@" --json $out/$name.json | tee $out/$name.txt
}
run mooncake --trace ../shared/traces/mooncake-synthetic.jsonl --start 2993 \
    --max-requests 1000 --token-scale 0.0625 --engine-arg block_size=32 \
    --trace-speed "${MOONCAKE_SPEED:-3.7}" --kv-cache-gib "${MOONCAKE_KV_GIB:-4}"
run bfcl-tools --dataset-name bfcl-tools --request-rate "${BFCL_RATE:-16.6}" \
    --kv-cache-gib "${TEXT_KV_GIB:-4}"
run sharegpt --dataset-name sharegpt --max-requests 500 \
    --request-rate "${SHAREGPT_RATE:-8.7}" --kv-cache-gib "${TEXT_KV_GIB:-4}"
.venv/bin/python benchmarks/traces/tables.py
[[ -z ${SET:-} ]] || exit 0
# ShareGPT, where nothing is shared, taken apart: Feather without its batch ordering
# (-noorder) and without its shared-prefix attention (-noshared). results/cpu-745caf4/
# order-sharegpt.* has the diagnosis made before the ordering stopped sorting batches that
# share nothing.
four=fcfs,feather-model-noorder,feather-model-noshared,feather-model
.venv/bin/feather bench --seed 0 --schedulers $four,$four,$four --dataset-name sharegpt \
    --max-requests 500 --request-rate 8.7 --json $out/sharegpt-parts.json \
    | tee $out/sharegpt-parts.txt
for metric in mean_tpot_ms mean_e2el_ms output_throughput; do
    .venv/bin/python benchmarks/vllm/medians.py $out/sharegpt-parts.json --metric $metric
done | tee $out/sharegpt-parts.md
