"""Which request Feather preempts under KV pressure: the rules measured in the simulator.

    .venv/bin/python benchmarks/sim/preemption.py [--set NAME]       # ~1 minute

Llama-3-8B on the H100 SXM profile, vLLM's limits, KV pools small enough to preempt.
Feather (``feather-model``, its defaults) under four victim rules, next to vLLM's FCFS:

* ``end of list``: the end of a running list ordered larger groups first (Feather's order
  and vLLM's victim before 5a29f14), i.e. the latest member of the smallest group;
* ``latest arrival``: Feather's rule from 5a29f14 (issue 24) until the youngest group's;
* ``largest group``: the latest arrival of the largest group (its prefix stays cached by
  its siblings, only its private tokens are recomputed);
* ``youngest group``: the rule Feather keeps (``FeatherRuntime.preemption_victim``): the
  latest arrival of the group whose oldest running member is the youngest (FCFS between
  groups), the end of Feather's running order.

Cells: a singleton that arrives first against a stream of 400 majority requests (the case
the end-of-list rule starves); 8 groups x 100 with 4K prefixes at 100 req/s over three
pool sizes (the smallest barely holds the 8 prefixes); 400 + 3 x 20 minority groups;
100 groups x 8 of 10K prefixes at 1.5x FCFS's offline rate (``sweep.py``'s cell where
the latest-arrival rule lost its gain). Output tokens/s, preemptions, the worst group's
mean TTFT and when the singleton finished. Writes preemption.json and preemption.md into
results/NAME/ (default: the commit).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from feather_sched.bench.study import Study, markdown_table, offline_rate, parser, sim_plan
from feather_sched.core.runtime import FeatherRuntime
from feather_sched.results.summary import summarize
from feather_sched.sim.runner import SimPlan, simulate
from feather_sched.workloads.spec import ArrivalSpec, Workload
from feather_sched.workloads.synthetic import (
    minority_groups,
    shared_prefix_groups,
    singleton_before_a_stream,
)

Rule = Callable[[FeatherRuntime, Sequence[Any]], Any]


def end_of_larger_first(runtime: FeatherRuntime, running: Sequence[Any]) -> Any:
    """The end of the running list ordered larger groups first (Feather's order until
    2026-12-01): the last member of the smallest group."""
    groups = [runtime.group(r) for r in running]
    sizes = Counter(groups)
    first: dict[Any, int] = {}
    for index, group in enumerate(groups):
        first.setdefault(group, index)
    return running[max(range(len(running)),
                       key=lambda i: (-sizes[groups[i]], first[groups[i]], i))]


def latest_arrival(runtime: FeatherRuntime, running: Sequence[Any]) -> Any:
    return max(running, key=runtime.age_key)


def largest_group(runtime: FeatherRuntime, running: Sequence[Any]) -> Any:
    sizes = Counter(runtime.group(r) for r in running)
    top = max(sizes.values())
    return max((r for r in running if sizes[runtime.group(r)] == top),
               key=runtime.age_key)


RULES: dict[str, Rule] = {"end of list": end_of_larger_first,
                          "latest arrival": latest_arrival,
                          "largest group": largest_group,
                          "youngest group": FeatherRuntime.preemption_victim}


def many_groups_at_load() -> Workload:
    """``sweep.py``'s 100 groups x 8 of 10K prefixes, decode 200, Poisson at 1.5x FCFS's
    offline request rate."""
    def groups(arrival: ArrivalSpec | None) -> Workload:
        return shared_prefix_groups(groups=100, prompts_per_group=8, prefix_len=10240,
                                    suffix_len=32, output_len=200, arrival=arrival, seed=0)
    return groups(ArrivalSpec(kind="poisson", rate=1.5 * offline_rate(plan(groups(None), None))))


def cells() -> list[tuple[str, Workload, int | None]]:
    groups = shared_prefix_groups(groups=8, prompts_per_group=100, prefix_len=4096,
                                  suffix_len=32, output_len=200,
                                  arrival=ArrivalSpec(kind="poisson", rate=100), seed=0)
    minority = minority_groups(majority=400, minorities=[20, 20, 20], prefix_len=4096,
                               suffix_len=32, output_len=200,
                               arrival=ArrivalSpec(kind="poisson", rate=100), seed=0)
    singleton = singleton_before_a_stream(stream=400, prefix_len=2048, suffix_len=32,
                                          output_len=200, singleton_output_len=400,
                                          arrival=ArrivalSpec(kind="poisson", rate=200))
    return [("singleton first, then 400 majority requests", singleton, 600),
            ("8 x 100, 4K prefixes, 2,500 blocks", groups, 2500),
            ("8 x 100, 4K prefixes, 4,000 blocks", groups, 4000),
            ("8 x 100, 4K prefixes, 6,000 blocks", groups, 6000),
            ("400 + 3 x 20, 4K prefixes, 2,500 blocks", minority, 2500),
            ("100 x 8, 10K prefixes, the GPU's pool", many_groups_at_load(), None)]


def plan(workload: Workload, blocks: int | None) -> SimPlan:
    """H100, Llama-3-8B; a pool of ``blocks`` (None: what the GPU's memory holds)."""
    return sim_plan(workload, "h100-sxm", **({} if blocks is None else {"num_blocks": blocks}))


def measure(workload: Workload, blocks: int | None, name: str) -> dict:
    run = simulate(plan(workload, blocks), name)
    summary = summarize(run)
    solo = [r.finished_s for r in run.records if r.group < 0]
    return {"output_throughput": summary["output_throughput"],
            "preemptions": summary["preemptions"],
            "worst_group_mean_ttft_ms": summary["worst_group_mean_ttft_ms"],
            "solo_finished_s": solo[0] if solo else None}


def main() -> None:
    study = Study(__file__, set_name=parser(__doc__).parse_args().set)
    rows = []
    for label, workload, blocks in study.each(cells(), lambda cell: cell[0]):
        row = {"cell": label, "fcfs": measure(workload, blocks, "fcfs")}
        chosen = FeatherRuntime.preemption_victim
        for rule, victim in RULES.items():
            FeatherRuntime.preemption_victim = victim
            try:
                row[rule] = measure(workload, blocks, "feather-model")
            finally:
                FeatherRuntime.preemption_victim = chosen
        rows.append(row)
    study.save("preemption", {"rows": rows}, markdown(rows))


def markdown(rows: list[dict]) -> str:
    names = ["fcfs", *RULES]

    def outcome(r: dict) -> str:
        text = (f"{r['output_throughput']:,.0f} tok/s, {r['preemptions']} preempted, "
                f"worst group TTFT {r['worst_group_mean_ttft_ms'] / 1e3:.1f} s")
        if r["solo_finished_s"] is not None:
            text += f", singleton done {r['solo_finished_s']:.1f} s"
        return text

    return markdown_table(["cell", *names],
                          ([row["cell"], *(outcome(row[name]) for name in names)]
                           for row in rows))


if __name__ == "__main__":
    main()
