"""The simulator's results table: Feather vs vLLM FCFS vs SGLang LPM / DFS-weight.

    .venv/bin/python benchmarks/sim/sweep.py [--quick] [--set NAME]

Llama-3-8B on RTX 6000 Ada and H100 SXM; shared prefixes of 1K, 5K and 10K tokens in 1, 8
and 100 groups, 800 requests, decode lengths 50 and 200; offline (all at once) and Poisson
arrivals at 1.5x FCFS's offline request rate (an overloaded server, where the scheduler
decides the throughput; below capacity every scheduler serves the arrival rate); plus no
sharing. Feather runs with its defaults (the overtaking bound on), with each gate (``model``
starts from the simulated GPU's profile, as a user would give theirs); "unbounded" runs
turn the bound off, to show the share of the gain the bound keeps. Writes sweep.json and
sweep.md into results/NAME/ (default: the commit).
"""

from __future__ import annotations

from feather_sched.bench.study import Study, markdown_table, parser, sim_plan, summaries
from feather_sched.workloads.spec import ArrivalSpec
from feather_sched.workloads.synthetic import no_sharing, shared_prefix_groups

SCHEDULERS = ("fcfs", "sglang-lpm", "sglang-dfs-weight", "feather-always",
              "feather-chunk-loss", "feather-bandit", "feather-model",
              "feather-always-unbounded", "feather-bandit-unbounded")

REQUESTS = 800
POISSON_LOAD = 1.5
SUFFIX = 32


def workload(groups: int | None, prefix: int, output: int, rate: float | None):
    arrival = None if rate is None else ArrivalSpec(kind="poisson", rate=rate)
    if groups is None:
        return no_sharing(requests=REQUESTS, prompt_len=prefix + SUFFIX, output_len=output,
                          arrival=arrival, seed=0)
    return shared_prefix_groups(groups=groups, prompts_per_group=REQUESTS // groups,
                                prefix_len=prefix, suffix_len=SUFFIX, output_len=output,
                                arrival=arrival, seed=0)


KEYS = ("request_throughput", "output_throughput", "mean_ttft_ms", "mean_tpot_ms",
        "mean_batch_size", "mean_groups_per_step", "hbm_bytes_per_output_token",
        "modelled_l2_hit_rate")
"""The figures each row keeps."""


def cell(hardware: str, groups: int | None, prefix: int, output: int) -> list[dict]:
    """Offline, then Poisson at 1.5x FCFS's offline request rate."""
    rows = []
    rate = None
    for mode in ("offline", "poisson"):
        plan = sim_plan(workload(groups, prefix, output, rate), hardware)
        for name, summary in summaries(plan, SCHEDULERS).items():
            rows.append({"hardware": hardware, "groups": groups or 0, "prefix": prefix,
                         "output": output, "mode": mode, "rate": rate, "scheduler": name,
                         **{k: summary[k] for k in KEYS}})
        rate = POISSON_LOAD * rows[0]["request_throughput"]
    return rows


def kept(by_name: dict[str, dict], name: str) -> str:
    """The share of the unbounded version's gain over FCFS that the bounded one keeps
    (where the unbounded gain is at least 5%)."""
    base = by_name["fcfs"]["output_throughput"]
    bounded = by_name[name]["output_throughput"] - base
    unbounded = by_name[f"{name}-unbounded"]["output_throughput"] - base
    return f"{100 * bounded / unbounded:.0f}%" if unbounded > 0.05 * base else "-"


def model_over_fixed(by_name: dict[str, dict]) -> float:
    """The model gate's throughput over the better of always-add and chunk-loss."""
    best = max(by_name[n]["output_throughput"] for n in ("feather-always", "feather-chunk-loss"))
    return by_name["feather-model"]["output_throughput"] / best


def markdown(rows: list[dict]) -> str:
    """One line per cell: output throughput of each scheduler as a ratio to FCFS, and the
    share of the gain the overtaking bound keeps."""
    cells: dict[tuple, dict[str, dict]] = {}
    for row in rows:
        key = tuple(row[k] for k in ("hardware", "groups", "prefix", "output", "mode"))
        cells.setdefault(key, {})[row["scheduler"]] = row
    lines = []
    for key, by_name in cells.items():
        base = by_name["fcfs"]["output_throughput"]
        ratios = [f"{by_name[n]['output_throughput'] / base:.2f}x" for n in SCHEDULERS[1:]]
        ratios += [kept(by_name, "feather-always"), kept(by_name, "feather-bandit"),
                   f"{model_over_fixed(by_name):.3f}"]
        groups = "none" if key[1] == 0 else key[1]
        lines.append([str(key[0]), str(groups), str(key[2]), str(key[3]), str(key[4]),
                     f"{base:,.0f}", *ratios])
    return markdown_table(
        ["hardware", "groups", "prefix", "output", "mode", "FCFS tok/s", *SCHEDULERS[1:],
         "gain kept (always)", "gain kept (bandit)", "model / best fixed gate"], lines)


def main() -> None:
    arguments = parser(__doc__)
    arguments.add_argument("--quick", action="store_true", help="one hardware, fewer cells")
    args = arguments.parse_args()
    hardware = ("h100-sxm",) if args.quick else ("rtx6000-ada", "h100-sxm")
    prefixes = (5120,) if args.quick else (1024, 5120, 10240)
    outputs = (50,) if args.quick else (50, 200)
    study = Study(__file__, set_name=args.set)
    rows = []
    for hw in hardware:
        for output in outputs:
            for prefix in prefixes:
                for groups in (1, 8, 100):
                    rows += cell(hw, groups, prefix, output)
                    study.progress(f"{hw} {groups} groups {prefix} prefix {output} out")
            rows += cell(hw, None, 1024, output)
    study.save("sweep", {"rows": rows}, markdown(rows))


if __name__ == "__main__":
    main()
