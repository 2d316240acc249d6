"""Feather's shared-prefix variants of vLLM's FLASH_ATTN and TRITON_ATTN backends, on a
machine without a GPU.

Covered: the plugin's registration over both members (what vLLM's priority walk then picks
without a flag); the option, and the configurations and layers it refuses, with the logged
reason; the CUDA-graph support the backends report (vLLM's own, so FULL decode graphs stay);
the builders on a realistic ``CommonAttentionMetadata``: groups found from the host rows
``host_tables`` gives (rows read through a slot mapping), the cut lengths in one persistent
buffer, the work staged into ``gpu_decode``'s persistent buffers, a graph-shaped step
without groups (empty work, same buffers), capture metadata; that the per-step path reads
no device tensor on the host (every device-side input on the ``meta`` device, where any
read raises); and, in a fresh process under TRITON_INTERPRET=1, the whole forward of each
backend in fp32: vLLM's own Triton kernel, and for FLASH_ATTN a float64 stand-in with FA3's
signature (``tests/helpers/flash_reference``: FA3 cannot run here), for the cut batch, then
Feather's kernels for the grouped rows, against float64 attention and vLLM's unmodified
forward, step after step on the same buffers.

Not covered (no GPU): speed, CUDA graphs captured and replayed (``tests/attention/
test_gpu_decode.py`` has the CUDA-only capture test), FA3 itself, the model runners end to
end, bf16/fp16 through vLLM's kernel (the interpreter multiplies bf16 wrongly; Feather's
kernels are tested in bf16 in ``tests/attention``), and loading through the installed entry
point (only its declaration in pyproject.toml is checked).
"""

from __future__ import annotations

import json
import logging
import tomllib
from dataclasses import dataclass, fields, replace
from functools import partial
from importlib.util import find_spec
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

if find_spec("vllm") is None:
    pytest.skip("the vllm extra is not installed", allow_module_level=True)

from tests.helpers.triton_interpreter import (
    INTERPRETED,
    keep_vllm_triton_on,
    only_interpreted,
    run_interpreted,
)

if INTERPRETED:
    keep_vllm_triton_on()

from vllm.config import (
    CacheConfig,
    CompilationConfig,
    CUDAGraphMode,
    ModelConfig,
    VllmConfig,
)
from vllm.config.compilation import CompilationMode
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata
from vllm.v1.attention.backends import flash_attn
from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadataBuilder
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadataBuilder
from vllm.v1.attention.selector import AttentionSelectorConfig
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

from feather_sched.attention import gpu_decode, selfcheck
from feather_sched.attention.groups import Groups
from feather_sched.attention.partials import reference_attention
from feather_sched.attention.selfcheck import Cell, device_name
from feather_sched.integrations.vllm import attention_check, attention_subject, plugins
from feather_sched.integrations.vllm import attention_gpu as gpu
from feather_sched.integrations.vllm.host_tables import HostRows
from feather_sched.models import TINY_LLAMA
from tests.helpers.flash_reference import float64_flash_attn_varlen_func
from tests.helpers.timers import timed_as

BLOCK = 16
FEATHER = "feather_sched.integrations.vllm.FeatherScheduler"
Q_HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64
"""The tiny model's heads with 2 KV heads (GQA 4), as vLLM's builders read them."""
interpreted = only_interpreted("test_forward_in_the_triton_interpreter")
BUILDERS = {"flash": gpu.SharedPrefixFlashBuilder, "triton": gpu.SharedPrefixTritonBuilder}
ENGINE_BUILDERS = {"flash": FlashAttentionMetadataBuilder,
                   "triton": TritonAttentionMetadataBuilder}


def make_config(feather: dict | None = None, graphs: bool = False) -> VllmConfig:
    model = ModelConfig(model=str(TINY_LLAMA), dtype="float32", skip_tokenizer_init=True,
                        max_model_len=2048, hf_overrides={"num_key_value_heads": KV_HEADS})
    config = VllmConfig(model_config=model, cache_config=CacheConfig(block_size=BLOCK),
                        additional_config={"feather": feather or {}})
    if graphs:  # what vLLM resolves on a GPU by default: FULL decode graphs up to 512 tokens
        config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
        config.compilation_config.max_cudagraph_capture_size = 512
        config.compilation_config.cudagraph_capture_sizes = [1, 2, 4, 8, 16, 32, 64, 512]
    return config


@pytest.fixture(scope="module")
def config_on() -> VllmConfig:
    return make_config({"shared_prefix_attention": "on"})


@pytest.fixture(autouse=True)
def _options_from_the_config_only(monkeypatch) -> None:
    monkeypatch.delenv("FEATHER_SHARED_PREFIX_ATTENTION", raising=False)


@pytest.fixture(autouse=True)
def _layers_as_the_engine_would_have_them(monkeypatch) -> None:
    """The builders check each layer of their group; here there is no model, so the group's
    layers are impls of the tiny model's shapes (what a test may change)."""
    monkeypatch.setattr(gpu, "group_problem", lambda config, spec, names: (
        gpu.decide_gpu(config, spec) or gpu.layer_problem(LAYER_IMPL[0], torch.float32,
                                                          spec.dtype)))


