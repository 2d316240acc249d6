# Sourced by the replica benchmarks run from the repository root: `feather serve` in the
# background, up and down.
# start_server LOG ARGS...: `.venv/bin/feather serve ARGS...` logging to LOG; returns once
# every replica is up (feather serve prints "replicas at http" after serve.run), with its
# pid in $server; exits the script if the server dies first.
start_server() {
    local log=$1
    shift
    .venv/bin/feather serve "$@" >"$log" 2>&1 &
    server=$!
    trap 'kill $server 2>/dev/null || true' EXIT
    for _ in $(seq 300); do
        grep -q "replicas at http" "$log" && return 0
        kill -0 "$server" 2>/dev/null || { echo "feather serve died, see $log" >&2; exit 1; }
        sleep 2
    done
}

# stop_server: stop the server start_server started, and wait for it.
stop_server() {
    kill -TERM "$server"
    wait "$server" || true
    trap - EXIT
}
