"""Tenants in the simulator: Feather's fair share (``feather-model-fair``) against VTC, on
the issue's workload (one tenant floods from a shared prefix, others send unshared or
long-output requests), in three cells; beside tenants flooding with documents, a
light interactive one; and many tenants, most of them light.

    .venv/bin/python benchmarks/sim/tenants.py [--set NAME] [--seeds 3] [--cells A,B] [--peers]

Llama-3-8B on the H100 SXM profile, vLLM's limits (256 seats).  The workload is
``workloads.synthetic.multi_tenant`` (4 tenants: t0 sends 240 requests sharing an
8K-token prefix, t1 and t3 60 requests each, t2 60 short prompts with 1,024-token
outputs; 128 output tokens otherwise), Poisson at 40 req/s, over FCFS's capacity.  The
cells:

* ``device pool``: the device's KV pool (26,674 blocks), t1 and t3 unshared 8K-token
  prompts.  The pool keeps t0's prefix cached under VTC too, so locality buys little.
* ``device pool, cascade``: the same with a decode kernel that reads each group's prefix
  once a step (the cost model's cascade term, ``--cascade``), for every run: what
  grouping t0's requests could buy where no prefix is evicted.
* ``tight pool``: where VTC's interleaving evicts prefixes: a pool of 3,000 blocks (48K
  tokens) and t1 and t3 each drawing their prompts from 4 prefixes of 8K tokens of their
  own (``prefixes_per_tenant=4``, DLPM's setting): 9 long prefixes, room for about five.
* ``interactive beside documents``: ``workloads.synthetic.document_tenants`` in a 12 GiB
  KV pool (6,144 blocks, 96K tokens): tenants docs0 and docs1 ask questions (16-64
  tokens, 256-token answers) about their own 16 private 8K-token documents each (each
  set larger than the pool), Poisson at 2.5 req/s each, while tenant chat sends 256-token
  unshared prompts with 1,024-token outputs at 0.5 req/s; 60 s.  The light interactive
  tenant is the one fair share must protect; targets: every tenant's mean TTFT <= 1.25x
  VTC's, throughput >= 1.3x, service gap <= 1x.
* ``100 tenants``: the same 12 GiB pool, 4 document tenants (24 private 8K-token
  documents each, 2.5 req/s each, 256-token answers) beside 96 light users, each
  appearing at a uniform moment of the 60 s and sending 1 to 3 unshared 1K-token prompts
  (256-token outputs) about 5 s apart: an overload, as multi-tenant fleets see at peaks.
  Targets: throughput >= 1.2x VTC's, the light users' mean TTFT (over all their
  requests) and every document tenant's <= 1.25x VTC's.
* ``1,000 users``: the per-user shape, 1,000 light users (1 or 2 prompts each) over 120 s
  beside the same document tenants; the same targets.

Runs: ``vtc`` (VTC itself, ``fairness: vtc``), ``feather-model`` (no fair share),
``feather-model-fair`` (a cache hit at half a computed token's price, the default), and
the same with hits free (``fair_hit_weight`` 0: computed tokens only) and at VTC's price
(1).  Ratios to VTC on the same seed: the largest service gap between tenants while all
are in the engine (target <= 1.5x), output tok/s (target >= 1.5x where locality
matters), and the worst tenant's mean TTFT (target <= 1.25x); medians over the seeds
with their range.  Writes tenants.json and tenants.md into results/NAME/ (default: the
commit).
"""

from __future__ import annotations

from peers import FCFS, SATURATED_BEST, peer_table

from feather_sched.bench.study import MODEL, Study, by_scheduler, markdown_table, parser, sim_plan
from feather_sched.results.summary import median_and_range as spread
from feather_sched.results.summary import pool_tenants, summarize
from feather_sched.sim.runner import simulate
from feather_sched.workloads.spec import ArrivalSpec, Workload
from feather_sched.workloads.synthetic import LIGHT_USER_PREFIX, document_tenants, multi_tenant

RUNS = {
    "vtc": ("vtc", {}),
    "feather-model": ("feather-model", {}),
    "feather-model-fair": ("feather-model-fair", {}),
    "feather-model-fair, hits free": ("feather-model-fair", {"fair_hit_weight": 0}),
    "feather-model-fair, hits at VTC's price": ("feather-model-fair", {"fair_hit_weight": 1}),
}
"""Each run's label: its scheduler and Feather options."""
PEERS = SATURATED_BEST
"""Each peer's knob at its best setting on peers.py's saturated shared-prefix grid (results
e1b38ec; every cell here is over FCFS's capacity too), not re-tuned per cell."""
PEER_RUNS = {FCFS: (FCFS, {}), **{name: (name, {}) for name in PEERS.values()}}
"""The peer rows' runs: FCFS, the baseline of their ratios, and each peer's setting."""
RATE = 40.0
FIGURES = ("output_throughput", "mean_ttft_ms", "max_service_gap", "prefix_cache_hit_rate",
           "preemptions", "by_tenant", "p99_ttft_ms", "mean_tpot_ms", "cold_p99_ttft_ms")
