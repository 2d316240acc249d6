#!/usr/bin/env bash
# The gate on the real vLLM 0.32.0 CPU engine, with batch ordering off (the engine's own
# batch order) and the fairness bound off (the paper's setting): 8 groups x 16 requests of
# 8K-token prefixes; always-add vs the model gate (cold: the JSON options are shared by
# every run, so no prior) vs chunk-loss, two rounds each.
# (a) offline with at most 32 running, so admission decides more than once;
# (b) Poisson arrivals at 8 req/s (twice what this engine serves), no seat limit, so
#     always-add's batch holds most groups at once, interleaved;
# (c) churn: 16 groups x 8, output lengths 6-121 (jitter 0.9), 8 req/s, at most 32
#     running, so finished requests' slots are refilled by other groups while the rest
#     run: the room any gate has here is what batch ordering recovers (the third column);
# (d) the same churn with 16K-token prefixes, whose slices no longer share this CPU's L3.
# Results go into benchmarks/vllm/results/$SET/ (default: the commit).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=$(benchmarks/run_set.sh vllm)
bench=(.venv/bin/feather bench --groups 8 --prompts-per-group 16 --prefix-len 8192
       --output-len 64 --seed 0)
round=feather-always-noorder-unbounded,feather-model-noorder-unbounded,feather-chunk-loss-noorder-unbounded
"${bench[@]}" --engine-arg max_num_seqs=32 --schedulers $round,$round \
    --json $out/gate-32-seats.json | tee $out/gate-32-seats.txt
.venv/bin/python benchmarks/vllm/medians.py $out/gate-32-seats.json | tee $out/gate-32-seats.md
"${bench[@]}" --request-rate 8 --schedulers $round,$round \
    --json $out/gate-rate-8.json | tee $out/gate-rate-8.txt
.venv/bin/python benchmarks/vllm/medians.py $out/gate-rate-8.json | tee $out/gate-rate-8.md
churn=feather-always-noorder-unbounded,feather-model-noorder-unbounded,feather-always-unbounded
.venv/bin/feather bench --groups 16 --prompts-per-group 8 --prefix-len 8192 --output-len 64 \
    --jitter 0.9 --request-rate 8 --seed 0 --engine-arg max_num_seqs=32 \
    --schedulers $churn,$churn --json $out/gate-churn.json | tee $out/gate-churn.txt
.venv/bin/python benchmarks/vllm/medians.py $out/gate-churn.json | tee $out/gate-churn.md
.venv/bin/feather bench --groups 16 --prompts-per-group 8 --prefix-len 16384 --output-len 64 \
    --jitter 0.9 --request-rate 8 --seed 0 --engine-arg max_num_seqs=32 \
    --schedulers $churn,$churn --json $out/gate-churn-16k.json | tee $out/gate-churn-16k.txt
.venv/bin/python benchmarks/vllm/medians.py $out/gate-churn-16k.json | tee $out/gate-churn-16k.md
