"""vLLM's own scheduler tests under vLLM's scheduler and Feather's: the outcome files that
``upstream_tests.sh``'s pytest plugin writes (node id -> passed/failed/error/skipped),
counted, compared and recorded.

    python upstream_outcomes.py counts MODE RUN.json        print the counts and failures
    python upstream_outcomes.py compare [VLLM.json] FEATHER.json
        the tests failing under Feather only (exit 1 if any); with one file, exit 1 if
        any test failed
    python upstream_outcomes.py record OUT RELEASE SELECTION OPTIONS RUN.json...
        one JSON record of the runs (each RUN.json named by its mode)
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

KINDS = ("passed", "failed", "error", "skipped")


def load(path: str | Path) -> dict[str, str]:
    return json.loads(Path(path).read_text())


def failing(outcomes: dict[str, str]) -> set[str]:
    return {test for test, outcome in outcomes.items() if outcome in ("failed", "error")}


def counts(outcomes: dict[str, str]) -> dict[str, int]:
    return {kind: sum(1 for v in outcomes.values() if v == kind) for kind in KINDS}


def print_counts(mode: str, path: str) -> None:
    outcomes = load(path)
    print(f"{mode}: " + ", ".join(f"{n} {kind}" for kind, n in counts(outcomes).items()))
    for test in sorted(failing(outcomes)):
        print(f"  {outcomes[test].upper():6} {test}")


def compare(*paths: str) -> int:
    if len(paths) == 1:
        return 1 if failing(load(paths[0])) else 0
    only = sorted(failing(load(paths[1])) - failing(load(paths[0])))
    print(f"failing under Feather only: {len(only)}")
    for test in only:
        print(f"  {test}")
    return 1 if only else 0


def record(out: str, release: str, selection: str, options: str, *paths: str) -> None:
    commit = subprocess.run(["git", "-C", str(Path(__file__).parent), "rev-parse", "--short",
                             "HEAD"], capture_output=True, text=True).stdout.strip()
    document = {"release": release, "selection": selection, "options": json.loads(options),
                "feather_commit": commit or None,
                "recorded": time.strftime("%Y-%m-%d", time.gmtime()),
                "command": f"benchmarks/vllm/upstream_tests.sh --release {release} --mode both "
                           f"--options '{options}' --record FILE",
                "counts": {Path(p).stem: counts(load(p)) for p in paths},
                "runs": {Path(p).stem: load(p) for p in paths}}
    Path(out).write_text(json.dumps(document, indent=1) + "\n")
    print(f"recorded: {out}")


def main(argv: list[str]) -> int:
    command, *args = argv
    if command == "counts":
        print_counts(*args)
        return 0
    if command == "compare":
        return compare(*args)
    if command == "record":
        record(*args)
        return 0
    raise SystemExit(f"unknown command {command!r} (counts, compare or record)")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