DOCUMENTS = {"documents_per_tenant": 16, "doc_len": 8192, "doc_output_len": 256,
             "doc_rate": 2.5, "chat_prompt_len": 256, "chat_output_len": 1024,
             "chat_rate": 0.5, "duration_s": 60.0}
"""The interactive cell's workload (``document_tenants``)."""
MANY = {**DOCUMENTS, "doc_tenants": 4, "documents_per_tenant": 24, "chat_rate": 0.0,
        "light_users": 96, "light_requests": 3, "light_prompt_len": 1024,
        "light_output_len": 256}
"""The 100-tenant cell's workload: 4 document tenants, 96 light users."""
PER_USER = {**MANY, "light_users": 1000, "light_requests": 2, "duration_s": 120.0}
"""The per-user cell's workload: 4 document tenants beside 1,000 user ids."""
LIGHT = "light users"
"""The tenants ``user0``, ``user1``, ... taken together in the tables (``pool_tenants``)."""
CELLS = {
    "device pool": {"prefixes_per_tenant": 0, "engine": {}},
    "device pool, cascade": {"prefixes_per_tenant": 0, "engine": {"cascade": True}},
    "tight pool": {"prefixes_per_tenant": 4, "engine": {"num_blocks": 3000}},
    "interactive beside documents": {"documents": DOCUMENTS,
                                     "engine": {"kv_cache_gib": 12}},
    "100 tenants": {"documents": MANY, "engine": {"kv_cache_gib": 12}},
    "1,000 users": {"documents": PER_USER, "engine": {"kv_cache_gib": 12}},
}
"""Each cell's workload (the multi-tenant one with its own prefixes for t1 and t3, or
``documents``) and its engine options (``sim_plan``'s)."""


def workload(seed: int, options: dict) -> Workload:
    """The cell's workload (``options``: a ``CELLS`` entry) on ``seed``."""
    if "documents" in options:
        return document_tenants(**options["documents"], seed=seed)
    return multi_tenant(tenants=4, requests_per_tenant=60, prefix_len=8192, suffix_len=64,
                        output_len=128, prefixes_per_tenant=options["prefixes_per_tenant"],
                        arrival=ArrivalSpec("poisson", RATE), seed=seed)


def ratios(runs: dict, name: str) -> dict[str, float]:
    """One seed's ratios of run ``name`` to VTC's."""
    ours, vtc = runs[name], runs["vtc"]
    gap = {} if vtc["max_service_gap"] is None else {
        "service gap": ours["max_service_gap"] / vtc["max_service_gap"]}
    return {
        **gap,
        "throughput": ours["output_throughput"] / vtc["output_throughput"],
        "worst tenant TTFT": max(t["mean_ttft_ms"] / vtc["by_tenant"][k]["mean_ttft_ms"]
                                 for k, t in ours["by_tenant"].items()),
        **{f"{k} TTFT": t["mean_ttft_ms"] / vtc["by_tenant"][k]["mean_ttft_ms"]
           for k, t in ours["by_tenant"].items()},
    }


def run_cell(study: Study, cell: str, seeds: int, runs_of: dict) -> dict:
    """A cell's runs (``runs_of``: label -> scheduler and Feather options) on every seed
    and their ratios to VTC."""
    options = CELLS[cell]
    per_seed = []
    for seed in study.each(range(seeds), lambda s: f"{cell}, seed {s}"):
        runs = {}
        for label, (name, feather_options) in runs_of.items():
            plan = sim_plan(workload(seed, options), "h100-sxm",
                            feather_options=feather_options, **options["engine"])
            summary = summarize(simulate(plan, name))
            summary["by_tenant"] = pool_tenants(summary["by_tenant"], LIGHT_USER_PREFIX, LIGHT)
            runs[label] = {key: summary[key] for key in FIGURES}
        per_seed.append(runs)
    return {"options": options, "runs": per_seed,
            "ratios_to_vtc": {label: [ratios(runs, label) for runs in per_seed]
                              for label in list(runs_of)[1:]}}


def main() -> None:
    arguments = parser(__doc__, seeds=3)
    arguments.add_argument("--cells", default=",".join(CELLS),
                           help=f"cells to run, comma-separated, of: {', '.join(CELLS)}")
    arguments.add_argument("--peers", action="store_true",
                           help="also run FCFS and each peer's knob (PEERS)")
    args = arguments.parse_args()
    study = Study(__file__, set_name=args.set)
    runs_of = {**RUNS, **(PEER_RUNS if args.peers else {})}
    cells = {cell: run_cell(study, cell, args.seeds, runs_of)
             for cell in args.cells.split(",")}
    study.save("tenants", {"hardware": "h100-sxm", "model": MODEL, "rate": RATE,
                           "seeds": list(range(args.seeds)),
                           "runs": {label: {"scheduler": name, "options": options}
                                    for label, (name, options) in runs_of.items()},
                           "peers": PEERS if args.peers else {},
                           "cells": cells},
               markdown(cells, args.seeds))


