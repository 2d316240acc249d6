#!/usr/bin/env bash
# The folder of a run set, made and printed, for the benchmark scripts (run from the
# repository root): benchmarks/run_set.sh TOPIC [PREFIX] -> benchmarks/TOPIC/results/$SET,
# SET by default PREFIX<commit>: the short commit of HEAD, "-dirty" with uncommitted
# changes to tracked files (as feather_sched.bench.study names the Python studies' sets).
set -euo pipefail
commit=$(git rev-parse --short HEAD)
git diff --quiet HEAD -- || commit+=-dirty
dir=benchmarks/$1/results/${SET:-${2:-}$commit}
mkdir -p "$dir"
echo "$dir"
