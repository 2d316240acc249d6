"""Tenants in the simulator: Feather's fair share (``feather-model-fair``) against VTC, on
the issue's workload (one tenant floods from a shared prefix, others send unshared or
long-output requests).

    .venv/bin/python benchmarks/sim/tenants.py [--set NAME] [--seeds 3]     # ~15 s

Llama-3-8B on the H100 SXM profile, vLLM's limits, the device's KV pool.  The workload
is ``workloads.synthetic.multi_tenant`` (4 tenants: t0 sends 240 requests sharing an
8K-token prefix, t1 and t3 60 unshared 8K-token prompts each, t2 60 short prompts with
1,024-token outputs; 128 output tokens otherwise), Poisson at 40 req/s, over FCFS's
capacity.  Runs: ``vtc`` (VTC itself), ``feather-model`` (no fair share) and
``feather-model-fair``.  Ratios to VTC on the same seed: the largest service gap between
tenants while all are in the engine (target <= 1.5x), output tok/s (target >= 1.5x), and
the worst tenant's mean TTFT (target <= 1.25x); medians over the seeds with their range.
Writes tenants.json and tenants.md into results/NAME/ (default: the commit).
"""

from __future__ import annotations

from feather_sched.bench.study import MODEL, Study, markdown_table, parser, sim_plan, summaries
from feather_sched.results.summary import median_and_range as spread
from feather_sched.workloads.spec import ArrivalSpec, Workload
from feather_sched.workloads.synthetic import multi_tenant

SCHEDULERS = ("vtc", "feather-model", "feather-model-fair")
RATE = 40.0
FIGURES = ("output_throughput", "mean_ttft_ms", "max_service_gap", "by_tenant")


def workload(seed: int) -> Workload:
    return multi_tenant(tenants=4, requests_per_tenant=60, prefix_len=8192, suffix_len=64,
                        output_len=128, arrival=ArrivalSpec("poisson", RATE), seed=seed)


def ratios(runs: dict, name: str) -> dict[str, float]:
    """One seed's ratios of run ``name`` to VTC's."""
    ours, vtc = runs[name], runs["vtc"]
    return {
        "service gap": ours["max_service_gap"] / vtc["max_service_gap"],
        "throughput": ours["output_throughput"] / vtc["output_throughput"],
        "worst tenant TTFT": max(t["mean_ttft_ms"] / vtc["by_tenant"][k]["mean_ttft_ms"]
                                 for k, t in ours["by_tenant"].items()),
        **{f"{k} TTFT": t["mean_ttft_ms"] / vtc["by_tenant"][k]["mean_ttft_ms"]
           for k, t in ours["by_tenant"].items()},
    }


def main() -> None:
    args = parser(__doc__, seeds=3).parse_args()
    study = Study(__file__, set_name=args.set)
    seeds = []
    for seed in study.each(range(args.seeds), lambda s: f"seed {s}"):
        runs = summaries(sim_plan(workload(seed), "h100-sxm"), SCHEDULERS)
        seeds.append({name: {key: s[key] for key in FIGURES} for name, s in runs.items()})
    table = {name: [ratios(runs, name) for runs in seeds] for name in SCHEDULERS[1:]}
    study.save("tenants", {"hardware": "h100-sxm", "model": MODEL, "rate": RATE,
                           "seeds": list(range(args.seeds)), "runs": seeds,
                           "ratios_to_vtc": table}, markdown(seeds, table))


def markdown(seeds: list[dict], table: dict[str, list[dict]]) -> str:
    keys = list(next(iter(table.values()))[0])
    lines = ["# Tenants: fair share with prefix order vs VTC (simulator)", "",
             "`benchmarks/sim/tenants.py`: Llama-3-8B, H100 SXM profile, the multi-tenant "
             f"workload at {RATE:g} req/s; ratios to `vtc` on the same seed, medians over "
             f"{len(seeds)} seeds (range). Targets: service gap <= 1.5x, throughput >= "
             "1.5x, every tenant's mean TTFT <= 1.25x.", ""]
    rows = [[name, *(f"{spread([r[k] for r in runs])}x" for k in keys)]
            for name, runs in table.items()]
    lines += [markdown_table(["run", *keys], rows), "",
              "Per run (medians): output tok/s, largest service gap (weighted tokens), "
              "mean TTFT per tenant (s).", ""]
    tenants = list(seeds[0]["vtc"]["by_tenant"])
    rows = [[name, spread([s[name]["output_throughput"] for s in seeds], "{:,.0f}"),
             spread([s[name]["max_service_gap"] for s in seeds], "{:,.0f}"),
             *(spread([s[name]["by_tenant"][t]["mean_ttft_ms"] / 1e3 for s in seeds])
               for t in tenants)] for name in SCHEDULERS]
    lines.append(markdown_table(["run", "tok/s", "service gap", *tenants], rows))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
