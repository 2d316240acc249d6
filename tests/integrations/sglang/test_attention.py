"""Shared-prefix decode inside SGLang's torch_native backend, one layer at a time, on
SGLang's own pools (``ReqToTokenPool``, ``MHATokenToKVPool``), ``ForwardBatch`` and
``RadixAttention``, against SGLang's own ``TorchNativeAttnBackend``."""

from __future__ import annotations

import copy
import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from feather_sched.bench.cht.sglang_policy import sglang_installed

if not sglang_installed():
    pytest.skip("SGLang is not installed (scripts/setup.sh --sglang)", allow_module_level=True)

from sglang.srt.layers.attention.torch_native_backend import (
    TorchNativeAttnBackend,
)
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import (
    ForwardBatch,
    ForwardMode,
)

from feather_sched.attention import selfcheck
from feather_sched.attention.partials import reference_attention
from feather_sched.integrations.sglang import attention, attention_check, shared_decode
from feather_sched.integrations.sglang.scheduler import ENV_ENABLE
from tests.helpers.timers import timed_as

Q_HEADS, KV_HEADS, DIM, SLOTS = 8, 2, 64, 8192


@pytest.fixture(autouse=True)
def server_context(monkeypatch, tmp_path):
    """What a server process has and these tests do not: SGLang's parallel context (one
    rank), a cache directory of its own for the self-check's verdicts, and the check's
    timer stood in (the path measured faster everywhere) unless a test stands in another;
    SGLang's kernel and the path still run on every cell, for exactness."""
    import sglang.srt.runtime_context

    monkeypatch.setattr(sglang.srt.runtime_context, "get_parallel",
                        lambda: SimpleNamespace(tp_size=1))
    monkeypatch.setenv("FEATHER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(attention_check.SglangCpuSubject, "seconds", timed_as(0))
    monkeypatch.setattr(shared_decode.announce, "said", set())


class Engine:
    """SGLang's pools for one layer, filled with random KV, and a runner as the backends
    read it."""

    def __init__(self, page: int, dtype: torch.dtype, seed: int = 0) -> None:
        self.page, self.dtype = page, dtype
        self.rng = np.random.default_rng(seed)
        self.free = self.rng.permutation(np.arange(1, SLOTS // page)).tolist()  # page 0: padding
        self.kv = MHATokenToKVPool(size=SLOTS, page_size=page, dtype=dtype, head_num=KV_HEADS,
                                   head_dim=DIM, layer_num=1, device="cpu",
                                   enable_memory_saver=False)
        self.req_to_token = ReqToTokenPool(size=32, max_context_len=2048, device="cpu",
                                           enable_memory_saver=False)
        generator = torch.Generator().manual_seed(seed)
        for buffer in (self.kv.k_buffer[0], self.kv.v_buffer[0]):
            buffer.copy_(torch.randn(buffer.shape, generator=generator).to(dtype))
        self.runner = SimpleNamespace(device="cpu", req_to_token_pool=self.req_to_token,
                                      token_to_kv_pool=self.kv, page_size=page,
                                      use_mla_backend=False, model_config=SimpleNamespace(
                                          get_num_attention_heads=lambda tp: Q_HEADS // tp))
        self.layer = RadixAttention(num_heads=Q_HEADS, head_dim=DIM, scaling=DIM ** -0.5,
                                    num_kv_heads=KV_HEADS, layer_id=0)

    def allocate(self, tokens: int) -> list[int]:
        pages = [self.free.pop() for _ in range(-(-tokens // self.page))]
        return [p * self.page + i for p in pages for i in range(self.page)][:tokens]

    def decode_batch(self, rows: list[list[int]]) -> ForwardBatch:
        """A decode step over rows of slots (each ending with this step's token's slot),
        at shuffled pool rows whose stale tail still holds another request's slots."""
        pool_rows = self.rng.permutation(np.arange(1, 33))[:len(rows)]
        table = self.req_to_token.req_to_token
        table[:] = torch.from_numpy(self.rng.integers(1, SLOTS, table.shape).astype(np.int32))
        for at, row in zip(pool_rows, rows, strict=True):
            table[at, :len(row)] = torch.tensor(row, dtype=torch.int32)
        lens = torch.tensor([len(r) for r in rows])
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=len(rows),
            input_ids=torch.zeros(len(rows), dtype=torch.long),
            req_pool_indices=torch.from_numpy(pool_rows.astype(np.int64)), seq_lens=lens,
            out_cache_loc=torch.tensor([r[-1] for r in rows]), seq_lens_sum=int(lens.sum()),
            seq_lens_cpu=lens.clone())

    def step_inputs(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q as a model slices it from its fused qkv projection (strided), this step's k, v."""
        qkv = torch.randn(rows, (Q_HEADS + 2 * KV_HEADS) * DIM).to(self.dtype)
        q, k, v = qkv.split([Q_HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM], dim=-1)
        return q, k.reshape(rows, KV_HEADS, DIM), v.reshape(rows, KV_HEADS, DIM)


def mixed_rows(engine: Engine) -> tuple[list[list[int]], set[int]]:
    """Two prefix groups (one ending mid-chunk at page size 1), a singleton, a pair under
    the threshold, interleaved; and the rows that group."""
    long_a = 300 if engine.page == 1 else 320
    a, b, short = engine.allocate(long_a), engine.allocate(512), engine.allocate(96)
    rows = [a + engine.allocate(41), b + engine.allocate(7), engine.allocate(600),
            a + engine.allocate(90), short + engine.allocate(30), b + engine.allocate(200),
            a + engine.allocate(17), short + engine.allocate(5), b + engine.allocate(1)]
    return rows, {0, 1, 3, 5, 6, 8}


@pytest.mark.parametrize("page", [1, 16])
def test_forward_decode_matches_sglangs_own_in_fp32(page):
    engine = Engine(page, torch.float32)
    rows, grouped = mixed_rows(engine)
    batch = engine.decode_batch(rows)
    q, k, v = engine.step_inputs(len(rows))
    own = TorchNativeAttnBackend(engine.runner)
    own.init_forward_metadata(batch)
    expected = own.forward_decode(q, k, v, engine.layer, batch)
    shared = attention.SharedPrefixTorchNativeBackend(engine.runner, 256)
    shared.init_forward_metadata(batch)
    plan = shared.step[1]
    assert plan is not None and set(plan.groups.rows.tolist()) == grouped
    got = shared.forward_decode(q, k, v, engine.layer, batch)
    assert batch.seq_lens.tolist() == [len(r) for r in rows]  # SGLang's batch untouched
    error = (got - expected).abs().view(len(rows), -1).max(dim=1).values
    assert error.max() < 1e-5, error
    ungrouped = [i for i in range(len(rows)) if i not in grouped]
    assert torch.equal(got[ungrouped], expected[ungrouped])  # SGLang's kernel served them


def test_forward_decode_in_bf16_is_as_close_to_float64_as_sglangs_own():
    engine = Engine(1, torch.bfloat16)
    rows, _ = mixed_rows(engine)
    batch = engine.decode_batch(rows)
    q, k, v = engine.step_inputs(len(rows))
    own = TorchNativeAttnBackend(engine.runner)
    own.init_forward_metadata(batch)
    expected = own.forward_decode(q, k, v, engine.layer, batch).view(len(rows), Q_HEADS, DIM)
    shared = attention.SharedPrefixTorchNativeBackend(engine.runner, 256)
    shared.init_forward_metadata(batch)
    got = shared.forward_decode(q, k, v, engine.layer, batch).view(len(rows), Q_HEADS, DIM)
    keys, values = engine.kv.k_buffer[0], engine.kv.v_buffer[0]
    for row, slots in enumerate(rows):
        index = torch.tensor(slots)
        reference, _ = reference_attention(q.view(len(rows), Q_HEADS, DIM)[row], keys[index],
                                           values[index], DIM ** -0.5)
        ours = (got[row].double() - reference).norm() / reference.norm()
        sglangs = (expected[row].double() - reference).norm() / reference.norm()
        assert ours < max(2 * sglangs, 1e-2), (row, ours, sglangs)


def test_batches_it_cannot_group_run_sglangs_code_unchanged():
    engine = Engine(1, torch.float32)
    rows, _ = mixed_rows(engine)
    shared = attention.SharedPrefixTorchNativeBackend(engine.runner, 256)
    batch = engine.decode_batch(rows)
    for mode in (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY):
        batch.forward_mode = mode
        assert shared.plan(batch) is None
    batch.forward_mode = ForwardMode.DECODE
    assert attention.SharedPrefixTorchNativeBackend(engine.runner, 4096).plan(batch) is None
    # a layer the kernel cannot serve, and a step planned for another batch
    q, k, v = engine.step_inputs(len(rows))
    own = TorchNativeAttnBackend(engine.runner)
    own.init_forward_metadata(batch)
    expected = own.forward_decode(q, k, v, engine.layer, batch)
    shared.init_forward_metadata(copy.copy(batch))
    assert torch.equal(shared.forward_decode(q, k, v, engine.layer, batch), expected)
    capped = RadixAttention(num_heads=Q_HEADS, head_dim=DIM, scaling=DIM ** -0.5,
                            num_kv_heads=KV_HEADS, layer_id=0, logit_cap=30.0)
    shared.init_forward_metadata(batch)
    assert not shared._acts(capped, q, None)


def test_sglangs_layers_are_translated_for_the_one_rule():
    """``SharedPrefixDecode._layer_problem`` reads each term off SGLang's
    ``RadixAttention`` (``attention.eligibility`` words it)."""
    engine = Engine(1, torch.float32)
    shared = attention.SharedPrefixTorchNativeBackend(engine.runner, 256)
    q, _, _ = engine.step_inputs(2)

    def layer(**options):
        return RadixAttention(num_heads=Q_HEADS, head_dim=DIM, scaling=DIM ** -0.5,
                              num_kv_heads=KV_HEADS, layer_id=0, **options)

    assert shared._layer_problem(layer(), q, None) is None
    for options, problem in (({"is_cross_attention": True}, "cross or non-decoder attention"),
                             ({"sliding_window_size": 128}, "a sliding window"),
                             ({"logit_cap": 30.0}, "soft-capping"),
                             ({"v_head_dim": DIM // 2}, "unequal K and V head sizes")):
        assert shared._layer_problem(layer(**options), q, None) == problem
    assert shared._layer_problem(layer(), q, torch.zeros(Q_HEADS)) == "attention sinks"
    assert shared._layer_problem(layer(), q.bfloat16(), None) == (
        "a query dtype unlike the cache's")
    grok = layer()
    grok.xai_temperature_len = 1024  # as SGLang's Grok sets it
    assert shared._layer_problem(grok, q, None) == "a per-position query temperature"


@pytest.mark.parametrize(("name", "mode", "feather", "acts"), [
    ("torch_native", "auto", True, True), ("torch_native", "auto", False, False),
    ("torch_native", "on", False, True), ("torch_native", "off", True, False),
    ("intel_amx", "auto", True, False)])
def test_the_option_decides_per_server(name, mode, feather, acts, caplog, monkeypatch,
                                       self_check_here):
    monkeypatch.setattr(shared_decode.announce, "said", set())
    caplog.set_level(logging.INFO, logger=attention.logger.name)
    engine = Engine(1, torch.float32)
    environ = {"FEATHER_SHARED_PREFIX_ATTENTION": mode, **({ENV_ENABLE: "1"} if feather else {})}
    reason = attention.decide(name, engine.runner, *attention.attention_options(environ)[:1],
                              feather)
    assert (reason is None) == acts, reason
    if name == "torch_native":
        backend = attention.create_backend(name, engine.runner, environ)
        assert type(backend) is (attention.SharedPrefixTorchNativeBackend if acts
                                 else TorchNativeAttnBackend)
        assert "Feather shared-prefix attention: " + ("on" if acts else "off") in caplog.text


def test_the_launcher_registers_feathers_factories():
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    attention.register()
    assert ATTENTION_BACKENDS["torch_native"].__name__ == "create_feather_torch_native_backend"
    assert ATTENTION_BACKENDS["intel_amx"].__name__ == "create_feather_intel_amx_backend"


FEATHER_AUTO = {ENV_ENABLE: "1"}
"""A server with Feather's scheduler and the option at its default, ``auto``."""


@pytest.mark.parametrize("faster", [True, False])
def test_auto_is_what_the_self_check_measured(faster, monkeypatch, tmp_path, self_check_here):
    """Under auto with Feather's scheduler the backend is made after the self-check, SGLang's
    kernel against the path on SGLang's pools at the server's shapes: on, with its line,
    where the path measured exact and faster; off, with the figures, where slower; kept,
    so the next start reads it."""
    monkeypatch.setattr(attention_check.SglangCpuSubject, "seconds",
                        timed_as(0 if faster else None))
    messages = []
    monkeypatch.setattr(attention, "announce", messages.append)
    engine = Engine(1, torch.bfloat16)
    backend = attention.create_backend("torch_native", engine.runner, FEATHER_AUTO)
    assert type(backend) is (attention.SharedPrefixTorchNativeBackend if faster
                             else TorchNativeAttnBackend)
    line, = messages
    assert line.startswith("on (self-check" if faster else "off (self-check"), line
    assert "max error" in line and ("2.00x at" in line if faster else "0.50x at" in line)
    assert faster or "not faster than the engine's kernel" in line
    assert list(tmp_path.glob("attention-check/*.json"))
    messages.clear()
    monkeypatch.setattr(attention_check.TokenBatch, "__init__", None)  # not measured again
    attention.create_backend("torch_native", engine.runner, FEATHER_AUTO)
    assert messages[0].endswith("; cached)"), messages


@pytest.mark.parametrize("faster", [True, False])
def test_amx_tiles_act_only_after_a_check_in_a_process_of_its_own(faster, monkeypatch):
    """Where the kernel has AMX tiles (a path the project's own machines exercise only
    emulated), the CPU check goes to a child process as a recipe (here: the child's work,
    after a pickle round trip, in this process) and the backend multiplies in tiles only
    where that check measured the path exact and faster."""
    import pickle

    from feather_sched.attention import cpu_kernel, isolation

    monkeypatch.setattr(cpu_kernel, "tiles", lambda: "amx")
    monkeypatch.setattr(attention_check.SglangCpuSubject, "seconds",
                        timed_as(0 if faster else None))
    recipes = []

    def in_this_process(recipe, timeout_s=None):
        recipes.append(recipe := pickle.loads(pickle.dumps(recipe)))
        subject = isolation.resolve(recipe.factory)(**recipe.kwargs)
        return isolation.resolve(recipe.run)(subject, **recipe.run_kwargs)

    monkeypatch.setattr(isolation, "run_isolated", in_this_process)
    backend = attention.create_backend("torch_native", Engine(1, torch.bfloat16).runner,
                                       FEATHER_AUTO)
    assert [r.factory.rsplit(":", 1)[1] for r in recipes] == ["cpu_check_subject"]
    assert getattr(backend, "use_tiles", False) is faster


def test_auto_groups_from_the_measured_break_even(monkeypatch, self_check_here):
    monkeypatch.setattr(attention_check.SglangCpuSubject, "seconds", timed_as(1024))
    messages = []
    monkeypatch.setattr(attention, "announce", messages.append)
    backend = attention.create_backend("torch_native", Engine(16, torch.float32).runner,
                                       FEATHER_AUTO)
    assert backend.min_shared_tokens == 1024 and backend.by_size == ()
    assert messages[0].startswith("on (self-check") and \
        "groups from 1024 shared tokens" in messages[0], messages


def test_a_verdict_by_group_size_reaches_the_backends_plans(monkeypatch):
    """Each size's break-even (``Verdict.by_size``) is what the backend plans with, unless
    the option sets the length; the plan keeps only the groups their size allows."""
    by_size = ((4, 2048), (16, 1024))
    shapes = selfcheck.Shapes("test CPU", 4, 2, 16, "float32", 16, "nhd", 32, 2048)
    verdict = selfcheck.Verdict(True, "test", 1024, shapes, by_size=by_size)
    monkeypatch.setattr(attention, "self_check", lambda name, runner: verdict)
    monkeypatch.setattr(attention, "announce", lambda line: None)
    runner = Engine(16, torch.float32).runner
    backend = attention.create_backend("torch_native", runner, FEATHER_AUTO)
    assert backend.min_shared_tokens == 1024 and backend.by_size == by_size
    seen = []
    monkeypatch.setattr(shared_decode, "plan_token_step", lambda *args: seen.append(args))
    backend.plan_rows(SimpleNamespace(req_pool_indices=torch.arange(2)), torch.tensor([9, 9]))
    assert seen[0][-1] == by_size
    option = {**FEATHER_AUTO, "FEATHER_SHARED_PREFIX_MIN_TOKENS": "512"}
    assert attention.create_backend("torch_native", runner, option).by_size == ()


def test_a_self_check_that_cannot_run_leaves_auto_off_and_the_server_up(monkeypatch,
                                                                         self_check_here):
    def broken(*args):
        raise RuntimeError("no pool here")

    monkeypatch.setattr(attention_check.TokenBatch, "__init__", broken)
    messages = []
    monkeypatch.setattr(attention, "announce", messages.append)
    backend = attention.create_backend("torch_native", Engine(1, torch.float32).runner,
                                       FEATHER_AUTO)
    assert type(backend) is TorchNativeAttnBackend
    assert messages == ["off: the self-check could not run (no pool here)"]


def test_the_check_runs_sglangs_kernel_and_the_path_on_sglangs_pools():
    """The trials themselves (no stand-in but the timer): SGLang's decode and the path on
    a cell whose prefix ends mid-page, against each other and float64."""
    subject = attention_check.SglangCpuSubject(
        *attention.BACKENDS["torch_native"], q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=DIM,
        dtype=torch.float32, page_size=16, max_rows=32, max_context=2048, versions=())
    trial = subject.trial(selfcheck.Cell(300, 2, 3, suffix=20), seed=0)
    plan = trial._shared.step[1]
    assert plan is not None and plan.groups.shared.tolist() == [288, 288]  # full pages
    engine, shared, reference = trial.engine().clone(), trial.shared(), trial.reference()
    assert selfcheck.relative_error(shared, engine) < 1e-5
    assert selfcheck.relative_error(shared, reference) < 1e-5
    assert selfcheck.relative_error(engine, reference) < 1e-5


def test_the_ranks_vote_where_vllms_do(monkeypatch):
    """SGLang's tensor-parallel vote is ``selfcheck.tp_vote`` over SGLang's parallel state
    (as vLLM's adapter over vLLM's: one place, one way)."""
    from sglang.srt.distributed import parallel_state

    from feather_sched.attention import selfcheck

    assert attention.tp_vote is selfcheck.tp_vote
    votes = []
    monkeypatch.setattr(attention, "tp_vote", lambda verdict, state: votes.append(state))
    attention.tp_agreed(None)
    assert votes == [parallel_state]
