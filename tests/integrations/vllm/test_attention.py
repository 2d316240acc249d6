"""Shared-prefix attention inside the real vLLM CPU engine (in-process, tiny random model)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
vllm = pytest.importorskip("vllm", reason="the vllm extra is not installed")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import (  # noqa: E402
    CPUAttentionBackendImpl,
    _get_attn_isa,
)

from feather_sched.attention import cpu_kernel, isolation, selfcheck  # noqa: E402
from feather_sched.attention.partials import reference_attention  # noqa: E402
from feather_sched.integrations.vllm import attention as vllm_attention  # noqa: E402
from feather_sched.integrations.vllm import (  # noqa: E402
    attention_check,
    attention_choice,
    backends,
)
from feather_sched.integrations.vllm.attention import (  # noqa: E402
    SharedPrefixCPUImpl,
    SharedPrefixMetadata,
)
from feather_sched.models import TINY_LLAMA  # noqa: E402
from tests.helpers.kv_layouts import read_tokens, write_cache  # noqa: E402
from tests.helpers.timers import timed_as  # noqa: E402
from tests.helpers.vllm_engines import shut_down  # noqa: E402

BLOCK = 128
FEATHER = "feather_sched.integrations.vllm.FeatherScheduler"
SHORT_PREFIXES = {"shared_prefix_min_tokens": 256}
"""These tests' prefixes are 421-1,061 tokens: below the default threshold of the "amx"
layout (vLLM's bf16 cache on CPUs with AMX), so they set the "vec" layout's."""


def make_llm(dtype: str, feather: dict | None = None, scheduler: str | None = FEATHER,
             kv_blocks: int = 256, batched_tokens: int = 4096, max_model_len: int = 2048) -> LLM:
    """The tiny model with its dummy weights scaled up: vLLM draws them from +-1e-3, which
    leaves attention near uniform; +-0.3 gives scores of order 1 and peaked softmaxes."""
    extra = {"scheduler_cls": scheduler} if scheduler else {}
    if feather is not None:
        extra["additional_config"] = {"feather": feather}
    bytes_per_token = 2 * 8 * 64 * 2 * (4 if dtype == "float32" else 2)
    llm = LLM(model=str(TINY_LLAMA), load_format="dummy", skip_tokenizer_init=True,
              enforce_eager=True, seed=0, max_model_len=max_model_len, block_size=BLOCK,
              dtype=dtype,
              kv_cache_memory_bytes=kv_blocks * BLOCK * bytes_per_token,
              max_num_batched_tokens=batched_tokens, **extra)
    llm.apply_model(lambda model: [p.data.mul_(300) for p in model.parameters()])
    return llm


def mixed_prompts(seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """Three prefix groups (prefixes ending mid-block), singletons, varied suffixes and
    output lengths, interleaved."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(1, 32000, n * BLOCK + 37).tolist() for n in (5, 3, 8)]
    prompts = [prefixes[i % 3] + rng.integers(1, 32000, int(rng.integers(3, 300))).tolist()
               for i in range(21)]
    prompts[5:5] = [rng.integers(1, 32000, 900).tolist() for _ in range(3)]
    return prompts, [int(rng.integers(8, 160)) for _ in prompts]


def generate(llm: LLM, prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                           use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture
def grouped_rows(monkeypatch):
    """Counts the rows the engine's shared-prefix path computed, over every layer and step
    (not the self-check's trials, which call the kernel module directly)."""
    counted = []

    class Counting:
        def __getattr__(self, name):
            return getattr(cpu_kernel, name)

        def attend_groups(self, plan, *args):
            counted.append(len(plan.tokens))
            return cpu_kernel.attend_groups(plan, *args)

    monkeypatch.setattr(vllm_attention, "cpu_kernel", Counting())
    return counted


@pytest.fixture(scope="module")
def stock_fp32_outputs():
    prompts, lengths = mixed_prompts()
    llm = make_llm("float32", scheduler=None, kv_blocks=30, batched_tokens=512)
    outputs = generate(llm, prompts, lengths)
    shut_down(llm)
    return prompts, lengths, outputs


def test_fp32_greedy_outputs_equal_vllms_own_scheduler_and_kernel(stock_fp32_outputs,
                                                                   grouped_rows, monkeypatch):
    # 30 blocks of KV for ~45 blocks of prompts: preemptions; 512 batched tokens: prompts
    # prefill in chunks beside decoding rows.
    from vllm.v1.core.sched.scheduler import Scheduler

    preempted = []
    original = Scheduler._preempt_request

    def counting(self, request, *args, **kwargs):
        preempted.append(request.request_id)
        return original(self, request, *args, **kwargs)

    monkeypatch.setattr(Scheduler, "_preempt_request", counting)
    prompts, lengths, expected = stock_fp32_outputs
    llm = make_llm("float32", {"gate": "always", "shared_prefix_attention": "on"},
                   kv_blocks=30, batched_tokens=512)
    assert generate(llm, prompts, lengths) == expected
    assert preempted
    assert sum(grouped_rows) > 100


def test_an_engine_with_the_option_off_runs_vllms_path(stock_fp32_outputs, grouped_rows):
    prompts, lengths, expected = stock_fp32_outputs
    llm = make_llm("float32", {"shared_prefix_attention": "off"}, kv_blocks=40,
                   batched_tokens=512)
    assert generate(llm, prompts[:6], lengths[:6]) == expected[:6]
    assert grouped_rows == []


def test_auto_stays_off_under_vllms_scheduler_and_on_turns_it_on(grouped_rows):
    prompts, lengths = mixed_prompts(1)
    generate(make_llm("bfloat16", scheduler=None), prompts[:9], lengths[:9])
    assert grouped_rows == []
    generate(make_llm("bfloat16", {"shared_prefix_attention": "on", **SHORT_PREFIXES},
                      scheduler=None), prompts[:9], lengths[:9])
    assert sum(grouped_rows) > 0


@pytest.mark.parametrize("faster", [True, False])
def test_auto_is_what_the_self_check_measured(faster, grouped_rows, monkeypatch, tmp_path,
                                               self_check_here):
    """Auto (the default, with FeatherScheduler) asks the self-check at engine start: on,
    with its line in the log, where the path measured exact and faster than vLLM's kernel;
    off, with the figures, where it measured slower."""
    monkeypatch.setenv("FEATHER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(attention_check.CpuSubject, "seconds", timed_as(0 if faster else None))
    messages = []
    monkeypatch.setattr(vllm_attention, "announce", messages.append)
    prompts, lengths = mixed_prompts(1)
    generate(make_llm("bfloat16", SHORT_PREFIXES), prompts[:9], lengths[:9])
    assert (sum(grouped_rows) > 0) is faster
    line = next(m for m in messages if "self-check on" in m)
    assert line.startswith("on (self-check" if faster else "off (self-check"), line
    assert "max error" in line and ("2.00x at" in line if faster else "0.50x at" in line)
    assert faster or "not faster than the engine's kernel" in line
    assert list(tmp_path.glob("attention-check/*.json"))  # kept: a restart costs nothing


def test_a_check_that_raises_still_votes_so_no_rank_waits_on_it(monkeypatch):
    """Every tensor-parallel rank votes (``agreed``) whatever its own check did: a rank
    whose check raised votes off rather than leaving the others in the all-reduce."""
    votes = []
    monkeypatch.setattr(attention_choice, "agreed",
                        lambda verdict: votes.append(verdict) or verdict)

    def failing():
        raise RuntimeError("out of memory")

    assert attention_choice.checked(failing) == (
        None, "off: the self-check could not run (out of memory)")
    assert votes == [None]


@pytest.mark.skipif("amx_bf16" not in cpu_kernel._cpu_flags(),
                    reason="no AMX on this CPU: the tile path's check is not isolated here")
def test_on_an_amx_cpu_auto_checks_the_tiles_in_a_child_and_multiplies_in_them_if_on(
        grouped_rows, monkeypatch, tmp_path):
    """The engine's real self-check runs in a process of its own (a fault in tile registers
    cannot reach the engine; only that process's peak memory is reported) and measures the
    AMX tile path at the engine's shapes; where it finds it faster (as it does on a quiet
    AMX Xeon) the engine groups its rows and multiplies in tiles, says so, and gives the
    greedy tokens it gives with the path off; where a loaded machine measured it slower,
    nothing groups."""
    monkeypatch.setenv("FEATHER_CACHE_DIR", str(tmp_path))
    messages = []
    monkeypatch.setattr(vllm_attention, "announce", messages.append)
    prompts, lengths = mixed_prompts(1)
    tiled = generate(make_llm("bfloat16", SHORT_PREFIXES, max_model_len=16384), prompts,
                     lengths)
    line = next(m for m in messages if "self-check on" in m)
    assert "its process's peak host memory" in line, line
    if line.startswith("off (self-check"):
        assert sum(grouped_rows) == 0, line
        return
    assert "kernel in amx tiles" in line and sum(grouped_rows) > 0, line
    off = make_llm("bfloat16", {"shared_prefix_attention": "off"}, max_model_len=16384)
    assert generate(off, prompts, lengths) == tiled  # greedy: the same tokens


def test_a_self_check_that_cannot_run_leaves_auto_off_and_the_engine_up(
        grouped_rows, monkeypatch, tmp_path, self_check_here):
    monkeypatch.setenv("FEATHER_CACHE_DIR", str(tmp_path))

    def broken(*args):
        raise RuntimeError("no kernel here")

    monkeypatch.setattr(attention_check.CpuBatch, "__init__", broken)
    messages = []
    monkeypatch.setattr(vllm_attention, "announce", messages.append)
    prompts, lengths = mixed_prompts(1)
    assert len(generate(make_llm("bfloat16", SHORT_PREFIXES), prompts[:3], lengths[:3])) == 3
    assert sum(grouped_rows) == 0
    assert "off: the self-check could not run (no kernel here)" in messages


def test_auto_groups_from_the_measured_break_even_of_each_group_size(
        monkeypatch, tmp_path, self_check_here):
    """Lone groups of 4 measured faster from 1,024 tokens, groups of 16 from 512: the
    builder plans with both, so groups of 7 rows over a 677-token prefix stay vLLM's."""
    monkeypatch.setenv("FEATHER_CACHE_DIR", str(tmp_path))
    small, large = timed_as(1024), timed_as(512)
    monkeypatch.setattr(attention_check.CpuSubject, "seconds", lambda subject, run, reps: (
        small if run.__self__.cell.per_group < 16 else large)(subject, run, reps))
    messages, planned = [], []
    monkeypatch.setattr(vllm_attention, "announce", messages.append)
    original = vllm_attention.plan_step
    monkeypatch.setattr(vllm_attention, "plan_step", lambda *args: planned.append(
        plan := original(*args)) or plan)
    prompts, lengths = mixed_prompts(1)
    generate(make_llm("bfloat16", {}), prompts, lengths)
    assert any(m.startswith("on (self-check") and "groups from 512 shared tokens" in m
               and "by size: 4+ rows from 1024, 16+ rows from 512" in m
               for m in messages), messages
    shared = {int(n) for plan in planned if plan for n in plan.groups.shared}
    assert shared and min(shared) * BLOCK >= 1024


def test_steps_whose_rows_are_shorter_than_the_threshold_are_not_planned(monkeypatch):
    """No row can hold a 4,096-token prefix in a 2,048-token model: no step is planned."""
    planned = []
    original = vllm_attention.plan_step
    monkeypatch.setattr(vllm_attention, "plan_step",
                        lambda *args: planned.append(args) or original(*args))
    prompts, lengths = mixed_prompts(1)
    generate(make_llm("bfloat16", {"shared_prefix_attention": "on",
                                   "shared_prefix_min_tokens": 4096}), prompts[:9], lengths[:9])
    assert planned == []
    generate(make_llm("bfloat16", {"shared_prefix_attention": "on", **SHORT_PREFIXES}),
             prompts[:9], lengths[:9])
    assert planned


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_on_groups_from_the_kv_layouts_threshold_unless_set(dtype, monkeypatch):
    """With the option on (no self-check), the shortest prefix grouped is the kernel's
    crossover for the layout vLLM picks on this CPU (``cpu_kernel.MIN_SHARED_TOKENS_BY_LAYOUT``);
    the option ``shared_prefix_min_tokens`` sets it."""
    messages = []
    monkeypatch.setattr(vllm_attention, "announce", messages.append)
    isa = _get_attn_isa(getattr(torch, dtype), BLOCK, 64, "auto")
    default = -(-cpu_kernel.MIN_SHARED_TOKENS_BY_LAYOUT[isa] // BLOCK)
    for options, blocks in (({}, default), ({"shared_prefix_min_tokens": 300}, 3)):
        make_llm(dtype, {"shared_prefix_attention": "on", **options})
        assert any(f"isa {isa}" in m and f"groups from {blocks} shared blocks" in m
                   for m in messages), messages
        messages.clear()


def _vllm_build_has_amx() -> bool:
    """Whether this CPU loads vLLM's AVX-512-BF16 build, the one with the AMX layout
    (``vllm.platforms.cpu.CpuPlatform.import_kernels``)."""
    return torch.cpu._is_avx512_supported() and torch.cpu._is_avx512_bf16_supported()


@pytest.mark.parametrize(("isa", "dtype"), [("vec", torch.float32), ("vec", torch.bfloat16),
                                            ("amx", torch.bfloat16)])
def test_vllms_cache_writer_lays_out_what_the_kernel_reads(isa, dtype):
    """vLLM's own ``reshape_and_cache`` for each layout the kernel reads writes what
    ``tests/helpers/kv_layouts`` (the kernel tests' caches) writes, token for token.

    vLLM compiles the AMX layout only into its AVX-512-BF16 build (``vllm._C``; the AVX2
    and plain AVX-512 builds lack it): on a CPU that loads another build, vLLM must never
    pick that layout, and its writer must refuse it."""
    from vllm import _custom_ops as ops

    torch.manual_seed(0)
    blocks, heads, dim = 3, 2, 64
    keys = torch.randn(blocks * BLOCK, heads, dim).to(dtype)
    values = torch.randn(blocks * BLOCK, heads, dim).to(dtype)
    cache = torch.zeros(blocks, heads, BLOCK, 2 * dim, dtype=dtype)
    key_cache, value_cache = cache.view(blocks, heads, 2 * BLOCK, dim).chunk(2, dim=2)
    slots = torch.randperm(blocks * BLOCK)  # tokens written in any order land in place
    def write() -> None:
        ops.cpu_attn_reshape_and_cache(keys[slots], values[slots], key_cache, value_cache,
                                       slots, isa)

    if isa == "amx" and not _vllm_build_has_amx():
        assert _get_attn_isa(dtype, BLOCK, dim, "auto") != "amx"
        with pytest.raises(RuntimeError, match="Unsupported CPU attention configuration"):
            write()
        return
    write()
    assert torch.equal(cache, write_cache(keys, values, BLOCK, isa))
    read_keys, read_values = read_tokens(cache, torch.tensor([2, 0]), BLOCK + 5, isa)
    picked = torch.cat([torch.arange(2 * BLOCK, 3 * BLOCK), torch.arange(5)])
    assert torch.equal(read_keys, keys[picked]) and torch.equal(read_values, values[picked])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_each_layer_matches_vllms_kernel_and_the_float64_reference(dtype, monkeypatch):
    """Every grouped row of every layer and step, against vLLM's kernel run on the same
    inputs with the unmodified metadata, and both against float64 attention."""
    worst = {"vs_kernel": 0.0, "ours": 0.0, "kernel": 0.0, "rows": 0, "layouts": set()}
    original = SharedPrefixCPUImpl.forward

    def checking(self, layer, query, key, value, kv_cache, metadata, output, **rest):
        result = original(self, layer, query, key, value, kv_cache, metadata, output, **rest)
        if isinstance(metadata, SharedPrefixMetadata):
            stock = torch.empty_like(output)
            CPUAttentionBackendImpl.forward(self, layer, query, key, value, kv_cache,
                                            metadata.original, stock)
            compare(self, layer.isa, query, kv_cache, metadata, output, stock)
        return result

    def compare(impl, isa, query, kv_cache, metadata, ours, stock):
        plan = metadata.plan
        worst["layouts"].add(isa)
        for row, token in zip(plan.groups.rows, plan.tokens.tolist(), strict=True):
            keys, values = read_tokens(kv_cache, metadata.original.block_table[row],
                                       int(metadata.original.seq_lens[row]), isa)
            expected, _ = reference_attention(query[token], keys, values, impl.scale)
            scale = expected.abs().max()
            for name, error in (("vs_kernel", ours[token].double() - stock[token].double()),
                                ("ours", ours[token].double() - expected),
                                ("kernel", stock[token].double() - expected)):
                worst[name] = max(worst[name], float(error.abs().max() / scale))
            worst["rows"] += 1

    monkeypatch.setattr(SharedPrefixCPUImpl, "forward", checking)
    prompts, _ = mixed_prompts(2)
    generate(make_llm(dtype, {"gate": "always", "shared_prefix_attention": "on",
                              **SHORT_PREFIXES}, batched_tokens=1024), prompts[:15], [8] * 15)
    assert worst["rows"] > 100
    amx = dtype == "bfloat16" and torch.cpu._is_amx_tile_supported()  # vLLM's choice
    assert worst["layouts"] == {"amx" if amx else "vec"}, worst
    if dtype == "float32":  # errors relative to each row's largest output
        assert worst["vs_kernel"] < 1e-5, worst
    # Exact fp32 partials rounded once: no worse than vLLM's own kernel against float64.
    assert worst["ours"] <= worst["kernel"] * 1.05, worst


def test_layers_the_kernel_cannot_serve_say_why():
    impl = object.__new__(SharedPrefixCPUImpl)
    impl.attn_type, impl.sliding_window, impl.alibi_slopes = "decoder", 4096, None
    impl.logits_soft_cap, impl.sinks, impl.kv_cache_dtype = 0, None, "auto"
    impl.head_size = 64
    layer = type("Layer", (), {"isa": "vec"})()
    query, cache = torch.zeros(2, 4, 64), torch.zeros(3, 4, 32, 128)
    assert impl._layer_problem(layer, query, cache) == "a sliding window"
    impl.sliding_window = -1
    assert impl._layer_problem(layer, query, cache) is None
    layer.isa = "amx"
    assert impl._layer_problem(layer, query, cache) is None
    layer.isa = "neon"
    assert impl._layer_problem(layer, query, cache) == "KV layout 'neon'"


def test_the_plugin_points_vllms_cpu_backend_at_feathers():
    code = ("from vllm.plugins import load_general_plugins; load_general_plugins(); "
            "from vllm.v1.attention.backends.registry import AttentionBackendEnum as E; "
            "print(E.CPU_ATTN.get_path())")
    path = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip().splitlines()[-1]
    assert path == backends.path("SharedPrefixCPUBackend")
    assert backends.SharedPrefixCPUBackend is vllm_attention.SharedPrefixCPUBackend


def test_the_ranks_vote_where_sglangs_do(monkeypatch):
    """vLLM's tensor-parallel vote is ``selfcheck.tp_vote`` over vLLM's parallel state (as
    SGLang's adapter over SGLang's: one place, one way)."""
    from vllm.distributed import parallel_state

    from feather_sched.attention import selfcheck

    votes = []
    monkeypatch.setattr(selfcheck, "tp_vote", lambda verdict, state: votes.append(state))
    attention_choice.agreed(None)
    assert votes == [parallel_state]


def test_amx_tiles_act_only_after_a_check_in_a_process_of_its_own(monkeypatch, tmp_path):
    """Where the kernel has AMX tiles (a path the project's own machines exercise only
    emulated), the self-check runs from a recipe in a child process (here: the child's
    work, in this process) and the engine multiplies in tiles only after that check
    measured the path exact and faster."""
    monkeypatch.setenv("FEATHER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_kernel, "tiles", lambda: "amx")
    monkeypatch.setattr(attention_check.CpuSubject, "seconds", timed_as(0))
    recipes = []

    def in_this_process(recipe, timeout_s=None):
        recipes.append(recipe)
        return selfcheck.check(isolation.resolve(recipe.factory)(**recipe.kwargs))

    monkeypatch.setattr(vllm_attention, "run_isolated", in_this_process)
    tiles_asked = []

    class Recording:
        def __getattr__(self, name):
            return getattr(cpu_kernel, name)

        def attend_groups(self, plan, *args):
            tiles_asked.append(args[-1])
            return cpu_kernel.attend_groups(plan, *args)

    monkeypatch.setattr(vllm_attention, "cpu_kernel", Recording())
    prompts, lengths = mixed_prompts(1)
    generate(make_llm("bfloat16", SHORT_PREFIXES), prompts[:9], lengths[:9])
    assert [r.factory.rsplit(":", 1)[1] for r in recipes] == ["cpu_subject"]
    assert tiles_asked and all(tiles_asked)