@pytest.fixture
def announced(monkeypatch) -> list[str]:
    messages: list[str] = []
    monkeypatch.setattr(gpu, "announce", messages.append)
    return messages


SPEC = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM,
                         dtype=torch.float32)


def make_impl(kind: str = "triton", **options):
    cls = gpu.SharedPrefixFlashImpl if kind == "flash" else gpu.SharedPrefixTritonImpl
    options = {"alibi_slopes": None, "sliding_window": None, **options}
    impl = cls(Q_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, KV_HEADS, kv_cache_dtype="auto", **options)
    return impl


LAYER_IMPL = [make_impl()]


# Registration, the option and what the engine resolves ---------------------------------


def test_the_plugin_registers_over_vllms_default_gpu_backends():
    members = [AttentionBackendEnum[name] for name in gpu.BACKENDS]
    for member in members:
        member.clear_override()  # an engine built earlier in this process loaded the plugins
    try:
        assert plugins.register_backends(plugins.GPU_BACKENDS) == ["FLASH_ATTN", "TRITON_ATTN"]
        assert AttentionBackendEnum.FLASH_ATTN.get_class() is gpu.SharedPrefixFlashBackend
        assert AttentionBackendEnum.TRITON_ATTN.get_class() is gpu.SharedPrefixTritonBackend
        selector = AttentionSelectorConfig(head_size=128, dtype=torch.bfloat16,
                                           kv_cache_dtype="auto", block_size=16)
        for name, backend in gpu.BACKENDS.items():
            # cuda.py's check of each candidate of its priority walk, and the name vLLM keeps.
            assert backend.validate_configuration(device_capability=DeviceCapability(9, 0),
                                                  **selector._asdict()) == []
            assert backend.get_name() == name
        plugins.register_attention_gpu()  # on this CPU platform: nothing more (and no error)
        AttentionBackendEnum.TRITON_ATTN.clear_override()
        from vllm.v1.attention.backends.registry import register_backend

        register_backend(AttentionBackendEnum.TRITON_ATTN, "another.plugin.Backend")
        assert plugins.register_backends(plugins.GPU_BACKENDS) == ["FLASH_ATTN"]
        assert AttentionBackendEnum.TRITON_ATTN.get_path() == "another.plugin.Backend"
    finally:
        for member in members:
            member.clear_override()
    pyproject = tomllib.loads((Path(__file__).parents[3] / "pyproject.toml").read_text())
    entry_points = pyproject["project"]["entry-points"]["vllm.general_plugins"]
    assert entry_points["feather_attention_gpu"] == \
        f"{plugins.__name__}:{plugins.register_attention_gpu.__name__}"


@pytest.mark.parametrize("kind", BUILDERS)
def test_an_engine_that_did_not_choose_feather_gets_vllms_builder(kind, announced,
                                                                   monkeypatch, caplog):
    """vLLM's scheduler, no Feather options: nothing read (a stray FEATHER_* variable is
    never parsed), nothing announced or logged, vLLM's own block-table reuse, no work."""
    monkeypatch.setenv("FEATHER_SHARED_PREFIX_ATTENTION", "not-a-mode")
    monkeypatch.setenv("FEATHER_STATS_FILE", "/no/such/directory/stats.json")
    config = make_config()
    config.additional_config = {}
    with caplog.at_level("DEBUG", logger="vllm.feather_sched"):
        builder = BUILDERS[kind](SPEC, ["layer"], config, torch.device("cpu"))
    assert builder.path is None and announced == []
    assert [r for r in caplog.records
            if r.name == "vllm.feather_sched" and r.levelno > logging.DEBUG] == []
    assert builder.supports_update_block_table == ENGINE_BUILDERS[kind].supports_update_block_table


@pytest.mark.parametrize("kind", BUILDERS)
def test_the_option_and_its_default(kind, announced, config_on):
    builder = BUILDERS[kind]
    auto = builder(SPEC, ["layer"], make_config(), torch.device("cpu"))
    assert auto.path is None
    assert announced == ["off (auto, and the scheduler is not Feather's)"]
    off = builder(SPEC, ["layer"], make_config({"shared_prefix_attention": "off"}),
                  torch.device("cpu"))
    assert off.path is None and announced[-1] == "off (option shared_prefix_attention)"
    on = builder(SPEC, ["layer"], config_on, torch.device("cpu"))
    assert on.path is not None
    assert announced[-1] == (f"on ({builder.name}, block size 16, groups from 16 shared "
                             "blocks; no FULL CUDA graphs)")
    graphed = builder(SPEC, ["layer"], make_config({"shared_prefix_attention": "on"},
                                                   graphs=True), torch.device("cpu"))
    assert announced[-1].endswith("FULL decode CUDA graphs kept)") and graphed.path is not None


