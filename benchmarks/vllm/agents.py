"""Agent programs in a closed loop on the real vLLM 0.32 CPU engine (issue 62): vLLM's own
scheduler (fcfs), Feather (feather-model) and Feather with agent sessions
(feather-model + ``sessions``), alternated ``--rounds`` times, each run a fresh engine.

The programs are ``workloads.agents.agent_programs`` scaled to the 2-core CPU (shape
below): turn ``t + 1`` of a program is submitted its tool time after turn ``t`` ended,
its prompt turn ``t``'s prompt, the tokens the engine actually generated (greedy) and the
tool's output, so a turn extends its predecessor as an agent's does.  Per run: mean and
p90 program JCT (first turn submitted to last turn finished), mean and p90 TTFT of
continuing turns, the share of continuing turns' prompt tokens vLLM found cached, the
sessions' counts, each turn's output tokens: every run's are compared with the first fcfs
run's (greedy: they must be equal).  The engine core runs in this process (the
scheduler's counts are read from it).  Writes agents.json (every turn of every run) and
agents.md (medians over rounds, with ranges) into ``--out``.

    PYTHONPATH=src .venv/bin/python benchmarks/vllm/agents.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from feather_sched.bench.offline import engine_kwargs, scheduler_specs
from feather_sched.models import TINY_LLAMA
from feather_sched.workloads.agents import AgentShape, LogNormal, agent_programs
from feather_sched.workloads.spec import ArrivalSpec

SHAPE = AgentShape(
    agent_types=2,
    system_tokens=LogNormal(384, 0.2, 256, 512),
    task_tokens=LogNormal(96, 0.4, 32, 192),
    turns=LogNormal(4, 0.3, 3, 6),
    output_tokens=LogNormal(16, 0.4, 8, 32),
    tool_output_tokens=LogNormal(64, 0.6, 16, 160),
    tool_s=LogNormal(0.5, 0.5, 0.1, 2.0),
)
"""The default shape divided by about 8 in tokens and 4 in tool time: a run takes tens of
seconds on 2 cores."""


def run(spec, programs, kv_gib: float, block: int) -> dict:
    """One scheduler's closed-loop run of ``programs`` on a fresh engine."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    longest = max(p.turns[-1].spec.prompt.size + 64 * len(p.turns) for p in programs)
    with tempfile.TemporaryDirectory() as scratch:
        args = engine_kwargs(spec, Path(scratch) / "stats.json", str(TINY_LLAMA), {
            "block_size": block, "max_model_len": -(-longest // block) * block + block,
            "kv_cache_memory_bytes": int(kv_gib * 2**30)})
        llm = LLM(**args)
        engine = llm.llm_engine
        try:
            turns = drive(engine, programs, SamplingParams, TokensPrompt)
            sessions = getattr(engine.engine_core.engine_core.scheduler.feather, "sessions",
                               None)
            counts = None if sessions is None else vars(sessions.sessions.counts).copy()
            return {"turns": turns, "session_counts": counts}
        finally:
            engine.engine_core.shutdown()


def drive(engine, programs, sampling, tokens_prompt) -> dict:
    """Submit each program's turns as their predecessors end (plus tool time); step."""
    start = time.perf_counter()
    due = {p.program: (p.start_s, 0, p.turns[0].spec.prompt.tolist()) for p in programs}
    by_id = {p.program: p for p in programs}
    turns: dict[str, dict] = {}
    while due or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        for index, (at, t, prompt) in sorted(due.items()):
            if at <= now:
                del due[index]
                spec = by_id[index].turns[t].spec
                rid = f"p{index}-t{t}"
                engine.add_request(rid, tokens_prompt(prompt_token_ids=prompt), sampling(
                    max_tokens=spec.output_len, min_tokens=spec.output_len, ignore_eos=True,
                    temperature=0.0))
                turns[rid] = {"program": index, "turn": t, "prompt": len(prompt),
                              "submitted_s": now, "prompt_ids": prompt, "output": []}
        if not engine.has_unfinished_requests():
            time.sleep(0.005)
            continue
        for output in engine.step():
            record, now = turns[output.request_id], time.perf_counter() - start
            tokens = list(output.outputs[0].token_ids)
            if tokens and "first_token_s" not in record:
                record["first_token_s"] = now
            if output.finished:
                record["finished_s"], record["output"] = now, tokens
                record["cached"] = output.num_cached_tokens
                follow(record, by_id[record["program"]], due, now)
    for record in turns.values():
        del record["prompt_ids"]
    return turns


def follow(record: dict, program, due: dict, now: float) -> None:
    """The program's next turn: due its tool time from now, on the real output."""
    t = record["turn"] + 1
    if t >= len(program.turns):
        return
    previous, spec = program.turns[t - 1].spec, program.turns[t].spec
    tool = spec.prompt[previous.prompt.size + previous.output_len:].tolist()
    due[program.program] = (now + program.turns[t].tool_s, t,
                            record["prompt_ids"] + record["output"] + tool)


def summary(turns: dict) -> dict:
    programs: dict[int, list] = {}
    for record in turns.values():
        programs.setdefault(record["program"], []).append(record)
    jct = [max(r["finished_s"] for r in rs) - min(r["submitted_s"] for r in rs)
           for rs in programs.values()]
    ttft = [r["first_token_s"] - r["submitted_s"] for r in turns.values()]
    later = [r["first_token_s"] - r["submitted_s"] for r in turns.values() if r["turn"]]
    cached = sum(r["cached"] or 0 for r in turns.values() if r["turn"])
    prompts = sum(r["prompt"] for r in turns.values() if r["turn"])
    return {"mean_jct_s": float(np.mean(jct)), "p90_jct_s": float(np.percentile(jct, 90)),
            "continuing_cached_share": cached / prompts,
            "mean_ttft_s": float(np.mean(ttft)),
            "mean_ttft_continuing_s": float(np.mean(later)),
            "p90_ttft_continuing_s": float(np.percentile(later, 90))}


def table(runs: list[dict], cpu: str, settings: dict) -> str:
    names = list(dict.fromkeys(r["scheduler"] for r in runs))
    metrics = list(runs[0]["summary"])
    fcfs = {m: statistics.median(r["summary"][m] for r in runs if r["scheduler"] == "fcfs")
            for m in metrics}
    lines = [f"# Agent programs on the real vLLM CPU engine\n\nCPU: {cpu}\n",
             f"Settings: `{json.dumps(settings)}`\n",
             "Medians over rounds (min-max); ratio: the median over fcfs's median.\n",
             "| scheduler | " + " | ".join(metrics) + " | outputs equal fcfs |",
             "|---" * (len(metrics) + 2) + "|"]
    for name in names:
        mine = [r for r in runs if r["scheduler"] == name]
        cells = []
        for m in metrics:
            values = [r["summary"][m] for r in mine]
            med = statistics.median(values)
            cells.append(f"{med:.3f} ({min(values):.3f}-{max(values):.3f}) "
                         f"x{med / fcfs[m]:.2f}")
        equal = all(r["outputs_equal_first_fcfs"] for r in mine)
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {equal} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the scheduler's counts, in-process
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--programs", type=int, default=12)
    parser.add_argument("--rate", type=float, default=1.0, help="program starts a second")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kv-gib", type=float, default=0.012)
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--held-share", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    programs = agent_programs(programs=args.programs, arrival=ArrivalSpec("poisson", args.rate),
                              shape=SHAPE, seed=args.seed).programs
    fcfs, feather = scheduler_specs(["fcfs", "feather-model"], {})
    sessions = replace(feather, name="feather-model+sessions",
                       feather={**feather.feather, "sessions": True,
                                "session_held_share": args.held_share})
    runs, reference = [], None
    for round_ in range(args.rounds):
        for spec in (fcfs, feather, sessions):
            result = run(spec, programs, args.kv_gib, args.block)
            turns = result["turns"]
            outputs = {rid: r["output"] for rid, r in turns.items()}
            reference = reference or outputs
            runs.append({"scheduler": spec.name, "round": round_, "summary": summary(turns),
                         "outputs_equal_first_fcfs": outputs == reference,
                         "session_counts": result["session_counts"], "turns": turns})
            print(spec.name, round_, runs[-1]["summary"], runs[-1]["outputs_equal_first_fcfs"],
                  result["session_counts"], flush=True)
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in cpu.splitlines()
                  if line.startswith("Model name")), platform.processor())
    cores = next((line.split(":", 1)[1].strip() for line in cpu.splitlines()
                  if line.startswith("CPU(s)")), "?")
    settings = {k: str(v) for k, v in vars(args).items() if k != "out"}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "agents.json").write_text(json.dumps(
        {"settings": settings, "cpu": f"{model}, {cores} CPUs", "runs": runs}, indent=1))
    (args.out / "agents.md").write_text(table(runs, f"{model}, {cores} CPUs", settings))
    print((args.out / "agents.md").read_text())


if __name__ == "__main__":
    main()
