"""Decode attention of one layer on vLLM's CPU kernel: per request vs shared prefix.

For G prefix groups of M decoding requests (each with a P-token shared prefix and an
S-token private suffix), one layer's decode attention is timed three ways, side by side
in every round:

* ``sorted``: vLLM's kernel (``cpu_attention_with_kv_cache``), rows group by group
  (Feather's order);
* ``interleaved``: the same kernel, groups round-robin (an unordered batch);
* ``shared``: what ``shared_prefix_attention`` runs per layer: vLLM's kernel on the batch
  with the grouped rows cut to one token, then each group's prefix once for all its
  queries and each row's suffix (``feather_sched.attention.cpu_kernel``), merged.

Where the kernel multiplies an "amx" cache in AMX tiles, ``shared (registers)`` times
the same path in AVX-512 registers beside it. The KV cache is written through vLLM's own
``cpu_attn_reshape_and_cache`` (the ISA vLLM picks on this machine), block ids are
shuffled over the cache, and every configuration is checked against ``sorted`` before it
is timed. The per-step work done once for all layers (the plan and vLLM's scheduler
metadata) is timed separately. Each timing is the median of ``--reps`` calls;
``--rounds`` repeats the whole grid, and the table gives the median ratio over rounds with
its range.

Against the limit: per cell the prefix kernel alone (the groups' segments) is timed and
given as GFLOP/s and prefix-KV GB/s, beside this machine's ceilings measured in the same
round: a streaming read of the same bytes, oneDNN's bf16 ``torch.matmul`` of the same
shapes (per group and KV head: rows x prefix scores, then their product with V), and a
large bf16 ``torch.matmul`` (the GEMM peak). The floor is the larger of the cell's FLOPs
over the GEMM peak and its prefix bytes over the streaming rate.

Where ``auto`` acts: each round runs the engine's self-check for each model (as vLLM's
CPU engine runs it at start: ``max_num_seqs`` 256, a 32K context) and the table says in
how many rounds its verdict groups the cell (``auto groups``), so a cell slower than
vLLM's kernel where the path would act shows.

    .venv/bin/python benchmarks/attention/cpu_decode.py            # the grid, ~4 min
    .venv/bin/python benchmarks/attention/cpu_decode.py --quick    # 4 x 16 at 8K only
    .venv/bin/python benchmarks/attention/cpu_decode.py --cells 4x16x8192,4x16x1024 \
        --geometry llama-3-8b --threads 2                         # named cells

Writes STEM.json (every round's records, the summary) and STEM.md (the table) into
results/NAME/ (``--set NAME``, default the commit; ``--stem``, default cpu-decode).
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict

import ceilings
import torch

from feather_sched.attention import cpu_kernel, selfcheck
from feather_sched.attention.groups import min_blocks, plan_step
from feather_sched.attention.selfcheck import Cell
from feather_sched.bench.study import Study, markdown_table
from feather_sched.bench.study import parser as study_parser
from feather_sched.integrations.vllm.attention_check import CpuBatch, CpuSubject, Geometry

BLOCK = 128
MAX_ROWS = 256  # vLLM's default max_num_seqs
MAX_CONTEXT = 32768


GEOMETRIES = {
    "tiny-llama": Geometry(8, 8, 64),  # the embedded model: MHA
    "llama-3-8b": Geometry(32, 8, 128),  # GQA 4
}


def median_s(run: Callable[[], None], reps: int) -> tuple[float, list[float]]:
    run()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


def measure(batch: CpuBatch, reps: int) -> dict:
    """One round of one configuration: the paths, checked, then timed."""
    cell = batch.cell
    interleaved = batch.table.view(cell.groups, cell.per_group, -1).transpose(0, 1) \
        .reshape(cell.rows, -1)
    sorted_meta = batch.metadata(batch.seq_lens)

    def per_step() -> None:
        step = plan_step(batch.table, batch.seq_lens, batch.starts, cell.rows, BLOCK,
                         min_blocks(BLOCK))
        batch.metadata(step.seq_lens)

    expected = batch.engine().float().clone()
    error = float(((batch.shared().float() - expected).norm(dim=-1) /
                   expected.norm(dim=-1)).max())
    paths = [("sorted", batch.engine),
             ("interleaved", lambda: batch.kernel(batch.seq_lens, sorted_meta, interleaved)),
             ("shared", batch.shared), ("plan_per_step", per_step),
             ("prefix_kernel", prefix_kernel(batch)),
             *ceilings.same_bytes_and_shapes(batch)]
    if batch.isa == "amx" and cpu_kernel.tiles():
        paths.append(("shared_registers", lambda: batch.shared(use_tiles=False)))
    timings = {name: median_s(path, reps) for name, path in paths}
    return {"max_relative_difference": error, "grouped_rows": len(batch.plan.tokens),
            "gflop": ceilings.prefix_flop(batch) / 1e9,
            "prefix_gb": ceilings.prefix_bytes(batch) / 1e9,
            "seconds": {name: t[0] for name, t in timings.items()},
            "reps_s": {name: t[1] for name, t in timings.items()}}


def prefix_kernel(batch: CpuBatch) -> Callable[[], None]:
    """Feather's kernel over the groups' prefix segments alone (no suffix, no merge), as
    ``shared`` runs it (in tiles where the kernel has them)."""
    segments, groups = batch.plan.segments, batch.cell.groups
    rows = int(segments.token_offsets[groups])
    out = torch.empty(rows, *batch.query.shape[1:])
    lse = torch.empty(rows, batch.query.shape[1])
    args = (segments.token_offsets[:groups + 1].contiguous(), segments.tokens[:rows].contiguous(),
            segments.block_offsets[:groups + 1].contiguous(), segments.blocks,
            segments.lengths[:groups].contiguous(), out, lse, batch.isa)
    return lambda: cpu_kernel.segment_attention(batch.cache, batch.query, batch.scale, *args,
                                                use_tiles=True)


def grid(quick: bool, prefixes: list[int], cells: str | None) -> list[Cell]:
    if cells:
        return [Cell(int(p), int(g), int(m)) for g, m, p in
                (spec.split("x") for spec in cells.split(","))]
    if quick:
        return [Cell(8192, 4, 16)]
    return [Cell(p, g, m) for p in prefixes for g in (1, 4, 8) for m in (4, 16, 64)
            if g * m <= MAX_ROWS]


def summarize(records: list[dict]) -> list[dict]:
    """Per configuration: median seconds per path and median ratios over rounds."""
    rows = []
    keys = sorted({(r["geometry"], r["dtype"], *r["config"].values()) for r in records})
    for key in keys:
        mine = [r for r in records if (r["geometry"], r["dtype"], *r["config"].values()) == key]
        ratios = {name: [r["seconds"][name] / r["seconds"]["shared"] for r in mine]
                  for name in ("sorted", "interleaved")}
        rows.append({
            "geometry": key[0], "dtype": key[1], **mine[0]["config"], "rounds": len(mine),
            **{f"{name}_ms": 1e3 * statistics.median(r["seconds"][name] for r in mine)
               for name in mine[0]["seconds"]},
            **{f"{name}_over_shared": statistics.median(v) for name, v in ratios.items()},
            **{f"{name}_over_shared_range": [min(v), max(v)] for name, v in ratios.items()},
            **ceilings.against_the_limit(mine),
            "auto_groups": sum(r["auto_groups"] for r in mine),
            "max_relative_difference": max(r["max_relative_difference"] for r in mine)})
    return rows


def table(rows: list[dict]) -> str:
    def ratio(r: dict) -> str:
        low, high = r["sorted_over_shared_range"]
        return f"{r['sorted_over_shared']:.2f}x ({low:.2f}-{high:.2f})"

    return markdown_table(
        ["model", "dtype", "G x M", "prefix", "sorted ms", "interleaved ms", "shared ms",
         "sorted / shared (range)", "interleaved / shared", "plan per step ms",
         "kernel ms", "kernel GFLOP/s", "kernel GB/s", "floor ms", "kernel / floor",
         "same-shape matmul ms", "auto groups"],
        ([r["geometry"], r["dtype"], f"{r['groups']} x {r['per_group']}", str(r["prefix"]),
          f"{r['sorted_ms']:.2f}", f"{r['interleaved_ms']:.2f}", f"{r['shared_ms']:.2f}",
          ratio(r), f"{r['interleaved_over_shared']:.2f}x", f"{r['plan_per_step_ms']:.3f}",
          f"{r['prefix_kernel_ms']:.2f}", f"{r['kernel_gflops']:.0f}",
          f"{r['kernel_gbps']:.1f}", f"{r['floor_ms']:.2f}", f"{r['kernel_over_floor']:.2f}x",
          f"{r['matmul_same_shapes_ms']:.2f}", f"{r['auto_groups']}/{r['rounds']}"]
         for r in rows))


def main() -> None:
    parser = study_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="4 x 16 at 8K only")
    parser.add_argument("--cells", help="comma-separated GxMxPREFIX cells instead of the grid")
    parser.add_argument("--prefixes", default="2048,8192,16384",
                        help="comma-separated prefix lengths, multiples of 128 tokens")
    parser.add_argument("--geometry", default="tiny-llama,llama-3-8b",
                        help=f"comma-separated: {', '.join(GEOMETRIES)}")
    parser.add_argument("--dtype", default="bfloat16", help="bfloat16, float16 or float32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="as vLLM's CPU worker here")
    parser.add_argument("--stem", default="cpu-decode", help="name of the .json and .md")
    args = parser.parse_args()
    study = Study(__file__, set_name=args.set)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    records, peaks, verdicts = [], [], []
    cells = grid(args.quick, [int(p) for p in args.prefixes.split(",")], args.cells)
    for round_index in range(args.rounds):
        peaks.append(ceilings.gemm_peak_gflops(dtype))
        print(f"round {round_index}: bf16 GEMM peak {peaks[-1]:.0f} GFLOP/s", flush=True)
        for name in args.geometry.split(","):
            verdict = selfcheck.check(CpuSubject(GEOMETRIES[name], dtype, BLOCK, MAX_ROWS,
                                                 MAX_CONTEXT, ()))
            verdicts.append({"round": round_index, "geometry": name,
                             "verdict": verdict.to_json()})
            print(f"round {round_index} {name}: auto {verdict.line()}", flush=True)
            for config in cells:
                batch = CpuBatch(config, GEOMETRIES[name], dtype, BLOCK, seed=round_index)
                record = measure(batch, args.reps)
                records.append({"round": round_index, "geometry": name, "dtype": args.dtype,
                                "isa": batch.isa, "kernel_isa": cpu_kernel.isa(),
                                "gemm_peak_gflops": peaks[-1], "config": asdict(config),
                                "auto_groups": verdict.groups(config.per_group, config.prefix),
                                **record})
                s = record["seconds"]
                print(f"round {round_index} {name} {config}: sorted {1e3 * s['sorted']:.2f} ms, "
                      f"shared {1e3 * s['shared']:.2f} ms "
                      f"({s['sorted'] / s['shared']:.2f}x), "
                      f"max diff {record['max_relative_difference']:.1e}", flush=True)
    rows = summarize(records)
    study.write_json(args.stem, {
        "machine": platform.processor() or platform.machine(), "cpu": ceilings.cpu_name(),
        "threads": args.threads, "torch": torch.__version__, "kernel_isa": cpu_kernel.isa(),
        "gemm_peak_gflops": peaks, "summary": rows, "records": records,
        "verdicts": verdicts})
    study.write_markdown(args.stem, table(rows))


if __name__ == "__main__":
    main()
