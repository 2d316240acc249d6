"""The end-to-end proof on vLLM (``attention.end_to_end``): the user's model served by
vLLM's engine in a fresh process per run, greedy, Feather's path ``on`` then ``off``, over
grouped and ungrouped batches, under the engine arguments given (so the engine's own
CUDA-graph mode), each run timed; the verdict kept under the key the kernel check uses
for that engine (the shapes its builders decided with).

``feather attention-check --end-to-end --model DIR`` runs it.  Each run's process
(``python -m feather_sched.integrations.vllm.attention_proof``) is the one engine it
holds, in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one rank), so the builders'
shapes are readable there (``attention_gpu.DECIDED``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from feather_sched.attention import end_to_end
from feather_sched.attention.end_to_end import EndToEnd, Outputs
from feather_sched.attention.selfcheck import Shapes

PREFIX_TOKENS, SUFFIX_TOKENS, NEW_TOKENS = 1024, 8, 32
GROUPS, PER_GROUP, SINGLES = 4, 8, 8
"""The check's batch: ``GROUPS`` groups of ``PER_GROUP`` prompts sharing a
``PREFIX_TOKENS`` prefix, and ``SINGLES`` prompts sharing nothing, each generating
``NEW_TOKENS`` greedily (a step holds grouped and ungrouped rows, then only ungrouped)."""
TIMEOUT_S = 1800.0


def prompts(vocabulary: int = 1000, seed: int = 0) -> list[list[int]]:
    """The check's prompts (token ids below ``vocabulary``, away from special ids)."""
    import random

    draw = random.Random(seed)

    def tokens(count: int) -> list[int]:
        return [draw.randrange(100, vocabulary) for _ in range(count)]

    grouped = [prefix + tokens(SUFFIX_TOKENS) for prefix in
               (tokens(PREFIX_TOKENS) for _ in range(GROUPS)) for _ in range(PER_GROUP)]
    return grouped + [tokens(PREFIX_TOKENS + SUFFIX_TOKENS) for _ in range(SINGLES)]


def run_engine(model: str, path_on: bool, engine_args: dict[str, Any]) -> dict[str, Any]:
    """One run in this process: the engine over ``prompts()``, greedy; its outputs, the
    seconds ``generate`` took and the shapes Feather's GPU builders decided with."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import time

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    option = {"shared_prefix_attention": "on" if path_on else "off"}
    llm = LLM(model=model, seed=0, additional_config={"feather": option}, **engine_args)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True,
                            detokenize=False)
    batch = [TokensPrompt(prompt_token_ids=p) for p in prompts()]
    start = time.perf_counter()
    results = llm.generate(batch, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    from feather_sched.integrations.vllm.attention_gpu import DECIDED

    return {"outputs": [list(r.outputs[0].token_ids) for r in results], "seconds": seconds,
            "shapes": [asdict(shape) for shape in DECIDED]}


def run_isolated(model: str, path_on: bool, engine_args: dict[str, Any],
                 timeout_s: float = TIMEOUT_S) -> dict[str, Any]:
    """``run_engine`` in a fresh process (one engine per process: its device memory all
    freed when it exits); RuntimeError with its stderr's end where it fails."""
    with tempfile.TemporaryDirectory(prefix="feather-proof-") as folder:
        answer = Path(folder) / "run.json"
        done = subprocess.run(
            [sys.executable, "-m", __name__, model, "on" if path_on else "off",
             json.dumps(engine_args), str(answer)], capture_output=True, text=True,
            timeout=timeout_s, env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
        if done.returncode != 0 or not answer.exists():
            raise RuntimeError(f"the {'on' if path_on else 'off'} run failed: "
                               f"{done.stderr[-2000:]}")
        return json.loads(answer.read_text())


def prove(model: str, engine_args: dict[str, Any]) -> tuple[EndToEnd | None, str]:
    """Both runs and their comparison, kept where a GPU builder decided (its shapes are
    the kernel check's key); the verdict (None where nothing could be kept: no GPU
    builder acted) and a line saying what was done."""
    runs: dict[bool, dict[str, Any]] = {}

    def engine(path_on: bool) -> tuple[Outputs, float]:
        runs[path_on] = run_isolated(model, path_on, engine_args)
        return runs[path_on]["outputs"], runs[path_on]["seconds"]

    placeholder = Shapes("unkept", 0, 0, 0, "", 0, "", 0, 0)
    verdict = end_to_end.compare(placeholder, engine)
    decided = {json.dumps(s, sort_keys=True) for s in runs[True]["shapes"]}
    if len(decided) != 1:
        return None, (f"{verdict.line()}; not kept: {len(decided)} GPU attention shapes "
                      "decided with the path on (one is needed: a GPU engine)")
    shapes = json.loads(decided.pop())
    shapes = Shapes(**{**shapes, "versions": tuple(map(tuple, shapes["versions"]))})
    kept = EndToEnd(verdict.passed, verdict.reason, shapes, verdict.tokens,
                    verdict.seconds_on, verdict.seconds_off)
    return kept, f"{kept.line()}; kept in {end_to_end.keep(kept)}"


if __name__ == "__main__":
    model_arg, state, engine_json, out = sys.argv[1:5]
    record = run_engine(model_arg, state == "on", json.loads(engine_json))
    Path(out).write_text(json.dumps(record))
