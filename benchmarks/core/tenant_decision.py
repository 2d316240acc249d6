"""One admission decision under fair share, timed at 10 to 10,000 backlogged tenants.

    PYTHONPATH=src .venv/bin/python benchmarks/core/tenant_decision.py [--tenants 10 100 ...]
        [--repeats N] [--set NAME] [--label LABEL]

A ``FeatherRuntime`` with ``fairness: tenants`` (the always-add gate, no starvation
backstop) on an engine of 256 seats, all taken by 256 running requests of the first
tenants; every tenant has two requests waiting (``T`` backlogged tenants; prompts of their
own, and one in four sharing a system prompt with the running set).  Timed, each the
median of ``--repeats`` with its range:

* ``decide``: one uncached ``decide()`` (vLLM's ``schedule()`` asks it per admission:
  the queue changed since the last answer, an admission and a seat freed);
* ``pass``: ``begin_pass`` (the once-per-pass refresh of the seat shares and the running
  order's tenant ranking);
* ``rank_waiting``: ``rank_waiting`` over the whole waiting list (SGLang's per-pass call;
  O(n log n) in the waiting requests, n = 2T).

With the fairness bound on (``max_overtakes`` 32, ``max_stops`` 4, the defaults) and off.
Writes tenant-decision-LABEL.json and .md into results/NAME/ (default: the commit), with
the CPU model.  ``--label before`` run with ``PYTHONPATH`` at the parent commit's src.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from feather_sched.core.config import FeatherConfig
from feather_sched.core.runtime import FeatherRuntime

HERE = Path(__file__).parent
SEATS = 256


@dataclass(eq=False)
class Req:
    rid: str
    keys: list = field(default_factory=list)
    arrival: float = 0.0
    tenant: str = "default"


class View:
    def request_id(self, request: Req) -> str:
        return request.rid

    def chunk_keys(self, request: Req) -> list:
        return request.keys

    def prompt_tokens(self, request: Req) -> int:
        return 128 * len(request.keys)

    def arrival_s(self, request: Req) -> float:
        return request.arrival

    def priority(self, request: Req) -> int:
        return 0

    def tenant(self, request: Req) -> str:
        return request.tenant


def build(tenants: int, bounded: bool, repeats: int
          ) -> tuple[FeatherRuntime, list[Req], list[Req]]:
    """The runtime with ``SEATS`` running and two requests waiting per tenant (more
    where ``repeats`` admissions would leave none)."""
    options = {"gate": "always", "max_wait_s": None, "fairness": "tenants"}
    if not bounded:
        options |= {"max_overtakes": None, "max_stops": None}
    config = FeatherConfig.from_sources(options, environ={})
    rt = FeatherRuntime(config, View(), clock=lambda: 0.0)
    rt.queue.seats = SEATS
    system = [("system", i) for i in range(4)]
    running = [Req(f"run{i}", [*system, ("run", i)], float(i), f"t{i % tenants}")
               for i in range(SEATS)]
    for request in running:
        rt.enter_waiting(request)
    rt.begin_pass([])
    for request in running:
        rt.decide(request)
        rt.admit(request)
    rt.end_pass(0, running)
    waiting = []
    for i in range(max(2 * tenants, repeats + 10)):
        keys = [*system, ("own", i)] if i % 4 == 0 else [("own", i, j) for j in range(5)]
        waiting.append(Req(f"w{i}", keys, float(SEATS + i), f"t{i % tenants}"))
    for request in waiting:
        rt.enter_waiting(request)
    for i, request in enumerate(running):
        rt.served(request.rid, 10 * (i % 7), i % 3)
    return rt, running, waiting


def timed(call, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return times


def measure(tenants: int, bounded: bool, repeats: int) -> dict:
    """Each figure in ms: median, min, max over ``repeats``."""
    rt, running, waiting = build(tenants, bounded, repeats)
    passes = timed(lambda: rt.begin_pass(running), repeats)
    decisions = []
    for _ in range(repeats):  # each admission frees a seat first: a fresh decision
        rt.discard(running.pop(0).rid)
        rt.begin_pass(running)
        start = time.perf_counter()
        answer = rt.decide()
        decisions.append(time.perf_counter() - start)
        request = rt.request(answer.request_id)
        rt.admit(request)
        running.append(request)
    ranks = timed(lambda: rt.rank_waiting(waiting), max(3, repeats // 10))
    return {name: summary(values) for name, values in
            (("decide", decisions), ("pass", passes), ("rank_waiting", ranks))}


def summary(seconds: list[float]) -> dict:
    ms = [1000 * s for s in seconds]
    return {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms),
            "n": len(ms)}


def cpu_model() -> str:
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def table(rows: list[dict]) -> str:
    lines = ["| tenants | bound | decide (ms) | pass (ms) | rank_waiting (ms) |",
             "|---:|---|---|---|---|"]
    for row in rows:
        cells = [f"{row[k]['median_ms']:.3f} ({row[k]['min_ms']:.3f}-{row[k]['max_ms']:.3f})"
                 for k in ("decide", "pass", "rank_waiting")]
        lines.append(f"| {row['tenants']:,} | {'on' if row['bounded'] else 'off'} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tenants", type=int, nargs="+", default=[10, 100, 1000, 10000])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--set", default=None)
    parser.add_argument("--label", default="after")
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=HERE).stdout.strip()
    out = HERE / "results" / (args.set or commit)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for tenants in args.tenants:
        for bounded in (False, True):
            rows.append({"tenants": tenants, "bounded": bounded,
                         **measure(tenants, bounded, args.repeats)})
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    record = {"commit": commit, "label": args.label, "cpu": cpu_model(), "seats": SEATS,
              "repeats": args.repeats, "rows": rows}
    (out / f"tenant-decision-{args.label}.json").write_text(json.dumps(record, indent=1))
    (out / f"tenant-decision-{args.label}.md").write_text(
        f"{args.label} ({commit}; {record['cpu']}; median (min-max) of {args.repeats}, "
        f"rank_waiting of {max(3, args.repeats // 10)})\n\n{table(rows)}\n")
    print(table(rows))


if __name__ == "__main__":
    main()
