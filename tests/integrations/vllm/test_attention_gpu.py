"""Feather's shared-prefix variant of vLLM's TRITON_ATTN backend, on a machine without a GPU.

Covered: the plan's conversion to the Triton kernels' segments; the option and its default
(auto off on GPUs, with the logged reason; on; off; configurations it refuses); the
cudagraph support and what vLLM resolves from it; the plugin's registration and the check
``cuda.py`` runs on a selected backend (reproduced: ``vllm.platforms.cuda`` does not import
without CUDA); vLLM's real Triton builder producing the cut metadata and the grouped work
from a realistic ``CommonAttentionMetadata``; and, in a fresh process under
TRITON_INTERPRET=1, the whole forward: vLLM's own Triton kernel for the cut batch (2D and
3D launches) and Feather's kernels for the grouped rows, against float64 attention
and against vLLM's unmodified forward, all in fp32.

Not covered (no GPU): speed, real device copies and their synchronisation, CUDA graphs,
the model runners end to end, bf16/fp16 through vLLM's kernel (the interpreter multiplies
bf16 wrongly; Feather's kernels are tested in bf16 in ``tests/attention``), and loading
through the installed entry point (only its declaration in pyproject.toml is checked).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

if find_spec("vllm") is None:
    pytest.skip("the vllm extra is not installed", allow_module_level=True)

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


class _NoDriver:
    @staticmethod
    def is_active() -> bool:
        return False


if INTERPRETED:
    # vLLM's CPU wheel turns Triton off where Triton has no CPU backend, which leaves its
    # kernels undecorated; a stand-in entry (its driver is never used: the interpreter
    # needs none) keeps Triton on. It must precede vLLM's first import of Triton.
    assert "vllm.triton_utils" not in sys.modules
    from triton.backends import Backend, backends

    backends.setdefault("cpu", Backend(compiler=None, driver=_NoDriver))

from vllm.config import (  # noqa: E402
    CacheConfig,
    CompilationConfig,
    CUDAGraphMode,
    ModelConfig,
    VllmConfig,
)
from vllm.config.compilation import CompilationMode  # noqa: E402
from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.attention.backends.triton_attn import (  # noqa: E402
    TritonAttentionImpl,
    TritonAttentionMetadata,
    TritonAttentionMetadataBuilder,
)
from vllm.v1.attention.selector import AttentionSelectorConfig  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec  # noqa: E402

from feather_sched.attention.groups import find_groups, table_segments  # noqa: E402
from feather_sched.attention.partials import reference_attention  # noqa: E402
from feather_sched.integrations.vllm import attention_gpu as gpu  # noqa: E402
from feather_sched.models import TINY_LLAMA  # noqa: E402

BLOCK = 16
Q_HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64
"""The tiny model's heads with 2 KV heads (GQA 4), as vLLM's builder reads them."""
interpreted = pytest.mark.skipif(not INTERPRETED, reason="run by the fresh process that "
                                 "test_forward_in_the_triton_interpreter starts")


def make_config(feather: dict | None = None) -> VllmConfig:
    model = ModelConfig(model=str(TINY_LLAMA), dtype="float32", skip_tokenizer_init=True,
                        max_model_len=2048, hf_overrides={"num_key_value_heads": KV_HEADS})
    return VllmConfig(model_config=model, cache_config=CacheConfig(block_size=BLOCK),
                      additional_config={"feather": feather or {}})


@pytest.fixture(scope="module")
def config_on() -> VllmConfig:
    return make_config({"shared_prefix_attention": "on"})


@pytest.fixture(autouse=True)
def _options_from_the_config_only(monkeypatch) -> None:
    monkeypatch.delenv("FEATHER_SHARED_PREFIX_ATTENTION", raising=False)


@pytest.fixture
def announced(monkeypatch) -> list[str]:
    messages: list[str] = []
    monkeypatch.setattr(gpu, "announce", messages.append)
    return messages


SPEC = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM,
                         dtype=torch.float32)


# The conversion ------------------------------------------------------------------------


def test_table_segments_read_each_prefix_once_and_each_suffix_from_its_first_token():
    # Block size 4, groups from 2 shared blocks. Row 0, a prefill chunk of 3 tokens, and
    # rows 1 and 3 share blocks 10-12 (row 0 does not group); rows 2, 4 and 5 share 20-21;
    # row 6 is alone. Members index the grouped rows, in ``groups.rows`` order.
    table = torch.tensor([[10, 11, 12, 33, 0], [10, 11, 12, 30, 0], [20, 21, 40, 0, 0],
                          [10, 11, 12, 31, 32], [20, 21, 41, 0, 0], [20, 21, 42, 0, 0],
                          [50, 51, 52, 0, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([15, 14, 9, 17, 10, 12, 11], dtype=torch.int32)
    query_lens = np.array([3, 1, 1, 1, 1, 1, 1])
    groups = find_groups(table.numpy(), seq_lens.numpy(), query_lens, 4, 2)
    assert groups.rows.tolist() == [1, 3, 2, 5, 4]  # each group's first row, then the trie's
    prefix, suffix = table_segments(groups, seq_lens, 4)
    assert prefix.table_rows.tolist() == [1, 2]
    assert prefix.starts.tolist() == [0, 0]
    assert prefix.lengths.tolist() == [12, 8]
    assert prefix.members.tolist() == [[0, 1, -1], [2, 3, 4]]
    assert suffix.table_rows.tolist() == [1, 3, 2, 5, 4]
    assert suffix.starts.tolist() == [12, 12, 8, 8, 8]
    assert suffix.lengths.tolist() == [2, 5, 1, 4, 2]
    assert suffix.members.tolist() == [[0], [1], [2], [3], [4]]
    for segments in (prefix, suffix):
        tensors = (segments.table_rows, segments.starts, segments.lengths, segments.members)
        assert all(t.dtype == torch.int32 and t.is_contiguous() for t in tensors)


# The option, its default and the engine's CUDA graphs ------------------------------------


def test_auto_stays_off_on_gpus_and_says_why(announced):
    config = make_config()
    assert gpu.decide_gpu(config, SPEC) == gpu.AUTO_OFF
    assert gpu.AUTO_OFF == ("off: not yet verified on a GPU; shared_prefix_attention: on "
                            "enables it")
    builder = gpu.SharedPrefixTritonMetadataBuilder(SPEC, ["layer"], config,
                                                    torch.device("cpu"))
    assert announced == [gpu.AUTO_OFF]
    assert not builder.shared_prefixes
    assert type(builder.build(0, make_batch(decode_only=False).common)) is (
        TritonAttentionMetadata)


def test_on_acts_and_off_does_not(config_on, announced):
    assert gpu.decide_gpu(config_on, SPEC) is None
    builder = gpu.SharedPrefixTritonMetadataBuilder(SPEC, ["layer"], config_on,
                                                    torch.device("cpu"))
    assert builder.shared_prefixes and announced[0].startswith("on (Triton, block size 16")
    off = make_config({"shared_prefix_attention": "off"})
    assert gpu.decide_gpu(off, SPEC) == "off (option shared_prefix_attention)"


def test_configurations_it_cannot_serve_stay_off(config_on, monkeypatch):
    sliding = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM,
                                dtype=torch.float32, sliding_window=128)
    assert gpu.decide_gpu(config_on, sliding) == "off for SlidingWindowSpec layers"
    windowed = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM,
                                 dtype=torch.float32, sliding_window=128)
    assert gpu.decide_gpu(config_on, windowed) == ("off for sliding-window, chunked or "
                                                   "non-causal layers")
    monkeypatch.setattr(config_on, "speculative_config", object())
    assert gpu.decide_gpu(config_on, SPEC) == "off with speculative decoding"
    monkeypatch.setattr(config_on.cache_config, "enable_prefix_caching", False)
    assert gpu.decide_gpu(config_on, SPEC) == ("off without prefix caching (no two rows can "
                                               "share a block)")


def test_no_full_cuda_graphs_while_on(config_on):
    builder, auto = gpu.SharedPrefixTritonMetadataBuilder, make_config()
    assert builder.get_cudagraph_support(config_on, SPEC) == AttentionCGSupport.NEVER
    assert builder.get_cudagraph_support(auto, SPEC) == AttentionCGSupport.ALWAYS  # Triton's
    # What vLLM 0.32 then resolves: its default FULL_AND_PIECEWISE becomes PIECEWISE
    # (attention is a splitting op), and an explicit FULL is refused.
    def resolve(mode: CUDAGraphMode) -> CUDAGraphMode:
        compilation = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=mode,
                                        splitting_ops=list(CompilationConfig._attention_ops))
        return compilation.resolve_cudagraph_mode_and_sizes(AttentionCGSupport.NEVER, "x")

    assert resolve(CUDAGraphMode.FULL_AND_PIECEWISE) == CUDAGraphMode.PIECEWISE
    with pytest.raises(ValueError, match="PIECEWISE"):
        resolve(CUDAGraphMode.FULL)


def test_the_plugin_registers_the_custom_backend_only():
    custom = AttentionBackendEnum.CUSTOM
    custom.clear_override()  # an engine built earlier in this process loaded the plugins
    try:
        gpu.register()
        backend = custom.get_class()
        assert backend is gpu.SharedPrefixTritonBackend
        assert AttentionBackendEnum.TRITON_ATTN.get_class().__module__ != gpu.__name__
        # cuda.py's check of a selected backend (platforms/cuda.py get_attn_backend_cls).
        selector = AttentionSelectorConfig(head_size=128, dtype=torch.bfloat16,
                                           kv_cache_dtype="auto", block_size=16)
        assert backend.validate_configuration(device_capability=DeviceCapability(9, 0),
                                              **selector._asdict()) == []
        assert AttentionBackendEnum[backend.get_name()] == AttentionBackendEnum.TRITON_ATTN
    finally:
        custom.clear_override()
    pyproject = tomllib.loads((Path(__file__).parents[3] / "pyproject.toml").read_text())
    plugins = pyproject["project"]["entry-points"]["vllm.general_plugins"]
    assert f"{gpu.__name__}:register" in plugins.values()


def test_layers_the_kernels_cannot_serve_say_why():
    impl = object.__new__(gpu.SharedPrefixTritonImpl)
    impl.attn_type, impl.sliding_window, impl.alibi_slopes = "decoder", (-1, -1), None
    impl.logits_soft_cap, impl.sinks, impl.kv_cache_dtype = 0, None, "auto"
    impl.head_size = 64
    query, cache = torch.zeros(2, 8, 64), torch.zeros(3, 2, 16, 128)
    assert impl._layer_problem(query, cache, None) is None
    assert impl._layer_problem(query, cache, torch.ones(1)) == "fused output quantization"
    impl.head_size = 96
    assert impl._layer_problem(query, cache, None) == ("head size 96 (not a power of two "
                                                       ">= 16)")
    impl.head_size, impl.sliding_window = 64, (127, 0)
    assert impl._layer_problem(query, cache, None) == "a sliding window"
    impl.sliding_window, impl.kv_cache_dtype = (-1, -1), "fp8_e4m3"
    assert impl._layer_problem(query, cache, None) == "a quantized KV cache"


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


def test_the_builder_cuts_grouped_rows_and_hands_over_their_work(config_on):
    batch = make_batch(decode_only=False)
    common = batch.common
    metadata = gpu.SharedPrefixTritonMetadataBuilder(SPEC, ["layer"], config_on,
                                                     torch.device("cpu")).build(0, common)
    stock = TritonAttentionMetadataBuilder(SPEC, ["layer"], config_on,
                                           torch.device("cpu")).build(0, common)
    assert isinstance(metadata, gpu.SharedPrefixTritonMetadata)
    assert torch.equal(metadata.original.block_table, stock.block_table)
    assert torch.equal(metadata.original.seq_lens, stock.seq_lens)
    shared = {row: n for rows, n in zip(batch.groups, (18, 16), strict=True) for row in rows}
    assert sorted(shared) == [1, 2, 4, 5, 6]
    assert metadata.block_table is stock.block_table
    assert metadata.seq_lens.tolist() == [1 if row in shared else int(length)
                                          for row, length in enumerate(common.seq_lens)]
    work = metadata.work
    starts = common.query_start_loc_cpu
    grouped = work.prefix.members[work.prefix.members >= 0]
    assert sorted(work.tokens[grouped].tolist()) == sorted(int(starts[r]) for r in shared)
    assert work.prefix.lengths.tolist() == [18 * BLOCK, 16 * BLOCK]
    assert work.longest == (18 * BLOCK, 300 + 40 - 18 * BLOCK)
    rows_of_tokens = {int(starts[r]): r for r in shared}
    for row, start, length in zip(work.suffix.table_rows.tolist(), work.suffix.starts.tolist(),
                                  work.suffix.lengths.tolist(), strict=True):
        assert start == shared[row] * BLOCK and start + length == int(common.seq_lens[row])
    assert [rows_of_tokens[t] for t in work.tokens.tolist()] == work.suffix.table_rows.tolist()


def test_a_step_without_groups_is_vllms_own(config_on):
    batch = make_batch(decode_only=True)
    common = batch.common
    table = common.block_table_tensor
    table[:] = torch.arange(table.numel(), dtype=torch.int32).view_as(table)  # none shared
    builder = gpu.SharedPrefixTritonMetadataBuilder(SPEC, ["layer"], config_on,
                                                    torch.device("cpu"))
    assert type(builder.build(0, common)) is TritonAttentionMetadata


# The whole forward, in Triton's interpreter ------------------------------------------------


def test_forward_in_the_triton_interpreter():
    if INTERPRETED:
        pytest.skip("this is that process")
    if find_spec("triton") is None:
        pytest.skip("needs Triton")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         f"{__file__}::test_interpreted_forward_matches_float64_and_vllms_forward",
         f"{__file__}::test_interpreted_layer_that_cannot_act_runs_vllms_forward"],
        env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=Path(__file__).parents[3],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "3 passed" in result.stdout, result.stdout[-2000:]


LAYER = SimpleNamespace(_q_scale=torch.ones(1), _k_scale=torch.ones(1), _v_scale=torch.ones(1))


def run_forward(impl: TritonAttentionImpl, batch: Batch, metadata: TritonAttentionMetadata,
                forward=None) -> torch.Tensor:
    output = torch.full_like(batch.query, float("nan"))
    (forward or type(impl).forward)(impl, LAYER, batch.query, None, None, batch.kv_cache,
                                    metadata, output)
    return output


def make_impl(**options) -> gpu.SharedPrefixTritonImpl:
    return gpu.SharedPrefixTritonImpl(Q_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, KV_HEADS, None,
                                      None, "auto", **options)


@interpreted
@pytest.mark.parametrize("decode_only", [False, True], ids=["mixed-2d", "decode-3d"])
def test_interpreted_forward_matches_float64_and_vllms_forward(config_on, decode_only):
    batch = make_batch(decode_only)
    metadata = gpu.SharedPrefixTritonMetadataBuilder(SPEC, ["layer"], config_on,
                                                     torch.device("cpu")).build(0, batch.common)
    assert isinstance(metadata, gpu.SharedPrefixTritonMetadata)
    impl = make_impl()
    ours = run_forward(impl, batch, metadata)
    stock = run_forward(impl, batch, metadata.original, TritonAttentionImpl.forward)
    grouped = {row for rows in batch.groups for row in rows}
    starts = batch.common.query_start_loc_cpu.tolist()
    worst = 0.0
    for row, (keys, values) in enumerate(batch.contexts):
        for token in range(starts[row], starts[row + 1]):
            visible = len(keys) - (starts[row + 1] - 1 - token)
            expected, _ = reference_attention(batch.query[token], keys[:visible],
                                              values[:visible], impl.scale)
            error = float((ours[token].double() - expected).abs().max() / expected.abs().max())
            worst = max(worst, error)
            if row in grouped:
                assert torch.allclose(ours[token], stock[token], rtol=1e-5, atol=1e-6)
            else:
                assert torch.equal(ours[token], stock[token]), row
    assert worst < 1e-5
    assert impl.acts


@interpreted
def test_interpreted_layer_that_cannot_act_runs_vllms_forward(config_on):
    batch = make_batch(decode_only=True)
    metadata = gpu.SharedPrefixTritonMetadataBuilder(SPEC, ["layer"], config_on,
                                                     torch.device("cpu")).build(0, batch.common)
    impl = make_impl(logits_soft_cap=30.0)
    ours = run_forward(impl, batch, metadata)
    assert impl.acts is False
    assert torch.equal(ours, run_forward(impl, batch, metadata.original,
                                         TritonAttentionImpl.forward))
