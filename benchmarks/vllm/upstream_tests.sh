#!/usr/bin/env bash
# vLLM's own scheduler unit tests against Feather: runs a vLLM source checkout's
# tests/v1/core/test_scheduler.py (default selection: -k priority) with Feather's
# scheduler in place of vLLM's, offline, and prints pass/fail counts.
#
#   benchmarks/vllm/upstream_tests.sh VLLM_CHECKOUT [--mode feather|vllm|both]
#       [-k EXPR] [--options JSON] [--model DIR] [--keep] [-- PYTEST_ARGS...]
#
#   --mode    feather (default): FeatherScheduler; vllm: vLLM's own Scheduler (the
#             baseline, which shows version skew between the checkout and the installed
#             vLLM); both: the two, then the tests that fail only under Feather
#   -k        pytest selection within test_scheduler.py (default: priority)
#   --options Feather options as JSON, put into every VllmConfig's
#             additional_config["feather"] (e.g. '{"order_running": false, "gate": "always"}')
#   --model   local model directory for the tests' Hub text model (facebook/opt-125m);
#             default: Feather's embedded tiny Llama
#   --keep    keep the temporary directory (its path is printed)
#
# Nothing of vLLM's is in this script and the checkout is not modified: the test files
# (tests/v1/core, tests/v1/kv_connector/unit/utils.py) are copied into a temporary
# directory, because pytest would put the checkout's root on sys.path and its vllm/
# source tree would shadow the installed vLLM. A pytest plugin written there swaps
# vLLM's Scheduler/AsyncScheduler in the test modules for FeatherScheduler (which picks
# the sync variant when the config has async scheduling off), points the Hub text model
# at a local directory, and drops keyword arguments the installed vLLM's config classes
# no longer take (listed at the end of the run). VLLM_ENABLE_V1_MULTIPROCESSING=0.
# The checkout should match the installed vLLM (0.32.0); other versions may fail for
# version skew, which --mode both separates from Feather's own differences.
set -euo pipefail

repo="$(cd "$(dirname "$0")/../.." && pwd)"
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit "${1:-2}"; }

[ $# -ge 1 ] || usage
case "$1" in -h|--help) usage 0 ;; esac
checkout="$(cd "$1" && pwd)"; shift
mode=feather; select=priority; options=""; model=""; keep=0; extra=()
while [ $# -gt 0 ]; do
    case "$1" in
        --mode) mode="$2"; shift 2 ;;
        -k) select="$2"; shift 2 ;;
        --options) options="$2"; shift 2 ;;
        --model) model="$2"; shift 2 ;;
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
test_file="$checkout/tests/v1/core/test_scheduler.py"
[ -f "$test_file" ] || { echo "no tests/v1/core/test_scheduler.py in $checkout" >&2; exit 2; }

work="$(mktemp -d "${TMPDIR:-/tmp}/feather-upstream.XXXXXX")"
if [ "$keep" = 1 ]; then echo "temporary directory: $work"; else trap 'rm -rf "$work"' EXIT; fi

# The tests, outside the checkout (see above).
mkdir -p "$work/tests/v1/kv_connector/unit" "$work/plugin"
cp -r "$checkout/tests/v1/core" "$work/tests/v1/"
for f in tests/__init__.py tests/utils.py tests/v1/__init__.py \
         tests/v1/kv_connector/__init__.py tests/v1/kv_connector/unit/__init__.py \
         tests/v1/kv_connector/unit/utils.py; do
    if [ -f "$checkout/$f" ]; then cp "$checkout/$f" "$work/$f"; fi
done
for d in tests tests/v1 tests/v1/core tests/v1/kv_connector tests/v1/kv_connector/unit; do
    [ -f "$work/$d/__init__.py" ] || : > "$work/$d/__init__.py"
done
commit="$(git -C "$checkout" rev-parse --short HEAD 2>/dev/null || echo 'not a git checkout')"

