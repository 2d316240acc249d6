"""Feather across replicas in the simulator: 8 engines behind each router, FCFS or Feather.

    .venv/bin/python benchmarks/replicas/sim.py [--quick] [--seeds N] [--loads 1.5,3]
        [--prefix T] [--hardware h100-sxm,h200] [--groups 8,64,400,0] [--kv-blocks B]
        [--ingresses 1,4] [--routers NAMES] [--jobs J] [--out STEM] [--set NAME]

Llama-3-8B on 8 replicas of H100 SXM and of H200 (datasheet profiles; ``--hardware``
takes profile names or the profiles ``feather calibrate`` writes, e.g. from the GPU
kit's measurements on a real H200); 8, 64 and 400
prefix groups of 10K-token prefixes (``--prefix``; 32 unique tokens each, 100 output
tokens) with Zipf popularity (s = 1.1), 2,400 requests per cell; plus a no-sharing cell
(1K-token unique prompts).  Poisson arrivals at ``load`` x the request rate
power-of-two + FCFS reaches with every request sent at once (its capacity on that
workload): 1.5x is about the capacity of the cache-aware routers, so it shows their
latency and caps their throughput near the arrival rate; 3x overloads every pair, so
throughput shows each pair's capacity.
Routers: round-robin, power-of-two, prefix-affinity (Ray Serve's rule),
sglang-cache-aware, feather (FeatherRouter, approximate index) and feather-precise
(FeatherRouter on a ``PreciseIndex`` fed by the engines' KV events); replicas run FCFS or
Feather (bandit gate, defaults).  ``--kv-blocks`` sets every replica's KV pool (16-token
blocks; default 90% of memory less weights): small, it makes an eviction-heavy cell.
``--ingresses K`` deals the requests over K routers of the same kind in turn, each with
its own loads and index, as K Ray Serve ingress replicas route (a cell per K).

Each cell runs with ``--seeds`` workload seeds (arrivals, popularity and the routers'
random choices); the simulator charges each scheduler's own Python time to its clock, so
runs differ a little with the machine's load too.  STEM.md (default sim.md) gives per
pair the median ratio to power-of-two + FCFS over the seeds with its range, and the prompt
tokens computed over the floor no router can go below (each group's prefix once);
STEM.json every run's figures; both in results/NAME/ (default: the commit).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable
from dataclasses import replace
from itertools import product
from pathlib import Path

from feather_sched.bench.study import (
    MODEL,
    Study,
    markdown_table,
    parallel,
    parser,
    ratio,
    sim_plan,
)
from feather_sched.costmodel.calibrate import load_profile
from feather_sched.costmodel.hardware import HARDWARE
from feather_sched.costmodel.model_profiles import MODELS
from feather_sched.results.summary import Percentiles, median_and_range, prefill_over_floor
from feather_sched.routing.baselines import ROUTER_CLASSES, make_router
from feather_sched.routing.feather import FeatherRouter
from feather_sched.routing.router import Router
from feather_sched.sim.replicas import Ingresses, precise_index, simulate_replicas
from feather_sched.sim.runner import SimPlan
from feather_sched.workloads.spec import ArrivalSpec, Workload
from feather_sched.workloads.synthetic import no_sharing, shared_prefix_groups

REPLICAS = 8
REQUESTS = 2400
PREFIX = 10240
SUFFIX = 32
OUTPUT = 100
LOADS = (1.5, 3.0)
SCHEDULERS = ("fcfs", "feather-bandit")
BASELINE = ("power-of-two", "fcfs")
OURS = ("feather", "feather-bandit")
AFFINITY = ("prefix-affinity", "fcfs")
PRECISE = "feather-precise"
ROUTER_NAMES = (*ROUTER_CLASSES, PRECISE)
KEYS = ("output_throughput", "request_throughput", "mean_ttft_ms", "p90_ttft_ms",
        "p99_ttft_ms", "replica_imbalance", "prefix_cache_hit_rate", "mean_groups_per_step",
        "groups_per_replica", "preemptions")


def workload(groups: int, prefix: int, rate: float | None, seed: int) -> Workload:
    """``groups`` 0: no sharing.  ``rate`` None: every request at once."""
    arrival = None if rate is None else ArrivalSpec(kind="poisson", rate=rate)
    if not groups:
        return no_sharing(requests=REQUESTS, prompt_len=1024 + SUFFIX, output_len=OUTPUT,
                          arrival=arrival, seed=seed)
    return shared_prefix_groups(groups=groups, prompts_per_group=REQUESTS // groups,
                                prefix_len=prefix, suffix_len=SUFFIX, output_len=OUTPUT,
                                popularity="zipf", arrival=arrival, seed=seed)


def run(hardware: str, groups: int, prefix: int, rate: float | None, seed: int, router: str,
        scheduler: str, *, kv_blocks: int | None = None, ingresses: int = 1,
        **router_options: float) -> dict:
    """One pair on one workload; ``router_options`` go to the router (its thresholds)."""
    plan = plan_on(hardware, workload(groups, prefix, rate, seed), kv_blocks)

    def one(seed: int) -> Router:
        if router == PRECISE:
            return FeatherRouter(range(REPLICAS), seed=seed, **router_options,
                                 index=precise_index(plan.engine_config()))
        return make_router(router, range(REPLICAS), seed=seed, **router_options)

    routers = one(seed) if ingresses == 1 else Ingresses([one(seed + k)
                                                          for k in range(ingresses)])
    result = simulate_replicas(plan, routers, scheduler)
    summary = result.summary(Percentiles(values=(90.0, 99.0)))
    return {"hardware": hardware, "groups": groups, "seed": seed, "router": router,
            "scheduler": scheduler, "kv_blocks": plan.engine_config().num_blocks,
            "ingresses": ingresses, **router_options, **{k: summary[k] for k in KEYS},
            "prefill_over_floor": prefill_over_floor(result.run.records, plan.workload)}


def plan_on(hardware: str, load: Workload, kv_blocks: int | None = None) -> SimPlan:
    """Llama-3-8B serving ``load`` on ``hardware``: a profile name (datasheet figures,
    default cost parameters) or the path of a profile ``feather calibrate`` wrote (its
    hardware and fitted parameters); ``kv_blocks`` 16-token KV blocks per replica (None:
    what the memory holds)."""
    pool = {} if kv_blocks is None else {"num_blocks": kv_blocks}
    if hardware in HARDWARE:
        return sim_plan(load, hardware, **pool)
    if not Path(hardware).is_file():
        raise ValueError(f"hardware {hardware!r}: neither one of {', '.join(HARDWARE)} nor a "
                         "profile file")
    calibrated = load_profile(hardware)
    plan = SimPlan(workload=load, hardware=calibrated.hardware, model=MODELS[MODEL],
                   params=calibrated.params)
    plan.engine = replace(plan.engine_config(), **pool)
    return plan


def run_task(task: tuple) -> dict:
    """``run`` of a task ``(*run's positional arguments, its options)``, as a process pool
    maps them."""
    *positional, options = task
    return run(*positional, **options)


def over(ours: list[dict], base: list[dict], key: str, fmt: str = "{:.2f}") -> str:
    """Median (range) of per-seed ratios ``ours[key] / base[key]``."""
    return ratio(ours, base, key, fmt, unit="")


def setting_table(runs: list[dict], key: Callable[[dict], tuple],
                  settings: Iterable[tuple[list[str], tuple, tuple]], latency: str,
                  figure: tuple[str, str], intro: str, header: list[str]) -> str:
    """``intro``, then a table (``header``) with a row per setting ``(its cells, the key of
    its runs, the key of its base's runs)``, ``key`` giving a run's key: throughput and
    ``latency`` over the base's, per seed then median (range); the worst replica
    imbalance; the median of ``figure`` (key, format)."""
    keyed = {(*key(r), r["seed"]): r for r in runs}
    seeds = sorted({r["seed"] for r in runs})
    rows = []
    for cells, ours_key, base_key in settings:
        ours = [keyed[(*ours_key, s)] for s in seeds]
        base = [keyed[(*base_key, s)] for s in seeds]
        rows.append([*cells, over(ours, base, "output_throughput"), over(ours, base, latency),
                     f"{max(r['replica_imbalance'] for r in ours):.2f}",
                     figure[1].format(statistics.median(r[figure[0]] for r in ours))])
    return "\n".join([intro, "", markdown_table(header, rows)]) + "\n"


def capacities(cells: list[tuple], options: dict, jobs: int) -> dict[tuple, float]:
    """Power-of-two + FCFS's requests/s with every request at once, for each cell
    ``(hardware, groups, prefix, seed)``: the capacity a cell's loads are multiples of."""
    return dict(zip(cells, (r["request_throughput"] for r in parallel(
        run_task, [(hw, groups, prefix, None, seed, *BASELINE, options)
                   for hw, groups, prefix, seed in cells], jobs)), strict=True))


def save(stem: str, config: dict, runs: list[dict], text: str, study: Study) -> None:
    """Write STEM.json (the command, config, every run) and STEM.md in the run set's
    folder, print the table and the time."""
    study.save(stem, {"config": config, "runs": runs}, text)
    print(f"{study.elapsed():.0f} s", flush=True)


def study_main(script: str, doc: str | None, stem: str,
               measure: Callable[[int, int], list[dict]],
               markdown: Callable[[list[dict]], str], config: dict) -> None:
    """The main of a study over cells of this grid (``balance.py``, ``band.py``): its
    ``--seeds``, ``--jobs`` and ``--set``, ``measure(seeds, jobs)``, then STEM.json (the
    study's ``config``, the seeds and the time, every run) and STEM.md."""
    args = parser(doc, seeds=3, jobs=2).parse_args()
    study = Study(script, set_name=args.set)
    runs = measure(args.seeds, args.jobs)
    save(stem, {**config, "seeds": args.seeds, "wall_s": study.elapsed()}, runs,
         markdown(runs), study)


def measure(hardware: tuple[str, ...], group_counts: tuple[int, ...], prefix: int,
            loads: tuple[float, ...], seeds: int, jobs: int, routers: tuple[str, ...] =
            ROUTER_NAMES, kv_blocks: int | None = None,
            ingresses: tuple[int, ...] = (1,)) -> list[dict]:
    """Every cell (hardware, groups, ingresses, load, seed): the baseline's capacity (one
    router), then every pair at ``load`` x it.  Cells in parallel over ``jobs``
    processes."""
    cells = list(product(hardware, group_counts, range(seeds)))
    pool_size = {"kv_blocks": kv_blocks}
    measured = capacities([(hw, groups, prefix, seed) for hw, groups, seed in cells],
                          pool_size, jobs)
    capacity = {(hw, groups, seed): measured[hw, groups, prefix, seed]
                for hw, groups, seed in cells}
    tasks = [(hw, groups, prefix, load * capacity[hw, groups, seed], seed, router,
              scheduler, {**pool_size, "ingresses": k})
             for (hw, groups, seed), k, load, router, scheduler
             in product(cells, ingresses, loads, routers, SCHEDULERS)]
    runs = parallel(run_task, tasks, jobs)
    for task, row in zip(tasks, runs, strict=True):
        hw, groups, _, rate, seed = task[:5]
        row["capacity_req_s"] = capacity[hw, groups, seed]
        row["rate_req_s"] = rate
        row["load"] = round(rate / capacity[hw, groups, seed], 6)
    return runs


def by_cell(runs: list[dict]) -> dict[tuple, dict[int, dict[tuple[str, str], dict]]]:
    """(hardware, groups, ingresses, load) -> seed -> (router, scheduler) -> run."""
    cells: dict = {}
    for r in runs:
        cell = cells.setdefault((r["hardware"], r["groups"], r.get("ingresses", 1),
                                 r["load"]), {})
        cell.setdefault(r["seed"], {})[r["router"], r["scheduler"]] = r
    return cells


def markdown(runs: list[dict]) -> str:
    """Per cell and pair: output throughput over power-of-two + FCFS (median and range over
    seeds), TTFT, imbalance; then the issue's targets for Feather + Feather; then, where
    the precise index ran, its figures over the approximate index's."""
    seeds = len({r["seed"] for r in runs})
    cells = by_cell(runs)

    def figure(rows: list[dict], key: str, fmt: str = "{:.2f}") -> str:
        values = [r.get(key) for r in rows]
        return "-" if None in values else median_and_range(values, fmt)

    def cell(hw: str, groups: int, ingresses: int, load: float) -> list[str]:
        return [hw, str(groups or "none"), str(ingresses), f"{load:g}x"]

    pairs = []
    for key, by_seed in cells.items():
        for pair in next(iter(by_seed.values())):
            rows = [by_seed[s][pair] for s in by_seed]
            base = [by_seed[s][BASELINE] for s in by_seed]
            pairs.append([*cell(*key), *pair, figure(rows, "output_throughput", "{:,.0f}"),
                          f"{over(rows, base, 'output_throughput')}x",
                          figure(rows, "mean_ttft_ms", "{:,.0f}"),
                          figure(rows, "p90_ttft_ms", "{:,.0f}"),
                          figure(rows, "p99_ttft_ms", "{:,.0f}"),
                          figure(rows, "replica_imbalance"),
                          figure(rows, "prefix_cache_hit_rate")])
    targets = []
    for key, by_seed in cells.items():
        seeds_ = list(by_seed.values())
        ours = [p[OURS] for p in seeds_]
        affinity = [p[AFFINITY] for p in seeds_]
        base = [p[BASELINE] for p in seeds_]
        targets.append([*cell(*key), f"{over(ours, base, 'output_throughput')}x",
                        f"{over(ours, affinity, 'output_throughput')}x",
                        median_and_range([r["replica_imbalance"] for r in ours]),
                        over(ours, affinity, "p99_ttft_ms"),
                        median_and_range([r["prefill_over_floor"] for r in ours]),
                        median_and_range([r["prefill_over_floor"] for r in affinity])])
    lines = [f"Medians over {seeds} seeds (range in brackets); routers: requests dealt over "
             "that many routers of the kind.", "",
             markdown_table(["hardware", "groups", "routers", "load", "router", "scheduler",
                             "tok/s", "x p2+FCFS", "mean TTFT ms", "p90 TTFT ms",
                             "p99 TTFT ms", "imbalance", "prefix hits"], pairs),
             "", "Targets (feather + feather-bandit): >= 1.5x power-of-two + FCFS, >= 1.15x "
             "prefix-affinity + FCFS, imbalance <= 1.3, p99 TTFT <= prefix-affinity + FCFS's; "
             "no loss without sharing.  Ratios per seed, then median (range).", "",
             markdown_table(["hardware", "groups", "routers", "load", "x p2+FCFS",
                             "x prefix-affinity+FCFS", "imbalance",
                             "p99 TTFT / prefix-affinity+FCFS's", "prefill / floor: ours",
                             "prefill / floor: prefix-affinity+FCFS"], targets)]
    if any(r["router"] == PRECISE for r in runs):
        rows = []
        for key, by_seed in cells.items():
            for scheduler in SCHEDULERS:
                precise = [p[PRECISE, scheduler] for p in by_seed.values()]
                approximate = [p["feather", scheduler] for p in by_seed.values()]
                figures = [over(precise, approximate, key) for key in (
                    "prefix_cache_hit_rate", "p90_ttft_ms", "mean_ttft_ms", "output_throughput")]
                rows.append([*cell(*key), scheduler, f"{figures[0]}x", figures[1], figures[2],
                             f"{figures[3]}x",
                             f"{max(a['replica_imbalance'] for a in precise):.2f}"])
        lines += ["", "The precise index (feather-precise) over the approximate one (feather), "
                  "same scheduler; targets: prefix hits >= 1.3x, p90 TTFT <= 0.8x, imbalance "
                  "<= 1.3.  Ratios per seed, then median (range).", "",
                  markdown_table(["hardware", "groups", "routers", "load", "scheduler",
                                  "prefix hits: x approx.", "p90 TTFT / approx.'s",
                                  "mean TTFT / approx.'s", "tok/s: x approx.",
                                  "imbalance (worst)"], rows)]
    return "\n".join(lines) + "\n"


def main() -> None:
    arguments = parser(__doc__, seeds=3, jobs=2)
    arguments.add_argument("--quick", action="store_true", help="H100 and 64 groups only")
    arguments.add_argument("--loads", default=",".join(f"{x:g}" for x in LOADS),
                           help="arrival rates as multiples of power-of-two + FCFS's capacity")
    arguments.add_argument("--prefix", type=int, default=PREFIX, help="prefix tokens per group")
    arguments.add_argument("--hardware", default="h100-sxm,h200",
                           help="profile names or calibrated profile files, comma-separated")
    arguments.add_argument("--groups", default="8,64,400,0",
                           help="prefix group counts, comma-separated (0: no sharing)")
    arguments.add_argument("--kv-blocks", type=int, default=None,
                           help="KV blocks per replica (default: what the memory holds)")
    arguments.add_argument("--ingresses", default="1",
                           help="routers the requests are dealt over, comma-separated cells")
    arguments.add_argument("--routers", default=",".join(ROUTER_NAMES),
                           help="routers, comma-separated (power-of-two, prefix-affinity and "
                                "feather are always run: the tables compare with them)")
    arguments.add_argument("--out", default="sim", help="stem of the .json and .md written")
    args = arguments.parse_args()
    hardware = ("h100-sxm",) if args.quick else tuple(args.hardware.split(","))
    for name in hardware:
        plan_on(name, workload(0, args.prefix, None, 0))  # a bad name fails before any run
    group_counts = (64,) if args.quick else tuple(int(g) for g in args.groups.split(","))
    loads = tuple(float(x) for x in args.loads.split(","))
    wanted = {name.strip() for name in args.routers.split(",")}
    unknown = wanted - set(ROUTER_NAMES)
    if unknown:
        arguments.error(f"unknown routers {sorted(unknown)}: use {', '.join(ROUTER_NAMES)}")
    routers = tuple(name for name in ROUTER_NAMES
                    if name in wanted | {BASELINE[0], AFFINITY[0], OURS[0]})
    ingresses = tuple(int(k) for k in args.ingresses.split(","))
    study = Study(__file__, set_name=args.set)
    runs = measure(hardware, group_counts, args.prefix, loads, args.seeds, args.jobs,
                   routers, args.kv_blocks, ingresses)
    config = {"replicas": REPLICAS, "requests": REQUESTS, "prefix": args.prefix, "suffix": SUFFIX,
              "output": OUTPUT, "loads": loads, "seeds": args.seeds, "zipf_s": 1.1,
              "model": MODEL, "kv_blocks": args.kv_blocks, "ingresses": ingresses,
              "routers": routers, "wall_s": study.elapsed()}
    save(args.out, config, runs, markdown(runs), study)


if __name__ == "__main__":
    main()