def markdown(cells: dict, seeds: int) -> str:
    lines = ["# Tenants: fair share with prefix order vs VTC (simulator)", "",
             "`benchmarks/sim/tenants.py`: Llama-3-8B, H100 SXM profile, the multi-tenant "
             f"workload at {RATE:g} req/s (the last cell: its own); ratios to `vtc` on the "
             f"same seed, medians over {seeds} seeds (range). Targets: service gap <= 1.5x, "
             "throughput >= 1.5x where the flood's prefix is shared, every tenant's mean "
             "TTFT <= 1.25x. The scheduler's wall-clock time is charged to the simulated "
             "clock (the simulator's default)."]
    for cell, result in cells.items():
        table, per_seed = result["ratios_to_vtc"], result["runs"]
        keys = list(next(iter(table.values()))[0])
        lines += ["", f"## {cell}: {describe(result['options'])}", "",
                  markdown_table(["run", *keys],
                                 [[name, *(f"{spread([r[k] for r in runs])}x" for k in keys)]
                                  for name, runs in table.items()]), "",
                  "Per run (medians): output tok/s, largest service gap (weighted tokens), "
                  "prefix-cache hit rate, preemptions, mean TTFT per tenant (s).", ""]
        tenants = list(per_seed[0]["vtc"]["by_tenant"])
        rows = [[name, spread([s[name]["output_throughput"] for s in per_seed], "{:,.0f}"),
                 gap_spread([s[name]["max_service_gap"] for s in per_seed]),
                 spread([s[name]["prefix_cache_hit_rate"] for s in per_seed]),
                 spread([s[name]["preemptions"] for s in per_seed], "{:,.0f}"),
                 *(spread([s[name]["by_tenant"][t]["mean_ttft_ms"] / 1e3 for s in per_seed])
                   for t in tenants)] for name in per_seed[0]]
        lines.append(markdown_table(["run", "tok/s", "service gap", "hit rate", "preemptions",
                                     *tenants], rows))
    if FCFS in next(iter(cells.values()))["runs"][0]:
        lines += ["", PEERS_NOTE, "", peer_table(peer_cells(cells), FAIR, FAIR)]
    return "\n".join(lines)


FAIR = "feather-model-fair"
PEERS_NOTE = (
    "## Peers' knobs (`--peers`)\n\nEach peer's knob at `PEERS`'s setting (the best on "
    "peers.py's saturated grid, e1b38ec, not re-tuned here): throughput, mean and p99 TTFT, "
    "TPOT and the cold requests' p99 TTFT over FCFS's on the same seed, and "
    f"`{FAIR}`'s over the peer's; the last row of a cell is `{FAIR}` over FCFS and over "
    "the peer with the best median throughput. Medians over the seeds (range).")


def peer_cells(cells: dict) -> list[dict]:
    """The cells as ``peers.peer_table`` reads them, each by output throughput."""
    return [{"name": cell, "objective": "output_throughput", "best": PEERS,
             "runs": by_scheduler(result["runs"])} for cell, result in cells.items()]


def gap_spread(gaps: list[float | None]) -> str:
    """The service gaps' median and range; n/a where no interval had every tenant in the
    engine (light users come and go)."""
    return "n/a" if None in gaps else spread(gaps, "{:,.0f}")


def describe(options: dict) -> str:
    if "documents" in options:
        docs = options["documents"]
        tenants = docs.get("doc_tenants", 2)
        text = (f"a {options['engine']['kv_cache_gib']:g} GiB KV pool, {tenants} document "
                f"tenants asking about {docs['documents_per_tenant']} private "
                f"{docs['doc_len'] // 1024}K-token documents each at {docs['doc_rate']:g} "
                "req/s, ")
        if docs.get("light_users"):
            return text + (
                f"{docs['light_users']:,} light users each sending 1 to "
                f"{docs['light_requests']} unshared {docs['light_prompt_len']}-token prompts "
                f"({docs['light_output_len']}-token outputs) from a moment of their own, "
                f"{docs['duration_s']:g} s; targets: throughput >= 1.2x, the light users' "
                "and every document tenant's mean TTFT <= 1.25x")
        return text + (f"chat: {docs['chat_prompt_len']}-token unshared prompts, "
                       f"{docs['chat_output_len']}-token outputs at {docs['chat_rate']:g} "
                       "req/s; targets here: throughput >= 1.3x, service gap <= 1x")
    pool = options["engine"].get("num_blocks")
    prefixes = options["prefixes_per_tenant"]
    where = "the device's KV pool" if pool is None else f"a {pool:,}-block KV pool"
    prompts = f"behind {prefixes} 8K prefixes each" if prefixes else "unshared 8K prompts"
    kernel = ", a decode kernel reading each prefix once a step (cascade), every run" \
        if options["engine"].get("cascade") else ""
    return f"{where}, t1 and t3 {prompts}{kernel}"


if __name__ == "__main__":
    main()
