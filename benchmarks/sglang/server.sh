# Sourced by the SGLang benchmarks: start_sglang PORT LOG [launcher args...] starts the real
# SGLang server on the embedded CPU model, waits until it answers, and sets $server to its pid.
start_sglang() {
    local port=$1 log=$2
    shift 2
    .venv/bin/python -m feather_sched.integrations.sglang_launch \
        --model-path src/feather_sched/models/tiny-llama --device cpu --load-format dummy \
        --skip-tokenizer-init --attention-backend torch_native --host 127.0.0.1 \
        --port "$port" "$@" > "$log" 2>&1 &
    server=$!
    for _ in $(seq 1 60); do
        curl -sf -m 2 "http://127.0.0.1:$port/v1/models" > /dev/null && return 0
        sleep 3
    done
    echo "SGLang server on port $port did not answer; see $log" >&2
    return 1
}
