"""What one scheduler step costs on vLLM's side: vLLM's scheduler, the instrumented FCFS
baseline and Feather, each over the same running batch, no model.

    .venv/bin/python benchmarks/vllm/schedule_cost.py [--running 16 128] [--steps 300] \
        [--set NAME]

vLLM 0.32.0's real schedulers (sync variant) built for the embedded model with a KV cache
that never fills, ``running`` requests that share nothing (ShareGPT's case) decoding one
token a step, outputs fabricated (one token per request); median microseconds of
``schedule()`` and of ``update_from_output()`` over ``steps`` steps, the variants
alternated ``rounds`` times. Isolates the scheduler-side part of a step that the CPU
engine's ShareGPT rounds (``benchmarks/traces``) cannot tell from the worker's. Prints a
table and writes schedule_cost.json into results/NAME/ (default: the commit).
"""

from __future__ import annotations

import statistics
import time

import torch
from vllm.engine.arg_utils import EngineArgs
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from feather_sched.bench.study import Study, markdown_table, parser
from feather_sched.integrations.vllm.scheduler import FeatherSyncScheduler, InstrumentedScheduler
from feather_sched.models import TINY_LLAMA
from feather_sched.results.summary import median_and_range

BLOCK, BLOCKS = 16, 40_000
VARIANTS = {"vllm": (Scheduler, {}), "instrumented (fcfs)": (InstrumentedScheduler, {}),
            "feather-model": (FeatherSyncScheduler, {"gate": "model"})}


def build(scheduler_cls: type, feather: dict) -> Scheduler:
    args = EngineArgs(model=str(TINY_LLAMA), skip_tokenizer_init=True, load_format="dummy",
                      block_size=BLOCK, max_model_len=2048, max_num_seqs=256,
                      enable_prefix_caching=True, additional_config={"feather": feather})
    config = args.create_engine_config()
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=8, head_size=64,
                             dtype=torch.bfloat16)
    kv_cache = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[],
                             kv_cache_groups=[KVCacheGroupSpec(["layers.0", "layers.1"], spec)])
    config.cache_config.num_gpu_blocks = BLOCKS
    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache, config)
    return scheduler_cls(vllm_config=config, kv_cache_config=kv_cache,
                         structured_output_manager=StructuredOutputManager(config),
                         block_size=block_size, hash_block_size=hash_block_size,
                         log_stats=True)


def fabricated(scheduler: Scheduler, output: object) -> ModelRunnerOutput:
    """One sampled token for each request whose prompt is computed."""
    ids = list(output.num_scheduled_tokens)
    sampled = []
    for rid in ids:
        request = scheduler.requests[rid]
        sampled.append([7] if request.num_computed_tokens >= request.num_tokens else [])
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=sampled)


def measure(variant: str, running: int, steps: int) -> dict:
    scheduler_cls, feather = VARIANTS[variant]
    scheduler = build(scheduler_cls, feather)
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(BLOCK, hash_fn)
    params = SamplingParams(max_tokens=1_000_000, ignore_eos=True, temperature=0.0)
    for i in range(running):
        prompt = [1000 * (i + 1) + t for t in range(200)]
        scheduler.add_request(Request(request_id=f"r{i}", prompt_token_ids=prompt,
                                      sampling_params=params, pooling_params=None,
                                      arrival_time=time.time(), block_hasher=hasher))
    schedule_s, update_s = [], []
    for step in range(steps + 10):  # 10 to finish the prefills
        started = time.perf_counter()
        output = scheduler.schedule()
        scheduled = time.perf_counter()
        result = fabricated(scheduler, output)
        updating = time.perf_counter()
        scheduler.update_from_output(output, result)
        if step >= 10:
            schedule_s.append(scheduled - started)
            update_s.append(time.perf_counter() - updating)
    assert len(scheduler.running) == running
    return {"variant": variant, "running": running,
            "schedule_us": 1e6 * statistics.median(schedule_s),
            "update_from_output_us": 1e6 * statistics.median(update_s)}


def markdown(rows: list[dict]) -> str:
    """Per running count and variant: the median (range over rounds) of each call's
    median microseconds."""
    lines = []
    for running in dict.fromkeys(r["running"] for r in rows):
        for variant in VARIANTS:
            mine = [r for r in rows if r["variant"] == variant and r["running"] == running]
            lines.append([str(running), variant,
                          *(median_and_range([r[k] for r in mine], "{:.0f}")
                            for k in ("schedule_us", "update_from_output_us"))])
    return markdown_table(["running", "variant", "schedule() us", "update_from_output() us"],
                          lines)


def main() -> None:
    arguments = parser(__doc__)
    arguments.add_argument("--running", type=int, nargs="+", default=[16, 128])
    arguments.add_argument("--steps", type=int, default=300)
    arguments.add_argument("--rounds", type=int, default=3)
    args = arguments.parse_args()
    study = Study(__file__, set_name=args.set)
    rows = [measure(variant, running, args.steps) for _ in range(args.rounds)
            for running in args.running for variant in VARIANTS]
    study.write_json("schedule_cost", {"steps": args.steps, "rows": rows})
    print(markdown(rows))


if __name__ == "__main__":
    main()