def test_configurations_it_cannot_serve_stay_off(config_on, monkeypatch):
    sliding = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM,
                                dtype=torch.float32, sliding_window=128)
    assert gpu.decide_gpu(config_on, sliding) == "off for SlidingWindowSpec layers"
    windowed = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM,
                                 dtype=torch.float32, sliding_window=128)
    assert gpu.decide_gpu(config_on, windowed) == ("off for sliding-window, chunked or "
                                                   "non-causal layers")
    assert gpu.decide_gpu(config_on, SPEC) is None
    monkeypatch.setattr(config_on, "speculative_config", object())
    assert gpu.decide_gpu(config_on, SPEC) == "off with speculative decoding"
    monkeypatch.setattr(config_on.cache_config, "enable_prefix_caching", False)
    assert gpu.decide_gpu(config_on, SPEC) == ("off without prefix caching (no two rows can "
                                               "share a block)")


@pytest.mark.parametrize("kind", BUILDERS)
def test_fused_output_quantization_and_batch_invariance_are_refused_by_name(
        kind, announced, monkeypatch):
    """Where the path cannot be exact it stays off even when asked for, and the line says
    why: a quantized output (the merge would store unscaled values into it) and vLLM's
    batch-invariant mode (a grouped row's numerics would depend on its neighbours)."""
    fused = make_config({"shared_prefix_attention": "on"})
    fused.compilation_config.pass_config.fuse_attn_quant = True
    assert BUILDERS[kind](SPEC, ["layer"], fused, torch.device("cpu")).path is None
    assert announced[-1].startswith("off with fused output quantization (compilation_config"
                                    ".pass_config.fuse_attn_quant")
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    invariant = make_config({"shared_prefix_attention": "on"})
    assert BUILDERS[kind](SPEC, ["layer"], invariant, torch.device("cpu")).path is None
    assert announced[-1].startswith("off in batch-invariant mode (VLLM_BATCH_INVARIANT")
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    assert BUILDERS[kind](SPEC, ["layer"], invariant, torch.device("cpu")).path is not None


@pytest.mark.parametrize("kind", BUILDERS)
def test_layers_the_kernels_cannot_serve_turn_their_group_off(kind, config_on, announced):
    impl = make_impl(kind)
    assert gpu.layer_problem(impl, torch.float32, torch.float32) is None
    assert gpu.layer_problem(impl, torch.bfloat16, torch.float32) == (
        "a query dtype unlike the cache's")
    for options, problem in (({"logits_soft_cap": 30.0}, "soft-capping"),
                             ({"sliding_window": 128}, "a sliding window"),
                             ({"alibi_slopes": [0.5] * Q_HEADS}, "ALiBi")):
        assert gpu.layer_problem(make_impl(kind, **options), torch.float32,
                                 torch.float32) == problem
    assert gpu.layer_problem(impl, torch.float32, torch.float32, v_head_size=HEAD_DIM // 2) == (
        "unequal K and V head sizes")
    impl.sinks = torch.zeros(Q_HEADS)  # FA's own check of sinks needs FA3, absent here
    assert gpu.layer_problem(impl, torch.float32, torch.float32) == "attention sinks"
    LAYER_IMPL[0] = make_impl(kind, logits_soft_cap=30.0)
    try:
        builder = BUILDERS[kind](SPEC, ["layer"], config_on, torch.device("cpu"))
    finally:
        LAYER_IMPL[0] = make_impl()
    assert builder.path is None and announced[-1] == "soft-capping"


@pytest.mark.parametrize("kind", BUILDERS)
def test_the_backends_keep_vllms_cuda_graph_support(kind, config_on):
    ours, engine = BUILDERS[kind], ENGINE_BUILDERS[kind]
    assert ours.get_cudagraph_support(config_on, SPEC) == engine.get_cudagraph_support(
        config_on, SPEC)
    support = ours.get_cudagraph_support(config_on, SPEC)
    assert support in (AttentionCGSupport.ALWAYS, AttentionCGSupport.UNIFORM_BATCH)
    compilation = CompilationConfig(mode=CompilationMode.VLLM_COMPILE,
                                    cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE,
                                    splitting_ops=list(CompilationConfig._attention_ops))
    # vLLM's default mode survives (it became PIECEWISE while the old path was on).
    assert compilation.resolve_cudagraph_mode_and_sizes(support, "x") == (
        CUDAGraphMode.FULL_AND_PIECEWISE)
    assert not ours(SPEC, ["layer"], config_on, torch.device("cpu")).supports_update_block_table


# A realistic step ------------------------------------------------------------------------


@dataclass
class Batch:
    """One step in vLLM's GPU shapes (on the CPU), with each row's context in float64."""

    common: CommonAttentionMetadata
    kv_cache: torch.Tensor
    """``[blocks, kv_heads, block_size, 2 * head_dim]``, as vLLM allocates it for Triton."""
    query: torch.Tensor
    contexts: list[tuple[torch.Tensor, torch.Tensor]]
    """Per row: K, V ``[seq_len, kv_heads, head_dim]`` float64."""
    groups: list[list[int]]
    """The rows that should group."""


