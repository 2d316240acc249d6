"""Shared-prefix decode in SGLang's Triton backend: on SGLang's own pools, SGLang's own
Triton decode kernel (``decode_attention_fwd``) over the batch with grouped rows cut, then
Feather's grouped decode over the pool, in Triton's interpreter, against float64: the
kernels on their own, SGLang's backend and Feather's subclass of it eagerly and through
SGLang's decode-graph hooks (capture, then replays of other steps), and the GPU
self-check's subject.

The cache is fp16 and the tolerance bf16's: SGLang's decode kernel returns garbage for
bf16 in the interpreter (its bf16 arithmetic is numpy's there, not the GPU's), and
Feather's kernels are checked in bf16 on their own (``tests/attention``)."""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from feather_sched.bench.cht.sglang_policy import sglang_installed
from tests.helpers.timers import timed_as
from tests.helpers.triton_interpreter import INTERPRETED, only_interpreted, run_interpreted

if not sglang_installed():
    pytest.skip("SGLang is not installed (scripts/setup.sh --sglang)", allow_module_level=True)

from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

from feather_sched.attention import selfcheck
from feather_sched.attention.gpu_decode import DecodeLimits, GroupedDecode
from feather_sched.attention.partials import reference_attention
from feather_sched.attention.selfcheck import Cell
from feather_sched.integrations.sglang import attention, shared_decode

interpreted = only_interpreted("test_kernels_in_the_triton_interpreter")
DIM, SLOTS = 64, 4096


def test_kernels_in_the_triton_interpreter() -> None:
    if INTERPRETED:
        pytest.skip("this is that process")
    result = run_interpreted(__file__)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


def test_a_grouped_step_in_the_triton_interpreter() -> None:
    """``make check``'s sample of the above (``slow``, left to ``make test``): one paged
    GQA step against SGLang's kernel."""
    if INTERPRETED:
        pytest.skip("this is that process")
    result = run_interpreted(
        f"{__file__}::test_grouped_rows_by_feathers_kernels_and_the_rest_by_sglangs[16-8-2]")
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "1 passed" in result.stdout, result.stdout[-2000:]


def sglang_decode(q, keys, values, out, slot_rows, lens, page):
    """SGLang's Triton decode kernel over rows of slots, with the metadata its backend
    builds for a decode batch (``kv_indptr`` from the lengths, ``kv_indices`` the rows'
    slots, fp32 split logits and LSE)."""
    from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd

    splits = 4
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(lens, 0)
    indices = torch.cat([row[:n] for row, n in zip(slot_rows, lens.tolist(), strict=True)])
    rows, heads = q.shape[:2]
    decode_attention_fwd(q, keys, values, out, indptr, indices.long(),
                         torch.empty(rows, heads, splits, DIM), torch.empty(rows, heads, splits),
                         torch.full((rows,), splits, dtype=torch.int32), splits, DIM ** -0.5,
                         1.0, 1.0, page_size=page)