cat > "$work/plugin/feather_upstream_plugin.py" <<'PLUGIN'
"""pytest plugin: run vLLM's own scheduler unit tests (tests/v1/core) here, offline,
against vLLM's Scheduler or Feather's, without editing a line of the tests.

Environment:
  FEATHER_UPSTREAM_SCHEDULER  "feather" (default) or "vllm" (the baseline)
  FEATHER_UPSTREAM_OPTIONS    JSON object of Feather options, put into each
                              VllmConfig's additional_config["feather"]
  FEATHER_UPSTREAM_MODEL      local model directory (config.json + tokenizer) used in
                              place of the Hub's text models the tests name

Version skew: a keyword argument that the installed vLLM's config classes no longer
accept (e.g. CacheConfig(swap_space=...)) is dropped, and listed at the end of the run.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
from pathlib import Path

TEXT_MODELS = {"facebook/opt-125m"}
"""Hub text models the tests name; multimodal ones (llava) are left alone (offline they
fail to load, as they would without a Hub cache)."""

PATCHED_MODULE_PREFIXES = ("tests.v1.core",)

CONFIG_CLASSES = ("ModelConfig", "CacheConfig", "SchedulerConfig", "KVTransferConfig",
                  "ECTransferConfig", "ParallelConfig", "SpeculativeConfig", "Request")

DROPPED: set[str] = set()
"""Keyword arguments dropped for version skew, as Class.argument."""


class _Compat:
    """A vLLM config class that drops keyword arguments the installed version does not
    take (and rewrites the model name); attributes read through to the class."""

    def __init__(self, real, rewrite=None) -> None:
        self._real = real
        self._params = set(inspect.signature(real).parameters)
        self._rewrite = rewrite
        self.__wrapped__ = real

    def __call__(self, *args, **kwargs):
        if self._rewrite is not None:
            self._rewrite(self, kwargs)
        for name in [k for k in kwargs if k not in self._params]:
            kwargs.pop(name)
            DROPPED.add(f"{self._real.__name__}.{name}")
        return self._real(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._real, name)


def _model_dir() -> str:
    configured = os.environ.get("FEATHER_UPSTREAM_MODEL")
    if configured:
        return configured
    import feather_sched

    return str(Path(feather_sched.__file__).parent / "models" / "tiny-llama")


def _mode() -> str:
    mode = os.environ.get("FEATHER_UPSTREAM_SCHEDULER", "feather")
    if mode not in ("feather", "vllm"):
        raise ValueError(f"FEATHER_UPSTREAM_SCHEDULER must be feather or vllm, got {mode!r}")
    return mode


def _local_model(compat, kwargs) -> None:
    if kwargs.get("model") in TEXT_MODELS:
        kwargs["model"] = _model_dir()


def _eos_into_sampling_params(compat, kwargs) -> None:
    """Newer vLLM takes the EOS token from the sampling parameters, not the Request."""
    if "eos_token_id" in kwargs and "eos_token_id" not in compat._params:
        eos = kwargs.pop("eos_token_id")
        DROPPED.add("Request.eos_token_id (moved to SamplingParams)")
        params = kwargs.get("sampling_params")
        if eos is not None and params is not None:
            params.update_from_generation_config({}, eos)


REWRITES = {"ModelConfig": _local_model, "Request": _eos_into_sampling_params}


def _feather_scheduler(real):
    from feather_sched.integrations.vllm import FeatherScheduler

    options = json.loads(os.environ.get("FEATHER_UPSTREAM_OPTIONS") or "{}")

    def scheduler(*args, **kwargs):
        vllm_config = kwargs.get("vllm_config", args[0] if args else None)
        if options:
            extra = dict(vllm_config.additional_config or {})
            extra["feather"] = dict(options)
            vllm_config.additional_config = extra
        return FeatherScheduler(*args, **kwargs)

    scheduler.__wrapped__ = real
    return scheduler


def _patch(module) -> None:
    if getattr(module, "_feather_upstream_patched", False):
        return
    module._feather_upstream_patched = True
    for name in CONFIG_CLASSES:
        if name in vars(module):
            setattr(module, name, _Compat(getattr(module, name), REWRITES.get(name)))
    if _mode() == "feather":
        for name in ("Scheduler", "AsyncScheduler"):
            if name in vars(module):
                setattr(module, name, _feather_scheduler(getattr(module, name)))


def pytest_configure(config) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    config.addinivalue_line("markers", "cpu_test: vLLM's marker for CPU-only tests")


def pytest_collection_modifyitems(session, config, items) -> None:
    for name, module in list(sys.modules.items()):
        if module is not None and name.startswith(PATCHED_MODULE_PREFIXES):
            _patch(module)


def pytest_report_header(config):
    return (f"feather upstream plugin: scheduler={_mode()} "
            f"options={os.environ.get('FEATHER_UPSTREAM_OPTIONS') or '{}'} "
            f"model={_model_dir()}")


def pytest_terminal_summary(terminalreporter) -> None:
    if DROPPED:
        terminalreporter.write_line(
            "feather upstream plugin: dropped for version skew: " + ", ".join(sorted(DROPPED)))
PLUGIN

# One run: pytest in the copy, JUnit XML for the counts.
run() {  # run MODE -> prints counts, leaves $work/MODE.xml and $work/MODE.log
    local run_mode="$1" status=0
    (cd "$work" && env FEATHER_UPSTREAM_SCHEDULER="$run_mode" \
        FEATHER_UPSTREAM_OPTIONS="$options" FEATHER_UPSTREAM_MODEL="$model" \
        VLLM_ENABLE_V1_MULTIPROCESSING=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
        PYTHONPATH="$work/plugin${PYTHONPATH:+:$PYTHONPATH}" \
        "$python" -m pytest -p feather_upstream_plugin -p no:cacheprovider --noconftest \
        --rootdir "$work" -o addopts="" tests/v1/core/test_scheduler.py -k "$select" \
        -q -rfE --tb=short --junitxml="$work/$run_mode.xml" ${extra[@]+"${extra[@]}"} \
        > "$work/$run_mode.log" 2>&1) || status=$?
    if [ ! -f "$work/$run_mode.xml" ]; then
        tail -n 30 "$work/$run_mode.log"
        echo "pytest did not run (exit $status)" >&2
        return 2
    fi
    grep -E "dropped for version skew" "$work/$run_mode.log" || true
    "$python" - "$work/$run_mode.xml" "$run_mode" <<'PY'
import sys
import xml.etree.ElementTree as ET

cases = ET.parse(sys.argv[1]).getroot().iter("testcase")
outcome = {}
for case in cases:
    name = case.get("name")
    kinds = {child.tag for child in case}
    outcome[name] = ("failed" if "failure" in kinds else "error" if "error" in kinds
                     else "skipped" if "skipped" in kinds else "passed")
counts = {k: sum(1 for v in outcome.values() if v == k)
          for k in ("passed", "failed", "error", "skipped")}
print(f"{sys.argv[2]}: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
for name, result in sorted(outcome.items()):
    if result in ("failed", "error"):
        print(f"  {result.upper():6} {name}")
PY
    return 0
}

shown_options="${options:-none}"
echo "vLLM checkout: $checkout ($commit); selection: -k '$select'; Feather options: $shown_options"
if [ "$mode" = both ]; then
    run vllm
    run feather
    "$python" - "$work/vllm.xml" "$work/feather.xml" <<'PY'
import sys
import xml.etree.ElementTree as ET

def failing(path):
    return {c.get("name") for c in ET.parse(path).getroot().iter("testcase")
            if any(child.tag in ("failure", "error") for child in c)}
only = sorted(failing(sys.argv[2]) - failing(sys.argv[1]))
print(f"failing under Feather only: {len(only)}")
for name in only:
    print(f"  {name}")
sys.exit(1 if only else 0)
PY
else
    run "$mode"
    "$python" - "$work/$mode.xml" <<'PY'
import sys
import xml.etree.ElementTree as ET

bad = any(child.tag in ("failure", "error")
          for c in ET.parse(sys.argv[1]).getroot().iter("testcase") for child in c)
sys.exit(1 if bad else 0)
PY
fi
