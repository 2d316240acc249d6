#!/usr/bin/env bash
# No loss under KV pressure (issue 58) on the real vLLM 0.32.0 CPU engine (embedded 2-layer
# Llama, random weights, bf16: 2 layers x 8 KV heads x 64 x K+V x 2 B = 4 KiB of KV a
# token, so 0.03 GiB holds 7.9K tokens): vLLM's own scheduler (fcfs) and Feather with its
# defaults (feather-model), alternated ROUNDS times (default 3) in one invocation per
# cell, every run a fresh engine. The simulator's thrash (one request preempted 61 times,
# mean TTFT 10x FCFS's) came from multi-turn conversations whose turns extend each other
# in a pool that holds only a few of them. Two cells:
#   chat      16 conversations x 6 turns (`--workload chat`): a 1,024-token system prompt
#             shared by all, 256-token user turns, 64-token answers (each answer's 64
#             tokens become the next turn's assistant turn), conversations starting as a
#             Poisson process at 4/s, turn t one second after turn t-1 was sent; vLLM
#             blocks of 128 tokens; 0.03 GiB of KV (7.9K tokens, 61 blocks: the system
#             prompt and about 3 conversations' last turns, 2,880 tokens each). The engine
#             is loaded, not swamped (FCFS finishes the 96 requests ~20 s after the
#             last arrival), and FCFS preempts a few requests.
#   mooncake  the Mooncake synthetic trace (../shared/traces/mooncake-synthetic.jsonl),
#             300 requests from where cpu.sh starts (2,993: where its sharing is), hash
#             blocks of 512 tokens scaled to 32 (--token-scale 0.0625, vLLM blocks of 32:
#             the engine's cache sees exactly the trace's sharing), sped up 3.7x (20 s of
#             arrivals, over this CPU's capacity), 0.06 GiB of KV (15.7K tokens; the
#             slice's longest prompt is 12K).
#   conversations  the Mooncake *conversation* trace (benchmarks/traces/mooncake-conversation.jsonl:
#             multi-turn chats, each turn's prompt the previous one's plus its answer and a
#             new question), its first 300 requests, 512-token hash blocks scaled to 32 as
#             above, every output 64 tokens (its own average 343 would take the CPU
#             minutes), sped up 4.4x (20 s of arrivals, over this CPU's capacity), 0.03 GiB
#             of KV (7.9K tokens: a few conversations' turns).
# kv_pressure_table.py gives per scheduler the medians (ranges) of mean and p99 TTFT,
# output tok/s, preemptions (total, most on one request) and the ratios to fcfs. About 4
# minutes a round per cell on the 2-core AMD EPYC (most of it two engine starts).
# kv_pressure.sh [CELL...] runs the cells named (default: chat conversations mooncake); VENV names the
# virtual environment (default .venv). Results go into benchmarks/vllm/results/$SET/
# (default: kv-pressure-<commit>): CELL.json, CELL.txt, and kv-pressure.md for the cells.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=$(benchmarks/run_set.sh vllm kv-pressure-)
bin=${VENV:-.venv}/bin
schedulers=fcfs,feather-model
for _ in $(seq 2 "${ROUNDS:-3}"); do schedulers+=,fcfs,feather-model; done
bench=("$bin/feather" bench --seed 0 --schedulers "$schedulers")
chat() {
    "${bench[@]}" --workload chat --groups 16 --prompts-per-group 6 --prefix-len 1024 \
        --suffix-len 256 --output-len 64 --request-rate 4 --kv-cache-gib 0.03 "$@"
}
mooncake() {
    "${bench[@]}" --trace ../shared/traces/mooncake-synthetic.jsonl --start 2993 \
        --max-requests 300 --token-scale 0.0625 --engine-arg block_size=32 \
        --trace-speed 3.7 --kv-cache-gib 0.06 "$@"
}
conversations() {
    "${bench[@]}" --trace benchmarks/traces/mooncake-conversation.jsonl --max-requests 300 \
        --token-scale 0.0625 --engine-arg block_size=32 --trace-speed 4.4 \
        --dataset-output-len 64 --kv-cache-gib 0.03 "$@"
}
cells=("$@")
[ ${#cells[@]} -gt 0 ] || cells=(chat conversations mooncake)
results=()
for cell in "${cells[@]}"; do
    case $cell in chat | conversations | mooncake) ;;
        *) echo "unknown cell $cell (chat, conversations, mooncake)" >&2; exit 2 ;; esac
    "$cell" --json "$out/$cell.json" | tee "$out/$cell.txt"
    results+=("$out/$cell.json")
done
"$bin/python" benchmarks/vllm/kv_pressure_table.py "${results[@]}" | tee "$out/kv-pressure.md"
