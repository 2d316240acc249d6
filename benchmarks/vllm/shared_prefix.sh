#!/usr/bin/env bash
# Shared-prefix attention on the real vLLM 0.32.0 CPU engine (embedded 2-layer model, random
# weights, bf16, vLLM's CPU defaults): vLLM's scheduler and kernel (fcfs), the same with
# Feather's shared-prefix attention (fcfs-shared), Feather's scheduler without it
# (feather-model-noshared) and with it (feather-model, the default). Three rounds of each
# shape; every run a fresh engine; medians.py gives medians and per-round ratios with
# their ranges, against FCFS and against Feather without the kernel.
#   (a) 4 groups x 16, 8K-token prefixes (make run's workload)
#   (b) 8 groups x 16, 8K-token prefixes
#   (c) 1 group x 64, 8K-token prefix
#   (d) no sharing: 64 prompts of 2K tokens
# Results go into benchmarks/vllm/results/$SET/ (default: the commit).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=$(benchmarks/run_set.sh vllm)
bench=(.venv/bin/feather bench --output-len 64 --seed 0)
four=fcfs,fcfs-shared,feather-model-noshared,feather-model
report() {
    local name=$1
    {
        echo "### output tokens/s, against fcfs"
        .venv/bin/python benchmarks/vllm/medians.py $out/$name.json
        echo
        if grep -q feather-model-noshared $out/$name.json; then
            echo "### output tokens/s, against feather-model-noshared"
            .venv/bin/python benchmarks/vllm/medians.py $out/$name.json --base feather-model-noshared
            echo
        fi
        echo "### mean TPOT (ms), against fcfs"
        .venv/bin/python benchmarks/vllm/medians.py $out/$name.json --metric mean_tpot_ms
    } | tee $out/$name.md
}
"${bench[@]}" --groups 4 --prompts-per-group 16 --prefix-len 8192 \
    --schedulers $four,$four,$four --json $out/shared-4x16.json | tee $out/shared-4x16.txt
report shared-4x16
"${bench[@]}" --groups 8 --prompts-per-group 16 --prefix-len 8192 \
    --schedulers $four,$four,$four --json $out/shared-8x16.json | tee $out/shared-8x16.txt
report shared-8x16
"${bench[@]}" --groups 1 --prompts-per-group 64 --prefix-len 8192 \
    --schedulers $four,$four,$four --json $out/shared-1x64.json | tee $out/shared-1x64.txt
report shared-1x64
two=fcfs,feather-model
"${bench[@]}" --workload no-sharing --groups 1 --prompts-per-group 64 --prefix-len 2016 \
    --schedulers $two,$two,$two --json $out/shared-none.json | tee $out/shared-none.txt
report shared-none