def make_batch(decode_only: bool, seed: int = 0) -> Batch:
    """Prefixes A (300 tokens: 18 shared blocks and a tail each row copies) and B (260: 16
    blocks, the fewest that group at block size 16), interleaved: a prefill chunk of A
    (unless ``decode_only``), decode rows of A and B, a long singleton and a short row.
    Padding rows and columns and unused table entries point at random blocks."""
    gen = torch.Generator().manual_seed(seed)
    dims = (KV_HEADS, HEAD_DIM)
    prefixes = {name: torch.randn(2, length, *dims, generator=gen).double()
                for name, length in (("A", 300), ("B", 260))}
    # (prefix, query tokens, the row's own tokens after the prefix)
    rows = [("A", 5, 5), ("A", 1, 7), ("B", 1, 1), (None, 1, 280), ("A", 1, 40),
            ("B", 1, 23), ("A", 1, 1), (None, 1, 20)]
    rows = rows[1:] if decode_only else rows
    num_blocks, width = 160, 40
    physical = iter(torch.randperm(num_blocks, generator=gen).tolist())
    shared = {name: [next(physical) for _ in range(p.shape[1] // BLOCK)]
              for name, p in prefixes.items()}
    table = torch.randint(0, num_blocks, (len(rows) + 2, width), generator=gen,
                          dtype=torch.int32)
    kv_cache = torch.randn(num_blocks, KV_HEADS, BLOCK, 2 * HEAD_DIM, generator=gen)
    key_cache, value_cache = kv_cache.transpose(1, 2).split(HEAD_DIM, dim=-1)
    contexts = []
    for row, (name, _, extra) in enumerate(rows):
        own = torch.randn(2, extra, *dims, generator=gen).double()
        context = torch.cat([prefixes[name], own], 1) if name else own
        blocks = list(shared.get(name, []))
        blocks += [next(physical) for _ in range(-(-context.shape[1] // BLOCK) - len(blocks))]
        table[row, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        for position in range(context.shape[1]):
            slot = (blocks[position // BLOCK], position % BLOCK)
            key_cache[slot], value_cache[slot] = context[0, position], context[1, position]
        contexts.append((context[0], context[1]))
    query_lens = [n for _, n, _ in rows]
    starts = torch.tensor(np.cumsum([0, *query_lens]), dtype=torch.int32)
    seq_lens = torch.tensor([k.shape[0] for k, _ in contexts], dtype=torch.int32)
    query = torch.randn(int(starts[-1]), Q_HEADS, HEAD_DIM, generator=gen)
    common = CommonAttentionMetadata(
        query_start_loc=starts, query_start_loc_cpu=starts.clone(), seq_lens=seq_lens,
        num_reqs=len(rows), num_actual_tokens=int(starts[-1]), max_query_len=max(query_lens),
        max_seq_len=int(seq_lens.max()), block_table_tensor=table,
        slot_mapping=torch.zeros(int(starts[-1]), dtype=torch.int64),
        seq_lens_cpu_upper_bound=seq_lens.clone())
    groups = [[r for r, (name, n, _) in enumerate(rows) if name == g and n == 1] for g in "AB"]
    return Batch(common, kv_cache, query, contexts, groups)




def slot_rows(batch: Batch, seed: int = 1) -> HostRows:
    """The batch's table as MRV2 keeps it on the host: one row per request slot, the rows
    scattered over more slots than the batch has (``req_idx``), stale rows between."""
    table = batch.common.block_table_tensor.numpy()
    slots = np.random.default_rng(seed).permutation(3 * len(table))[:batch.common.num_reqs]
    host = np.random.default_rng(seed).integers(0, 160, (3 * len(table), table.shape[1]),
                                                dtype=np.int32)
    host[slots] = table[:batch.common.num_reqs]
    return HostRows(host, slots)


def staged(decode: gpu_decode.GroupedDecode) -> dict[str, list[int]]:
    """What the last ``stage`` wrote (read back from the device buffer: a test's read)."""
    views = decode._views(decode._index)
    rows, segments = int(views["row_count"][0]), int(views["segment_count"][0])
    return {"tokens": views["tokens"][:rows].tolist(),
            "suffix_rows": views["suffix_rows"][:rows].tolist(),
            "prefix_lengths": views["prefix_lengths"][:segments].tolist()}


@pytest.mark.parametrize("kind", BUILDERS)
def test_the_builder_stages_host_groups_and_cuts_in_one_persistent_buffer(kind, config_on,
                                                                          monkeypatch):
    batch = make_batch(decode_only=False)
    common = batch.common
    planned = stand_in_for_fa3(kind, monkeypatch)
    builder = BUILDERS[kind](SPEC, ["layer"], config_on, torch.device("cpu"))
    metadata = builder.build_with(common, False, slot_rows(batch))
    if kind == "flash":  # FA3's schedule is planned for the lengths its kernel will read
        assert planned[-1].tolist() == metadata.seq_lens.tolist()
    assert isinstance(metadata, builder.metadata_cls) and metadata.work is builder.path.decode
    stock = ENGINE_BUILDERS[kind](SPEC, ["layer"], config_on, torch.device("cpu")).build(0, common)
    assert metadata.block_table is stock.block_table
    shared = {row: n for rows, n in zip(batch.groups, (18, 16), strict=True) for row in rows}
    assert sorted(shared) == [1, 2, 4, 5, 6]
    assert metadata.seq_lens.tolist() == [1 if row in shared else int(length)
                                          for row, length in enumerate(common.seq_lens)]
    assert metadata.seq_lens.data_ptr() == builder.path.cut.data_ptr()
    work = staged(builder.path.decode)
    starts = common.query_start_loc_cpu.tolist()
    assert sorted(work["suffix_rows"]) == sorted(shared)
    assert work["tokens"] == [starts[row] for row in work["suffix_rows"]]
    assert work["prefix_lengths"] == [18 * BLOCK, 16 * BLOCK]
    # The next step, rows in another order and one group fewer: the same buffers.
    order = [0, 2, 1, 3, 5, 4, 6, 7]
    table = common.block_table_tensor.clone()
    table[[1, 4, 6]] = torch.arange(3 * table.shape[1], dtype=torch.int32).view(3, -1) + 200
    second = replace(common, block_table_tensor=table[order], seq_lens=common.seq_lens[order],
                     seq_lens_cpu_upper_bound=common.seq_lens_cpu_upper_bound[order])
    again = builder.build_with(second, False, HostRows(table[order].numpy(), np.arange(8)))
    assert again.seq_lens.data_ptr() == builder.path.cut.data_ptr()
    assert again.seq_lens.tolist() == [1 if r in (1, 4) else int(second.seq_lens[r])
                                       for r in range(8)]
    assert sorted(staged(builder.path.decode)["suffix_rows"]) == [1, 4]  # the B rows, moved


@pytest.mark.parametrize("kind", BUILDERS)
def test_the_metadata_is_every_field_vllm_built_and_the_work(kind, config_on, monkeypatch):
    """``carrying``: vLLM's metadata of the step as Feather's subclass, each of the fields
    this release's metadata has the very object vLLM built, then the work."""
    stand_in_for_fa3(kind, monkeypatch)
    stock = ENGINE_BUILDERS[kind](SPEC, ["layer"], config_on, torch.device("cpu")).build(
        0, make_batch(decode_only=False).common)
    work = BUILDERS[kind](SPEC, ["layer"], config_on, torch.device("cpu")).path.decode
    carried = gpu.carrying(BUILDERS[kind].metadata_cls, stock, work)
    assert type(carried) is BUILDERS[kind].metadata_cls and carried.work is work
    assert [f.name for f in fields(carried)] == [*(f.name for f in fields(stock)), "work"]
    assert [f.name for f in fields(stock) if getattr(carried, f.name) is not getattr(
        stock, f.name)] == []


def test_a_step_carries_the_work_unless_nothing_groups_and_no_graph_holds_it():
    """``Step.carries_work``: groups to run, a capture, or a mode whose FULL graphs may
    replay the step; only a step with none of these gets vLLM's metadata."""
    groups = Groups(rows=np.array([0, 1]), offsets=np.array([0, 2]), shared=np.array([1]))
    steps = [gpu.Step(found, capturing, graphs) for found in (None, groups)
             for capturing in (False, True) for graphs in (False, True)]
    assert [step for step in steps if not step.carries_work] == [gpu.Step(None, False, False)]


@pytest.mark.parametrize("kind", BUILDERS)
def test_a_step_without_groups(kind, config_on):
    batch = make_batch(decode_only=True)
    table = batch.common.block_table_tensor
    table[:] = torch.arange(table.numel(), dtype=torch.int32).view_as(table)  # none shared
    host = HostRows(table.numpy(), np.arange(batch.common.num_reqs))
    eager = BUILDERS[kind](SPEC, ["layer"], config_on, torch.device("cpu"))
    assert type(eager.build_with(batch.common, False, host)) is not eager.metadata_cls
    graphed = BUILDERS[kind](SPEC, ["layer"], make_config({"shared_prefix_attention": "on"},
                                                           graphs=True), torch.device("cpu"))
    for source in (host, None):  # no groups, or no host rows: a graph replays empty work
        metadata = graphed.build_with(batch.common, False, source)
        assert metadata.work is graphed.path.decode and staged(graphed.path.decode)["tokens"] == []
        assert metadata.seq_lens.tolist() == batch.common.seq_lens.tolist()
        assert metadata.seq_lens.data_ptr() == graphed.path.cut.data_ptr()
    captured = graphed.build_for_cudagraph_capture(make_batch(decode_only=False).common)
    assert captured.work is graphed.path.decode and staged(graphed.path.decode)["tokens"] == []


@pytest.mark.parametrize("kind", BUILDERS)
def test_while_full_graphs_are_set_every_step_carries_the_work(kind, monkeypatch):
    """Whether vLLM replays a step as a FULL graph is its dispatcher's call, so while the
    mode has FULL graphs every step without groups carries the (cleared) work and the cut
    lengths, mixed or not: a replay never reads a stale plan. Without FULL graphs (eager
    or PIECEWISE only) such a step gets vLLM's own metadata, and Feather stages, clears,
    cuts and launches nothing, reading nothing on the host (device inputs on ``meta``)."""
    monkeypatch.setattr(gpu_decode.GroupedDecode, "warm_up", lambda *args: None)
    meta = torch.device("meta")
    config = make_config({"shared_prefix_attention": "on"}, graphs=True)
    builder = BUILDERS[kind](SPEC, ["layer"], config, meta)
    work = []

    def recorded(name: str):
        def call(*args):
            work.append(name)
            return args[0] if args else None  # cut_seq_lens: the lengths as given

        return call

    for name in ("clear", "stage", "cut_seq_lens", "run"):
        monkeypatch.setattr(builder.path.decode, name, recorded(name))

    def unshared(decode_only: bool):
        common = make_batch(decode_only).common
        table = common.block_table_tensor
        table[:] = torch.arange(table.numel(), dtype=torch.int32).view_as(table)
        host = HostRows(table.numpy(), np.arange(common.num_reqs))
        return replace(common, query_start_loc=common.query_start_loc.to(meta),
                       seq_lens=common.seq_lens.to(meta), block_table_tensor=table.to(meta),
                       slot_mapping=common.slot_mapping.to(meta)), host

    mixed, host = unshared(decode_only=False)
    decode, _ = unshared(decode_only=True)
    assert mixed.max_query_len > 1
    for batch in (mixed, decode):  # FULL_AND_PIECEWISE: each may replay a FULL graph
        work.clear()
        assert builder.build_with(batch, False, host).work is builder.path.decode
        assert work == ["clear", "cut_seq_lens"]
    for mode in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.NONE):  # read at each step
        config.compilation_config.cudagraph_mode = mode
        work.clear()
        for batch in (mixed, decode):
            metadata = builder.build_with(batch, False, host)
            assert type(metadata) is not builder.metadata_cls and work == []


@pytest.mark.parametrize("kind", BUILDERS)
def test_the_per_step_path_reads_no_device_tensor_on_the_host(kind, monkeypatch):
    """Every device-side input on the ``meta`` device (where a host read raises: "cannot
    copy out of meta tensor"), the host-side ones (``query_start_loc_cpu``,
    ``seq_lens_cpu_upper_bound``, the host rows) real: the builder groups, stages, cuts."""
    monkeypatch.setattr(gpu_decode.GroupedDecode, "warm_up", lambda *args: None)
    meta = torch.device("meta")
    config = make_config({"shared_prefix_attention": "on"}, graphs=True)
    builder = BUILDERS[kind](SPEC, ["layer"], config, meta)
    batch = make_batch(decode_only=True)
    common = batch.common
    on_meta = replace(common, query_start_loc=common.query_start_loc.to(meta),
                      seq_lens=common.seq_lens.to(meta),
                      block_table_tensor=common.block_table_tensor.to(meta),
                      slot_mapping=common.slot_mapping.to(meta))
    with pytest.raises(NotImplementedError):
        on_meta.seq_lens.tolist()  # what any host read of a device tensor would meet
    metadata = builder.build_with(on_meta, False, slot_rows(batch))
    assert metadata.work is builder.path.decode and metadata.seq_lens.device == meta


# The whole forward, in Triton's interpreter ------------------------------------------------


def test_forward_and_self_check_in_the_triton_interpreter():
    if INTERPRETED:
        pytest.skip("this is that process")
    result = run_interpreted(f"{__file__}::test_interpreted_forward_matches_float64_and_vllms",
                             f"{__file__}::test_interpreted_self_check_decides_auto",
                             f"{__file__}::test_interpreted_feather_attention_check_backend",
                             f"{__file__}::test_interpreted_engine_check_in_its_own_process")
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "9 passed" in result.stdout, result.stdout[-2000:]


LAYER = SimpleNamespace(_q_scale=torch.ones(1), _k_scale=torch.ones(1), _v_scale=torch.ones(1))


def stand_in_for_fa3(kind: str, monkeypatch) -> list[torch.Tensor]:
    """For FLASH_ATTN, FA3 as vLLM's module sees it on Hopper: version 3 (so its builder
    plans FA3's ahead-of-time schedule), the schedule's call recorded (the lengths it is
    planned for; returned), and the float64 stand-in in place of the attention call
    (vLLM's CPU wheel has no vllm_flash_attn: its module never bound these names)."""
    planned: list[torch.Tensor] = []
    if kind == "flash":
        monkeypatch.setattr(flash_attn, "get_flash_attn_version", lambda *args, **kw: 3)
        monkeypatch.setattr(flash_attn, "get_scheduler_metadata", lambda **kw: planned.append(
            kw["cache_seqlens"].clone()), raising=False)
        monkeypatch.setattr(flash_attn, "flash_attn_varlen_func",
                            float64_flash_attn_varlen_func, raising=False)
    return planned


@interpreted
@pytest.mark.parametrize("kind", BUILDERS)
@pytest.mark.parametrize("decode_only", [False, True], ids=["mixed", "decode"])
def test_interpreted_forward_matches_float64_and_vllms(kind, decode_only, config_on,
                                                       monkeypatch):
    stand_in_for_fa3(kind, monkeypatch)
    builder = BUILDERS[kind](SPEC, ["layer"], config_on, torch.device("cpu"))
    engine = ENGINE_BUILDERS[kind](SPEC, ["layer"], config_on, torch.device("cpu"))
    impl = make_impl(kind)
    engine_forward = builder.engine_impl_cls.forward
    for seed in (0, 1):  # step after step on the same buffers
        batch = make_batch(decode_only, seed=seed)
        metadata = builder.build_with(batch.common, False, slot_rows(batch, seed))
        assert isinstance(metadata, builder.metadata_cls)
        ours = torch.full_like(batch.query, float("nan"))
        type(impl).forward(impl, LAYER, batch.query, None, None, batch.kv_cache, metadata, ours)
        stock = torch.full_like(batch.query, float("nan"))
        engine_forward(impl, LAYER, batch.query, None, None, batch.kv_cache,
                       engine.build(0, batch.common), stock)
        grouped = {row for rows in batch.groups for row in rows}
        starts = batch.common.query_start_loc_cpu.tolist()
        worst = 0.0
        for row, (keys, values) in enumerate(batch.contexts):
            for token in range(starts[row], starts[row + 1]):
                visible = len(keys) - (starts[row + 1] - 1 - token)
                expected, _ = reference_attention(batch.query[token], keys[:visible],
                                                  values[:visible], impl.scale)
                error = float((ours[token].double() - expected).abs().max()
                              / expected.abs().max())
                worst = max(worst, error)
                if row in grouped:
                    assert torch.allclose(ours[token], stock[token], rtol=1e-5, atol=1e-6)
                else:
                    assert torch.equal(ours[token], stock[token]), row
        assert worst < 1e-5


@interpreted
@pytest.mark.parametrize("kind, faster", [("triton", True), ("flash", True), ("flash", False)])
def test_interpreted_self_check_decides_auto(kind, faster, monkeypatch, tmp_path):
    """Auto with Feather's scheduler runs the self-check in the builder: vLLM's own
    backend (its builder and forward; FA3's float64 stand-in) against the path on random
    paged caches; exact on every cell, then on where it measured faster (groups from the
    measured break-even) and off where slower, with its line."""
    monkeypatch.setenv("FEATHER_CACHE_DIR", str(tmp_path))
    stand_in_for_fa3(kind, monkeypatch)
    monkeypatch.setattr(attention_check, "engine_layer", lambda config, names: SimpleNamespace(
        impl=make_impl(kind), **vars(LAYER)))
    monkeypatch.setattr(attention_check.GpuSubject, "seconds", timed_as(0 if faster else None))
    small = partial(selfcheck.check, grid=(Cell(64, 2, 2, suffix=9), Cell(96, 2, 3, suffix=20)),
                    exactness=(Cell(40, 1, 2, suffix=1),), idle=(Cell(64, 3, 1),), reps=1)
    cached_check = selfcheck.cached_check
    monkeypatch.setattr(selfcheck, "cached_check", lambda subject: cached_check(subject, small))
    messages = []
    monkeypatch.setattr(gpu, "announce", messages.append)
    config = make_config()
    config.scheduler_config.scheduler_cls = FEATHER
    builder = BUILDERS[kind](SPEC, ["layer"], config, torch.device("cpu"))
    line = messages[-1]
    assert (builder.path is not None) is faster, line
    assert line.startswith(f"{'on' if faster else 'off'} (self-check on {device_name('cpu')}, "
                           "8q/2kv/d64 "
                           f"float32, block 16, layout {builder.name}"), line
    verdict = selfcheck.Verdict.from_json(json.loads(next(
        tmp_path.glob("attention-check/*.json")).read_text()))
    assert verdict.max_error < 1e-5 and all(c.reference_error < 1e-5 for c in verdict.cells)
    assert any(c.cell.idle for c in verdict.cells)  # the empty step, exact and timed too
    if faster:
        assert builder.path.min_shared_blocks == 64 // BLOCK and "2.00x at 64 2x2" in line
        assert builder.path.by_size == verdict.by_size == ((2, 64), (3, 64))
    else:
        assert "not faster than the engine's kernel" in line


@interpreted
def test_interpreted_feather_attention_check_backend(monkeypatch, tmp_path):
    """``feather attention-check --backend``: what a user runs on their own GPU (here on CPU
    tensors, a small grid): vLLM's backend against the path, the grid printed and the
    verdict written. FLASH_ATTN here (its float64 stand-in is quick); TRITON_ATTN's subject
    comes from the same ``gpu_subject``, run in the interpreter by
    ``test_interpreted_engine_check_in_its_own_process``."""
    backend = "FLASH_ATTN"
    from typer.testing import CliRunner

    from feather_sched.cli import app

    stand_in_for_fa3("flash" if backend == "FLASH_ATTN" else "triton", monkeypatch)
    monkeypatch.setattr(selfcheck, "check", partial(
        selfcheck.check, grid=(Cell(64, 2, 2, suffix=9),), exactness=(), idle=(), reps=1))
    out = tmp_path / "check.json"
    result = CliRunner().invoke(app, ["attention-check", "--backend", backend, "--dtype",
                                      "float32", "--block-size", "16", "--max-model-len",
                                      "512", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "| 64 | 2 x 2 |" in result.output
    assert "Feather shared-prefix attention: " in result.output
    verdict = selfcheck.Verdict.from_json(json.loads(out.read_text()))
    assert verdict.shapes.layout == ("FlashAttention" if backend == "FLASH_ATTN" else "Triton")
    assert verdict.max_error < 1e-5 and verdict.cells[0].speedup is not None


def test_the_check_child_builds_its_config_under_the_engines_settings(monkeypatch):
    """The engine's attention settings (here FlashAttention's split cap under graphs) and
    the compilation settings Feather's builder reads travel in the recipe as plain values,
    and the child's vLLM config is built under them, as the user gave them (so vLLM
    resolves them as it resolved the engine's); fields a release lacks are left out."""
    import vllm.config

    config = make_config({"shared_prefix_attention": "on"})
    config.attention_config.flash_attn_max_num_splits_for_cuda_graph = 8
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
    config.compilation_config.max_cudagraph_capture_size = 64
    config.compilation_config.cudagraph_capture_sizes = [1, 2, 4, 8, 16, 32, 64]
    builder = BUILDERS["triton"](SPEC, ["layer"], config, torch.device("cpu"))
    kwargs = attention_subject.gpu_recipe(builder, config, SPEC).kwargs
    assert kwargs["attention"]["flash_attn_max_num_splits_for_cuda_graph"] == 8
    assert "backend" not in kwargs["attention"]  # the check runs the backend it was asked
    assert kwargs["compilation"] == {"cudagraph_mode": "FULL_DECODE_ONLY",
                                     "max_cudagraph_capture_size": 64}
    given = []  # as handed to vLLM, before this platform resolves it (NONE on a CPU)
    monkeypatch.setattr(vllm.config, "VllmConfig", lambda **parts: given.append((
        parts["compilation_config"].cudagraph_mode,
        parts["compilation_config"].max_cudagraph_capture_size)) or VllmConfig(**parts))
    child = attention_subject.check_config(
        attention_check.Geometry(8, 2, 64), torch.float32, BLOCK, 4, 512,
        {**kwargs["attention"], "a_later_release_only": 1}, kwargs["compilation"])
    assert child.attention_config.flash_attn_max_num_splits_for_cuda_graph == 8
    assert given == [(CUDAGraphMode.FULL_DECODE_ONLY, 64)]


@interpreted
def test_interpreted_engine_check_in_its_own_process(config_on, tmp_path):
    """What a GPU worker runs under ``auto``: the engine's check rebuilt in a fresh
    process from its recipe (``gpu_recipe``: vLLM's TRITON_ATTN, its real kernel in
    Triton's interpreter here), the verdict handed back exact and kept for the engine's
    own shapes (its versions, the resolved KV layout, no CUDA-graph mode)."""
    from feather_sched.attention.isolation import run_isolated

    builder = BUILDERS["triton"](SPEC, ["layer"], config_on, torch.device("cpu"))
    recipe = attention_subject.gpu_recipe(builder, config_on, SPEC)
    assert recipe.kwargs["backend"] == "TRITON_ATTN" and recipe.kwargs["device"] == "cpu"
    versions = dict(recipe.shapes.versions)
    assert versions["kv layout"].startswith("NHD") and "cuda graphs" not in versions
    assert {"flash-attn", "triton", "vllm", "gpu kernel"} <= set(versions)
    small = replace(recipe, factory="tests.helpers.triton_interpreter:with_vllm_triton_on",
                    kwargs={"factory": recipe.factory, "kwargs": recipe.kwargs},
                    run_kwargs={"grid": (Cell(64, 2, 2, suffix=9),), "exactness": (),
                                "idle": (Cell(64, 3, 1),), "reps": 1})
    verdict = run_isolated(small, timeout_s=400)
    assert verdict.shapes == recipe.shapes and verdict.max_error < 1e-5
    # The child ran under its plan's memory limit and out-of-memory score, and its own
    # peak is what it reports (printed: the figure check_memory's process bytes rest on).
    assert recipe.limits.oom_score_adj == 1000
    assert 0 < verdict.peak_host_bytes < recipe.limits.memory_bytes
    print(f"child peak host {verdict.peak_host_bytes >> 20} MiB, limit "
          f"{recipe.limits.memory_bytes >> 20} MiB")
    assert [c.cell for c in verdict.cells] == [Cell(64, 2, 2, suffix=9), Cell(64, 3, 1)]