class Pools:
    """SGLang's pools for one layer (fp16, random KV, page 0 left as padding) and a free
    list of pages to allocate rows of slots from."""

    def __init__(self, page: int, kv_heads: int, seed: int, rows: int = 16,
                 context: int = 512) -> None:
        self.page, self.rng = page, np.random.default_rng(seed)
        generator = torch.Generator().manual_seed(seed)
        self.kv = MHATokenToKVPool(size=SLOTS, page_size=page, dtype=torch.float16,
                                   head_num=kv_heads, head_dim=DIM, layer_num=1, device="cpu",
                                   enable_memory_saver=False)
        for buffer in (self.kv.k_buffer[0], self.kv.v_buffer[0]):
            buffer.copy_(torch.randn(buffer.shape, generator=generator).to(torch.float16))
        self.free = self.rng.permutation(np.arange(1, SLOTS // page)).tolist()
        self.req_to_token = ReqToTokenPool(size=rows, max_context_len=context, device="cpu",
                                           enable_memory_saver=False)
        table = self.req_to_token.req_to_token
        table[:] = torch.from_numpy(self.rng.integers(1, SLOTS, table.shape).astype(np.int32))

    def allocate(self, tokens: int) -> list[int]:
        pages = [self.free.pop() for _ in range(-(-tokens // self.page))]
        return [p * self.page + i for p in pages for i in range(self.page)][:tokens]

    def place(self, rows: list[list[int]]) -> torch.Tensor:
        """Rows of slots written at shuffled pool rows (past them, a stale tail); the pool
        rows, int64."""
        pool_rows = self.rng.permutation(np.arange(1, self.req_to_token.size))[:len(rows)]
        for at, row in zip(pool_rows.tolist(), rows, strict=True):
            self.req_to_token.req_to_token[at, :len(row)] = torch.tensor(row, dtype=torch.int32)
        return torch.from_numpy(pool_rows.astype(np.int64))

    def batch(self, rows: list[list[int]]) -> ForwardBatch:
        """A decode step over rows of slots, each ending with this step's token's slot."""
        lens = torch.tensor([len(r) for r in rows])
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=len(rows),
            input_ids=torch.zeros(len(rows), dtype=torch.long), req_pool_indices=self.place(rows),
            seq_lens=lens, out_cache_loc=torch.tensor([r[-1] for r in rows]),
            seq_lens_sum=int(lens.sum()), seq_lens_cpu=lens.clone())

    def reference(self, query: torch.Tensor, rows: list[list[int]]) -> list[torch.Tensor]:
        keys, values = self.kv.k_buffer[0], self.kv.v_buffer[0]
        return [reference_attention(query[row], keys[torch.tensor(slots)],
                                    values[torch.tensor(slots)], DIM ** -0.5)[0]
                for row, slots in enumerate(rows)]


def mixed_rows(pools: Pools) -> tuple[list[list[int]], set[int]]:
    """Two groups (one prefix ending mid-page at page 16), a singleton, interleaved; and the
    rows that group."""
    a, b = pools.allocate(160), pools.allocate(96)
    rows = [a + pools.allocate(21), pools.allocate(130), b + pools.allocate(5),
            a + pools.allocate(1), b + pools.allocate(40), a + pools.allocate(33),
            b + pools.allocate(70)]
    return rows, {0, 2, 3, 4, 5, 6}


def assert_close(out: torch.Tensor, expected: list[torch.Tensor]) -> None:
    for row, reference in enumerate(expected):
        error = (out[row].double() - reference).norm() / reference.norm()
        assert error < 2e-2, (row, float(error))


@interpreted
@pytest.mark.parametrize(("q_heads", "kv_heads"), [(4, 4), (8, 2)])
@pytest.mark.parametrize("page", [1, 16])
def test_grouped_rows_by_feathers_kernels_and_the_rest_by_sglangs(q_heads, kv_heads, page):
    from feather_sched.integrations.sglang.attention_triton import TritonStep, paged

    pools = Pools(page, kv_heads, seed=page)
    rows, grouped = mixed_rows(pools)
    pool_rows = pools.place(rows)
    table = pools.req_to_token.req_to_token
    lens = torch.tensor([len(r) for r in rows])
    decode = GroupedDecode(DecodeLimits.for_device(1, 16, q_heads, kv_heads, DIM), "cpu")
    step = TritonStep.plan(decode, table, pool_rows, lens, page, 64)
    assert step is not None and set(step.groups.rows.tolist()) == grouped
    assert sorted(step.groups.shared.tolist()) == [96 // page, 160 // page]  # pages
    assert step.cut_lens.tolist() == [1 if i in grouped else n for i, n in enumerate(lens)]

    generator = torch.Generator().manual_seed(q_heads)
    query = torch.randn(len(rows), q_heads, DIM, generator=generator).to(torch.float16)
    out = torch.empty_like(query)
    keys, values = pools.kv.k_buffer[0], pools.kv.v_buffer[0]
    sglang_decode(query, keys, values, out, [table[r] for r in pool_rows], step.cut_lens, page)
    sglangs = out.clone()
    decode.run(query, paged(keys, page), paged(values, page), table[:, ::page], DIM ** -0.5,
               out)
    assert_close(out, pools.reference(query, rows))
    for row in set(range(len(rows))) - grouped:  # SGLang's kernel served it, untouched
        assert torch.equal(out[row], sglangs[row])


@pytest.fixture
def sglang_server(monkeypatch, tmp_path):
    """What SGLang's server process publishes and a backend reads: its server arguments and
    parallel context (one rank); a cache directory of its own for verdicts."""
    from sglang.srt.runtime_context import get_context, get_parallel

    monkeypatch.setenv("FEATHER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(shared_decode.announce, "said", set())
    with contextlib.ExitStack() as stack:
        stack.enter_context(get_context().override_server_args(device="cpu"))
        stack.enter_context(get_parallel().override(attn_dcp_rank=0, attn_dcp_size=1,
                                                    attn_tp_size=1, tp_size=1))
        yield tmp_path


def model_runner(pools: Pools, q_heads: int, directory) -> SimpleNamespace:
    """A model runner as SGLang's Triton backend reads it: SGLang's ``ModelConfig`` of a
    local Llama config, the pools, SGLang's KV id translator over them."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator

    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": q_heads * DIM,
        "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": q_heads,
        "num_key_value_heads": pools.kv.head_num, "head_dim": DIM,
        "max_position_embeddings": pools.req_to_token.max_context_len, "vocab_size": 128,
        "torch_dtype": "float16"}))
    allocator = SimpleNamespace()
    return SimpleNamespace(
        device="cpu", gpu_id=0, page_size=pools.page, model_config=ModelConfig(str(directory)),
        req_to_token_pool=pools.req_to_token, token_to_kv_pool=pools.kv,
        token_to_kv_pool_allocator=allocator, sliding_window_size=None,
        kv_cache_dtype=torch.float16, is_draft_worker=False, use_mla_backend=False,
        spec_algorithm=SimpleNamespace(is_dspark=lambda: False),
        decode_num_tokens_per_req=lambda: 1,
        kv_index_translator=KVIndexTranslator(
            req_to_token=pools.req_to_token.req_to_token, token_to_kv_pool_allocator=allocator,
            token_to_kv_pool=pools.kv, page_size=pools.page, device="cpu"))


def decode_step(backend, query: torch.Tensor, batch: ForwardBatch, layer) -> torch.Tensor:
    backend.init_forward_metadata(batch)
    out = backend.forward_decode(query.flatten(1), None, None, layer, batch,
                                 save_kv_cache=False)
    return out.view(query.shape)


@interpreted
@pytest.mark.parametrize("page", [1, 16])
def test_the_backend_decodes_a_step_as_sglangs_own(page, sglang_server):
    """SGLang's ``TritonAttnBackend`` and Feather's subclass of it on one step: the grouped
    rows within bf16 tolerance of float64, the others exactly SGLang's; a step where rows
    start in distinct slots plans nothing."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
    from sglang.srt.layers.radix_attention import RadixAttention

    from feather_sched.integrations.sglang.attention_triton import SharedPrefixTritonBackend

    pools = Pools(page, 2, seed=3)
    runner = model_runner(pools, 8, sglang_server / "model")
    layer = RadixAttention(num_heads=8, head_dim=DIM, scaling=DIM ** -0.5, num_kv_heads=2,
                           layer_id=0)
    rows, grouped = mixed_rows(pools)
    batch = pools.batch(rows)
    query = torch.randn(len(rows), 8, DIM).to(torch.float16)
    sglangs = decode_step(TritonAttnBackend(runner), query, batch, layer)
    shared = SharedPrefixTritonBackend(runner, 64)
    out = decode_step(shared, query, batch, layer)
    assert set(shared.step[1].groups.rows.tolist()) == grouped
    assert batch.seq_lens.tolist() == [len(r) for r in rows]  # SGLang's batch untouched
    assert_close(out, pools.reference(query, rows))
    ungrouped = sorted(set(range(len(rows))) - grouped)
    assert torch.equal(out[ungrouped], sglangs[ungrouped])
    alone = pools.batch([pools.allocate(200) for _ in range(3)])
    decode_step(shared, query[:3], alone, layer)
    assert shared.step == (alone, None)


@interpreted
def test_decode_graphs_replay_each_steps_groups(sglang_server):
    """SGLang's decode-graph protocol without a GPU: ``init_cuda_graph_state``, the capture
    hook and one forward of the captured batch (what the graph records), then for each
    replay the hook on that step's batch and the captured batch's forward again, as the
    replayed graph runs it (same buffers, nothing planned in it): a grouped step, a step
    where nothing groups (the staged groups cleared), a grouped one again."""
    from sglang.srt.layers.radix_attention import RadixAttention

    from feather_sched.integrations.sglang.attention_triton import (
        GRAPHED,
        SharedPrefixTritonBackend,
    )

    pools = Pools(16, 2, seed=5)
    runner = model_runner(pools, 8, sglang_server / "model")
    layer = RadixAttention(num_heads=8, head_dim=DIM, scaling=DIM ** -0.5, num_kv_heads=2,
                           layer_id=0)
    shared = SharedPrefixTritonBackend(runner, 64)
    bs = 7
    shared.init_cuda_graph_state(bs, bs)
    captured = ForwardBatch(
        forward_mode=ForwardMode.DECODE, batch_size=bs,
        input_ids=torch.zeros(bs, dtype=torch.long),
        req_pool_indices=torch.zeros(bs, dtype=torch.int64), seq_lens=torch.ones(bs).long(),
        out_cache_loc=torch.zeros(bs, dtype=torch.int64), seq_lens_sum=bs,
        seq_lens_cpu=torch.ones(bs).long())
    shared.init_forward_metadata_out_graph(captured, in_capture=True)
    assert shared.step == (captured, GRAPHED)
    query = torch.zeros(bs, 8 * DIM, dtype=torch.float16)  # the graph's input buffer
    shared.forward_decode(query, None, None, layer, captured, save_kv_cache=False)
    assert shared.graph_acts
    grouped_rows, grouped = mixed_rows(pools)
    lonely_rows = [pools.allocate(90 + 10 * i) for i in range(bs)]
    for rows in (grouped_rows, lonely_rows, grouped_rows):
        step = pools.batch(rows)
        query.copy_(torch.randn(bs, 8 * DIM).to(torch.float16))
        shared.init_forward_metadata_out_graph(step)
        assert shared.step == (captured, GRAPHED)  # a replay plans, and runs no layer
        cut = [1 if rows is grouped_rows and i in grouped else len(r)
               for i, r in enumerate(rows)]
        assert shared.forward_metadata.kv_indptr.diff().tolist() == cut  # SGLang's buffers
        out = shared.forward_decode(query, None, None, layer, captured, save_kv_cache=False)
        assert_close(out.view(bs, 8, DIM), pools.reference(query.view(bs, 8, DIM), rows))


TINY = {"grid": (Cell(64, 2, 2, suffix=8), Cell(128, 1, 3, suffix=8)),
        "exactness": (Cell(40, 2, 2, suffix=5),), "idle": (Cell(64, 3, 1),), "reps": 1}
"""Cells small enough for Triton's interpreter."""


@interpreted
def test_the_gpu_self_check_runs_sglangs_triton_backend_against_the_path(sglang_server,
                                                                         monkeypatch):
    """``SglangTritonSubject`` from plain shapes (``triton_subject``: SGLang's pools and
    a model runner stand-in, here on the interpreter's CPU tensors): every cell exact
    against SGLang's backend and float64, a whole step of the model's layers timed, the
    step where nothing groups timed too (the path pays a sync there); its shapes are the
    ones its recipe names."""
    from feather_sched.integrations.sglang.attention_check import (
        SglangTritonSubject,
        TritonShapes,
        triton_recipe,
        triton_subject,
    )

    monkeypatch.setattr(SglangTritonSubject, "seconds", timed_as(128))
    shapes = TritonShapes(8, 2, DIM, "float16", 16, 2, 64, 4096, "cpu")
    subject = triton_subject(shapes, (("sglang", "test"),))
    assert subject.idle_cost and subject.shapes.layout == "nhd"
    assert ("layers per step", "2") in subject.shapes.versions
    assert subject.shapes.versions[-2:] == (("backend", "TritonAttnBackend"),
                                            ("layers per step", "2"))
    recipe = triton_recipe(shapes, (("sglang", "test"),))
    assert recipe.shapes == triton_subject(shapes, recipe.kwargs["versions"]).shapes
    verdict = selfcheck.check(subject, **TINY)
    assert verdict.on and verdict.min_shared_tokens == 128, verdict.line()
    assert all(c.error < selfcheck.TOLERANCE["float16"] for c in verdict.cells)
    assert any(c.reference_error is not None for c in verdict.cells)
    assert [c.cell.idle for c in verdict.cells].count(True) == 1
    monkeypatch.undo()  # the subject's own timing, with a fake GPU clock


def test_on_a_gpu_a_step_is_its_eager_host_part_then_its_layers_replayed(monkeypatch):
    """``SglangTritonSubject.seconds`` with a CUDA timer: the step's metadata and plan
    (a sync: never captured) by the wall clock, then only its layers captured and
    replayed, as SGLang's decode graphs run them."""
    from feather_sched.attention.timing import GraphTimer
    from feather_sched.integrations.sglang.attention_check import SglangTritonSubject

    calls = []

    class Trial:
        def backend(self, name):
            return name

        def prepare(self, backend):
            calls.append(("prepare", backend))

        def run_layers(self, backend):
            calls.append(("layers", backend))

        def shared(self):
            raise AssertionError("the whole step is never captured")

    class Graph:
        def replay(self):
            calls.append("replay")

    class Event:
        def record(self):
            pass

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return 2.0  # ms

    subject = SglangTritonSubject.__new__(SglangTritonSubject)
    subject._wall = lambda run, reps: (run(), 0.5)[1]
    subject._timer = GraphTimer(lambda: None, Graph, Event, lambda graph, run: run())
    assert subject.seconds(Trial().shared, 3) == pytest.approx(0.5 + 2e-3)
    assert calls[0] == ("prepare", "shared") and calls.count("replay") == 4
    assert ("layers", "shared") in calls


def test_a_gpu_servers_check_that_dies_leaves_it_up_and_auto_off(sglang_server, monkeypatch,
                                                                 caplog):
    """``create_backend``'s route on a GPU server (``self_check`` -> its recipe, the
    server's shapes -> ``run_isolated`` -> ``checked`` with the TP vote): a check process
    that is killed leaves this process up and the verdict off with the reason (a death or
    hang after SGLang's subject was built in the child: tests/attention/test_isolation.py)."""
    from feather_sched.attention import isolation
    from feather_sched.integrations.sglang import attention_check

    real = attention_check.triton_recipe
    shapes = []
    monkeypatch.setattr(attention_check, "triton_recipe", lambda *args: shapes.append(
        real(*args).shapes) or replace(real(*args), factory="tests.attention.test_isolation:killed",
                                        kwargs={}))
    monkeypatch.setattr(isolation, "TIMEOUT_S", 20.0)
    pools = Pools(16, 2, seed=11)
    runner = model_runner(pools, 8, sglang_server / "model")
    verdict, why = selfcheck.checked(lambda: attention.self_check("triton", runner),
                                     attention.tp_agreed)
    assert verdict is None and why.startswith("off: the self-check could not run (")
    assert "killed by SIGKILL" in why, why
    assert shapes and shapes[0].q_heads == runner.model_config.get_num_attention_heads(1)


def test_fa3_and_flashinfer_stay_sglangs_with_the_reason_logged(monkeypatch, caplog):
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    monkeypatch.setattr(shared_decode.announce, "said", set())
    caplog.set_level(logging.INFO, logger=attention.logger.name)
    attention.register()
    attention.register()  # idempotent: SGLang's factory stays the one wrapped
    made = []
    monkeypatch.setattr(ATTENTION_BACKENDS["fa3"], "sglangs", made.append)
    runner = SimpleNamespace()
    ATTENTION_BACKENDS["fa3"](runner)
    assert made == [runner]
    assert "off for the fa3 backend: its decode is FlashAttention-3's" in caplog.text
    assert ATTENTION_BACKENDS["triton"].__name__ == "create_feather_triton_backend"


def test_triton_acts_only_on_a_cuda_device():
    runner = SimpleNamespace(device="cpu", use_mla_backend=False, token_to_kv_pool=None)
    for mode in ("on", "auto"):
        assert attention.decide("triton", runner, mode, True).startswith(
            "off for device cpu (the triton path runs on CUDA devices)")


def test_triton_stays_off_where_sglang_replays_metadata_without_python(sglang_server,
                                                                        monkeypatch):
    """On a CUDA runner (as ``decide`` reads it), SGLang's metadata glue graph, two-batch
    overlap, decode context parallelism and translated KV ids each keep the path off."""
    from sglang.srt.environ import envs
    from sglang.srt.runtime_context import get_parallel

    runner = SimpleNamespace(device="cuda", use_mla_backend=False,
                             token_to_kv_pool=MHATokenToKVPool.__new__(MHATokenToKVPool),
                             kv_index_translator=SimpleNamespace(is_translating=False))
    assert attention.decide("triton", runner, "on", True) is None
    with monkeypatch.context() as patched:
        patched.setattr(envs.SGLANG_ENABLE_METADATA_GLUE_GRAPH, "get", lambda: True)
        assert "metadata glue graph" in attention.decide("triton", runner, "on", True)
    runner.kv_index_translator.is_translating = True
    assert "translated KV ids" in attention.decide("triton", runner, "on", True)
    runner.kv_index_translator.is_translating = False
    with get_parallel().override(attn_dcp_size=2):
        assert "decode context parallelism" in attention.decide("triton", runner, "on", True)
