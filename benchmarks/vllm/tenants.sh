#!/usr/bin/env bash
# Tenants on the real vLLM 0.32.0 CPU engine (embedded model): the simulator's tight-pool
# cell (benchmarks/sim/tenants.py) scaled to this machine. Four tenants, all at once (over
# the engine's capacity, as the simulator's 40 req/s): t0 floods with 64 requests behind one
# 4K-token prefix, t1 and t3 send 16 requests each drawn from 4 4K-token prefixes of their
# own, t2 16 short prompts with 512-token outputs; a KV cache of 0.1 GiB (26K tokens) holds
# about 6 of the 9 prefixes, so an order that interleaves tenants also evicts prefixes and
# runs fewer requests at once (DLPM's setting). Three rounds, interleaved, of
#   vtc                 VTC (fairness: vtc) with vLLM's own attention,
#   feather-model-fair  Feather with fair share (fairness: tenants) and its defaults,
#   vtc-shared          VTC with Feather's shared-prefix attention (the kernel's share);
# and the same in a roomy cell (4 GiB of KV: every prefix stays cached under any order).
# tenants_table.py gives the per-round ratios to vtc: the largest service gap between
# tenants (target <= 1.5x), output tok/s (>= 1.5x) and each tenant's mean TTFT (<= 1.25x).
# The cell `interactive`: the simulator's interactive cell sized down to a few minutes a
# round: tenants docs0 and docs1 ask questions (16-64 tokens, 64-token answers) about their
# own 6 private 8K-token documents each at 1.5 req/s each, tenant chat sends 256-token
# unshared prompts with 512-token outputs at 0.4 req/s, for 30 s, replayed from a trace
# (workloads.synthetic.document_tenants), in 0.2 GiB of KV (about 6 of the 12
# documents); vtc and feather-model-fair, three rounds (targets: throughput >= 1.3x, the
# service gap <= 1x, each tenant's mean TTFT <= 1.25x).
# The cell `many`: the simulator's 100-tenant cell sized down the same way: 4 document
# tenants (3 private 8K-token documents each, 0.75 req/s each, 64-token answers) beside 32
# light users, each from a moment of its own sending 1 to 3 unshared 256-token prompts
# (64-token outputs) about 5 s apart, for 30 s, in 0.2 GiB of KV; vtc and
# feather-model-fair, three rounds (targets: throughput >= 1.2x, the light users' mean TTFT
# and each document tenant's <= 1.25x).
# tenants.sh [CELL...] runs the cells named (default: tight roomy interactive many).
# Results go into benchmarks/vllm/results/$SET/ (default: tenants-<commit>).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=$(benchmarks/run_set.sh vllm tenants-)
bench=(.venv/bin/feather bench --workload multi-tenant --groups 4 --prompts-per-group 16
       --prefix-len 4096 --suffix-len 32 --output-len 64 --prefixes-per-tenant 4 --seed 0
       --schedulers vtc,feather-model-fair,vtc-shared,vtc,feather-model-fair,vtc-shared,vtc,feather-model-fair,vtc-shared)
documents() {  # documents CELL OPTIONS: document_tenants(OPTIONS) replayed as a trace
    local trace
    trace=$(mktemp --suffix .jsonl)  # 5 MB, the same from the seed each time: not kept
    .venv/bin/python -c "
from feather_sched.workloads.synthetic import document_tenants
from feather_sched.workloads.traces import save_jsonl
save_jsonl(document_tenants($2, seed=0), '$trace')"
    .venv/bin/feather bench --trace "$trace" --kv-cache-gib 0.2 \
        --schedulers vtc,feather-model-fair,vtc,feather-model-fair,vtc,feather-model-fair \
        --json "$out/$1.json" | tee "$out/$1.txt"
    rm -f "$trace"
}
cells=("$@")
[ ${#cells[@]} -gt 0 ] || cells=(tight roomy interactive many)
for cell in "${cells[@]}"; do
    if [ "$cell" = interactive ]; then
        documents interactive "documents_per_tenant=6, doc_len=8192, doc_output_len=64,
            doc_rate=1.5, chat_prompt_len=256, chat_output_len=512, chat_rate=0.4,
            duration_s=30.0"
    elif [ "$cell" = many ]; then
        documents many "doc_tenants=4, documents_per_tenant=3, doc_len=8192,
            doc_output_len=64, doc_rate=0.75, chat_prompt_len=256, chat_output_len=64,
            chat_rate=0.0, duration_s=30.0, light_users=32, light_requests=3,
            light_prompt_len=256, light_output_len=64"
    else
        kv=$([ "$cell" = tight ] && echo 0.1 || echo 4)
        "${bench[@]}" --kv-cache-gib $kv --json "$out/$cell.json" | tee "$out/$cell.txt"
    fi
    .venv/bin/python benchmarks/vllm/tenants_table.py "$out/$cell.json" | tee "$out/$cell.md"
done
