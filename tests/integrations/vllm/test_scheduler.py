"""FeatherScheduler driven directly, as vLLM's own ``tests/v1/core`` drive its schedulers.

vLLM 0.32.0's real ``Scheduler`` and ``AsyncScheduler`` (as ``FeatherScheduler`` builds
them) are constructed from a ``VllmConfig`` for the embedded model and fed fabricated
model-runner outputs; the async variant keeps one step in flight, as vLLM's engine core
does on GPUs.  After every ``schedule()`` Feather's running set must be vLLM's.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import fields, replace

import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed")

import torch
from vllm.engine.arg_utils import EngineArgs
from vllm.lora.request import LoRARequest
from vllm.platforms import current_platform
from vllm.pooling_params import PoolingParams
from vllm.sampling_params import SamplingParams, StructuredOutputsParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.gpu.model_runner import sort_batch_req_ids

from feather_sched.core.cht import ChunkedHashTree
from feather_sched.core.queue import QueueState
from feather_sched.gates.base import BatchLayout, Decision, GateContext, Unobservant
from feather_sched.gates.model import ModelGate
from feather_sched.gates.step_model import StepPrior
from feather_sched.integrations.vllm import compat
from feather_sched.integrations.vllm.scheduler import (
    BATCH_ORDER_PLUGIN,
    FeatherScheduler,
    FeatherSyncScheduler,
    VllmRequests,
    engine_shape,
    plugin_allowed,
)
from feather_sched.models import TINY_LLAMA
from feather_sched.telemetry.prometheus import PrometheusSink
from tests.helpers.faults import InjectedFault, Injector, ServingSpy, fault_targets

BLOCK = 16
PREFIX_BLOCKS = 8
"""A group's shared prefix: 128 tokens, one chunk."""
STRICT = {"gate": "chunk-loss", "max_wait_s": None,
          "gate_options": {"max_loss": 0, "max_loss_loaded": 0, "floor_start": 0,
                           "floor_step": 0}}
"""A gate that stops at the first candidate costing the running batch any shared chunk."""
NO_V1_RUNNER = "this vLLM has no V1 model runner (0.34 removed it)"


def runner_output(ids: list[str], sampled: list[list[int]]) -> ModelRunnerOutput:
    """vLLM's model-runner output for the requests ``ids`` (in that order), each having
    sampled its list of ``sampled``; ``req_id_to_index`` where the release has it (0.34
    indexes by ``req_ids`` alone)."""
    index = ({"req_id_to_index": {r: i for i, r in enumerate(ids)}}
             if "req_id_to_index" in {f.name for f in fields(ModelRunnerOutput)} else {})
    return ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled, **index)


class RecordingGate(Unobservant):
    """Adds whatever it is asked, remembers what it is rewarded with."""

    always_adds = False  # shown every candidate
    stops_in_ordered_batches = True  # it may STOP whatever the layout

    def __init__(self, decision: Decision = Decision.ADD) -> None:
        self.decision = decision
        self.rewards: list[tuple[list, int, float]] = []

    def decide(self, context: GateContext) -> Decision:
        return Decision.ADD if context.batch_size == 0 else self.decision

    def reward(self, decisions, batch_size: int, seconds: float) -> None:
        self.rewards.append((list(decisions), batch_size, seconds))

    def end_step(self) -> None:
        pass


class Harness:
    """A Feather scheduler and the engine loop around it, with fabricated outputs.

    ``v2_runner``: the model runner the scheduler is told the workers run (None: vLLM's
    default; V2 is the only one where the V1 runner is gone, and a test asking for V1 is
    skipped there)."""

    def __init__(self, *, async_scheduling: bool = False, num_blocks: int = 256,
                 feather: dict | None = None, v2_runner: bool | None = None,
                 scheduler_cls: type = FeatherScheduler,
                 clock: Callable[[], float] | None = None, **engine: object) -> None:
        engine = {"max_num_seqs": 16, "max_num_batched_tokens": 512,
                  "enable_prefix_caching": True, **engine}
        args = EngineArgs(model=str(TINY_LLAMA), skip_tokenizer_init=True, load_format="dummy",
                          block_size=BLOCK, max_model_len=2048,
                          async_scheduling=async_scheduling,
                          additional_config={"feather": {
                              "gate": "always", "min_passing_tokens": PREFIX_BLOCKS * BLOCK,
                              **(feather or {})}},
                          **engine)
        config = args.create_engine_config()
        config.scheduler_config.async_scheduling = async_scheduling  # the CPU platform says no
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=8, head_size=64,
                                 dtype=torch.bfloat16)
        kv_cache = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                 kv_cache_groups=[KVCacheGroupSpec(["layers.0", "layers.1"],
                                                                   spec)])
        config.cache_config.num_gpu_blocks = num_blocks
        block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache, config)
        # V2 needs Triton to validate; the scheduler reads the choice when it is built
        # (VllmConfig.use_v2_model_runner reads the variable until the engine caches it).
        # Without the V1 runner there is no choice (and the variable set to 0 raises).
        if v2_runner is False and not compat.has_v1_runner():
            pytest.skip(NO_V1_RUNNER)
        v2 = {"VLLM_USE_V2_MODEL_RUNNER": "1"} if v2_runner and compat.has_v1_runner() else {}
        if clock is not None:  # Feather's clock (the schedulers pick their variant)
            sync = scheduler_cls.__dict__.get("sync_variant")
            scheduler_cls = type(scheduler_cls.__name__, (scheduler_cls,), {
                "feather_clock": staticmethod(clock),
                "sync_variant": sync and type(sync.__name__, (sync,),
                                              {"feather_clock": staticmethod(clock)})})
        with pytest.MonkeyPatch.context() as patch:
            for name, value in v2.items():
                patch.setenv(name, value)
            self.scheduler = scheduler_cls(
                vllm_config=config, kv_cache_config=kv_cache,
                structured_output_manager=StructuredOutputManager(config),
                block_size=block_size, hash_block_size=hash_block_size, log_stats=True)
        assert v2_runner is None or compat.uses_v2_runner(self.scheduler) is v2_runner
        hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(hash_block_size, hash_fn) \
            if config.cache_config.enable_prefix_caching else None  # as vLLM's engine
        feather = getattr(self.scheduler, "feather", None)
        self.runtime = feather.runtime if feather is not None else None
        self.in_flight: list[tuple] = []
        self.steps = 0
        self.scheduled_from: list[str] = []
        """The running list as the last pass left it (before its output finished any)."""

    def request(self, rid: str, group: int, max_tokens: int = 4, suffix: int = 5,
                **fields: object) -> Request:
        prefix = [1000 * (group + 1) + t for t in range(PREFIX_BLOCKS * BLOCK)]
        tail = [50_000 + hash(rid) % 10_000 + t for t in range(suffix)]
        params = fields.pop("sampling_params", None) or SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        return Request(request_id=rid, prompt_token_ids=prefix + tail, sampling_params=params,
                       pooling_params=None, arrival_time=time.time(),
                       block_hasher=self.hasher, **fields)

    def add(self, *requests: Request) -> None:
        for request in requests:
            self.scheduler.add_request(request)

    def step(self, throttle_prefills: bool = False) -> object:
        """One engine step: schedule, check the picture, hand in the (oldest) output."""
        scheduler = self.scheduler
        output = scheduler.schedule(throttle_prefills)
        self.scheduled_from = [r.request_id for r in scheduler.running]
        self.steps += 1
        self.check()
        self.in_flight.append((output, self.fake_output(output)))
        if not isinstance(scheduler, AsyncScheduler) or len(self.in_flight) > 1:
            scheduler.update_from_output(*self.in_flight.pop(0))
        return output

    def drain(self, limit: int = 500) -> None:
        while self.scheduler.has_requests() or self.in_flight:
            assert self.steps < limit, "the engine stalled"
            if self.scheduler.has_requests():
                self.step()
            else:
                self.scheduler.update_from_output(*self.in_flight.pop(0))

    def check(self) -> None:
        """Feather's running set is exactly vLLM's running list (vLLM's own scheduler, or a
        pass Feather's code was out of after a fault: no check)."""
        if self.runtime is None or not self.scheduler.feather.faults.serves:
            return
        assert set(self.runtime.queue.running_ids()) == \
            {r.request_id for r in self.scheduler.running}

    def fake_output(self, output) -> ModelRunnerOutput:
        """One token for every request whose prompt (and outputs) are computed."""
        scheduler = self.scheduler
        ids = list(output.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            request = scheduler.requests[rid]
            done = request.num_computed_tokens - request.num_output_placeholders >= \
                request.num_tokens - int(isinstance(scheduler, AsyncScheduler))
            sampled.append([7] if done else [])
        return runner_output(ids, sampled)

    def assert_empty(self) -> None:
        assert len(self.runtime) == 0 and not self.runtime._record.tracked
        assert self.runtime.queue.num_running == 0


@pytest.fixture(autouse=True)
def _no_multiprocessing(monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def test_the_class_matches_the_engines_mode() -> None:
    assert type(Harness().scheduler) is FeatherSyncScheduler
    assert type(Harness(async_scheduling=True).scheduler) is FeatherScheduler


def test_feather_knows_vllms_seats_and_kv_cache() -> None:
    """What tells Feather whether vLLM could run every request in flight at once."""
    queue = Harness(num_blocks=100).runtime.queue
    assert (queue.seats, queue.kv_tokens) == (16, 100 * BLOCK)


@pytest.mark.parametrize(("block", "chunk_tokens"), [(16, 128), (128, 128), (48, 96),
                                                      (256, 256)])
def test_a_chunk_is_whole_kv_blocks(block: int, chunk_tokens: int) -> None:
    """A chunk key is every k-th block hash: 128 tokens in whole blocks, at least one, is
    what the queue counts a chunk as (its token figures and ``min_passing_tokens``)."""
    assert VllmRequests(block, 128).chunk_tokens == chunk_tokens


def test_the_queue_counts_chunks_as_the_view_keys_them() -> None:
    """``chunk_tokens`` 40 over 16-token blocks: a key every 2 blocks, 32 tokens."""
    runtime = Harness(feather={"chunk_tokens": 40}).runtime
    assert runtime.queue.chunk_tokens == runtime.view.chunk_tokens == 2 * BLOCK


def test_the_engine_log_says_how_ordering_acts_under_model_runner_v2() -> None:
    v2 = Harness(v2_runner=True).scheduler.feather.order_note()
    assert v2[0].startswith("Model Runner V2") and v2[1]


def test_the_engine_log_says_how_ordering_acts_under_the_v1_runner(monkeypatch) -> None:
    v1 = Harness(v2_runner=False).scheduler.feather.order_note()
    assert v1 == (f"V1 model runner: the worker plugin {BATCH_ORDER_PLUGIN!r} gathers each "
                  "prefix group in the persistent batch", True)
    assert plugin_allowed(BATCH_ORDER_PLUGIN)
    monkeypatch.setenv("VLLM_PLUGINS", "some_other_plugin")
    unordered = Harness(v2_runner=False, feather={"gate": "model"}).scheduler.feather
    note, acts = unordered.order_note()
    assert not acts and "not installed or not in VLLM_PLUGINS" in note
    # the model gate then prices the engine's own order, and learns from its steps
    gate = unordered.runtime.queue.gate
    assert isinstance(gate, ModelGate) and gate.layout is BatchLayout.ENGINE
    assert unordered.runtime.wants_batches
    assert unordered.runtime.layout is BatchLayout.ENGINE  # admission order is the layout
    monkeypatch.delenv("VLLM_PLUGINS")
    ordered = Harness(v2_runner=False, feather={"gate": "model"}).scheduler.feather.runtime.queue
    assert ordered.gate.layout is BatchLayout.FEATHER and ordered.layout is BatchLayout.FEATHER


def test_the_model_gate_starts_from_the_profile_of_vllms_device_and_model(monkeypatch) -> None:
    """The adapter describes vLLM's device (as its platform names it) and model config; on
    this CPU no profile exists, so the gate starts cold; on a GPU with a built-in profile
    it starts from that profile for this model."""
    feather = {"gate": "model", "order_running": False}
    cpu = Harness(feather=feather)
    shape = engine_shape(cpu.scheduler.vllm_config)
    assert shape.device_name == "cpu" and shape.dtype_bytes == 2
    assert (shape.model_config["num_hidden_layers"], shape.tensor_parallel) == (2, 1)
    assert cpu.runtime.queue.gate.model.prior is None
    monkeypatch.setattr(current_platform, "get_device_name", lambda device_id=0: "NVIDIA H200")
    gate = Harness(feather=feather).runtime.queue.gate
    expected, _ = StepPrior.for_engine(replace(shape, device_name="NVIDIA H200"))
    assert expected is not None and gate.model.prior == expected and gate.model.ready

    def no_nvml(device_id=0):
        raise RuntimeError("NVML Shared Library Not Found")

    monkeypatch.setattr(current_platform, "get_device_name", no_nvml)
    harness = Harness(feather=feather)  # no name, no prior: it starts all the same
    assert harness.runtime.queue.gate.model.prior is None
    harness.add(*(harness.request(f"r{i}", group=i) for i in range(3)))
    harness.drain()
    harness.assert_empty()


def group_of(rid: str) -> str:
    return rid.split("-")[0]


@pytest.mark.parametrize(("async_scheduling", "v2_runner", "ordered"),
                         [(False, True, True), (True, True, True), (False, False, True),
                          (True, True, False)])
def test_v2_batch_order_keeps_each_groups_decodes_together(async_scheduling: bool,
                                                           v2_runner: bool,
                                                           ordered: bool) -> None:
    """vLLM's own ``sort_batch_req_ids`` (Model Runner V2's batch order) applied to every
    scheduler output: each group's decodes are contiguous, through arrivals, finishes,
    preemptions and aborts; without Feather's order (``order_running`` off) they are not."""
    harness = Harness(async_scheduling=async_scheduling, v2_runner=v2_runner, num_blocks=40,
                      feather={"order_running": ordered})
    preempted = aborted = interleaved = 0
    for wave in range(30):
        if wave % 3 == 0:  # a few requests of four groups arrive, interleaved
            harness.add(*(harness.request(f"g{(wave + i) % 4}-{wave}-{i}", group=(wave + i) % 4,
                                          max_tokens=20 + (wave * 7 + i * 5) % 40)
                          for i in range(6)))
        if wave == 10:
            victims = [r.request_id for r in harness.scheduler.running[:2]]
            harness.scheduler.finish_requests(victims, RequestStatus.FINISHED_ABORTED)
            aborted += len(victims)
        output = harness.step()
        preempted += len(output.preempted_req_ids)
        order = sort_batch_req_ids(output.num_scheduled_tokens, {}, 1)
        decodes = [group_of(r) for r in order if output.num_scheduled_tokens[r] == 1]
        runs = [g for i, g in enumerate(decodes) if i == 0 or g != decodes[i - 1]]
        interleaved += len(runs) != len(set(runs))
    harness.drain(limit=1000)
    assert preempted > 0 and aborted == 2
    assert (interleaved == 0) is ordered, interleaved
    harness.assert_empty()


def test_a_streaming_session_between_turns_is_not_running() -> None:
    """A resumable session that ends a turn leaves ``running`` for ``kv_holding_waiting``
    without being freed.  Counted as running, it made the empty-batch rule read a batch of
    one: a strict gate then STOPped other groups while vLLM ran nothing (no reward, the
    same STOP again; with max_wait_s off, forever)."""
    harness = Harness(feather=STRICT)
    session = harness.request("session", group=0, max_tokens=2, resumable=True)
    harness.add(session)
    for _ in range(3):
        harness.step()
    assert session.status is RequestStatus.WAITING_FOR_STREAMING_REQ
    assert session in harness.scheduler.kv_holding_waiting and not harness.scheduler.running
    assert harness.runtime.queue.state("session") is QueueState.HELD
    other = harness.request("other-group", group=1)
    harness.add(other)
    output = harness.step()
    assert "other-group" in output.num_scheduled_tokens
    harness.drain()
    # the next turn grows the prompt; the session runs again from kv_holding_waiting
    harness.scheduler.add_request(harness.request("session", group=0, resumable=True,
                                                  suffix=40))
    output = harness.step()
    assert "session" in output.num_scheduled_tokens
    assert harness.runtime.queue.keys("session") == harness.runtime.view.chunk_keys(session)
    harness.scheduler.finish_requests("session", RequestStatus.FINISHED_ABORTED)
    harness.drain()
    harness.assert_empty()


def test_a_request_waiting_for_its_grammar_is_skipped_not_admitted() -> None:
    """vLLM pops a request whose grammar is not compiled and prepends it back; it must
    count neither as running nor as an admission, and must not stop its group's
    admission for the rest of the step."""
    harness = Harness()
    grammar = SamplingParams(max_tokens=4, ignore_eos=True,
                             structured_outputs=StructuredOutputsParams(regex="a+"))
    blocked = harness.request("blocked", group=0, sampling_params=grammar)
    assert blocked.status is RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    harness.add(blocked, *(harness.request(f"g{i}", group=0) for i in range(3)))
    output = harness.step()
    assert set(output.num_scheduled_tokens) == {"g0", "g1", "g2"}
    assert harness.runtime.queue.state("blocked") is QueueState.WAITING
    assert harness.runtime.counts.add == 3
    for _ in range(6):
        harness.step()
    harness.scheduler.finish_requests("blocked", RequestStatus.FINISHED_ABORTED)
    harness.drain()
    harness.assert_empty()


def test_requests_beyond_max_loras_are_skipped_and_admitted_later() -> None:
    harness = Harness(enable_lora=True, max_loras=1, max_lora_rank=8)
    lora = [LoRARequest(f"adapter{i}", i + 1, f"/adapters/{i}") for i in range(2)]
    first = [harness.request(f"a{i}", group=0, lora_request=lora[0]) for i in range(2)]
    second = [harness.request(f"b{i}", group=1, lora_request=lora[1]) for i in range(2)]
    harness.add(first[0], second[0], first[1], second[1])
    output = harness.step()
    assert set(output.num_scheduled_tokens) == {"a0", "a1"}  # b0, b1 skipped: max_loras
    assert harness.runtime.counts.add == 2
    assert all(harness.runtime.queue.state(r.request_id) is QueueState.WAITING
               for r in second)
    harness.drain()
    assert harness.runtime.counts.add == 4
    harness.assert_empty()


def test_the_oldest_always_skipped_request_does_not_take_the_starvation_slot() -> None:
    harness = Harness(feather={"max_wait_s": 0.0}, clock=lambda: time.time() + 1.0)
    grammar = SamplingParams(max_tokens=4, ignore_eos=True,
                             structured_outputs=StructuredOutputsParams(regex="a+"))
    harness.add(harness.request("blocked", group=0, sampling_params=grammar))
    harness.add(*(harness.request(f"r{i}", group=i) for i in range(3)))  # waited 1 s
    harness.step()
    counts = harness.runtime.counts
    assert counts.forced == 1 and counts.add == 2  # r0 forced in blocked's place
    harness.scheduler.finish_requests("blocked", RequestStatus.FINISHED_ABORTED)
    harness.drain()
    harness.assert_empty()


def resumed_req_ids(output, requests: dict[str, Request]) -> set[str]:
    """The preempted requests a step resumed: those its cached requests list as resumed,
    or, where vLLM re-sends a resumed request in full like a new one (0.34, whose cached
    requests list none), its new requests that were preempted before."""
    cached = output.scheduled_cached_reqs
    if hasattr(cached, "resumed_req_ids"):
        return set(cached.resumed_req_ids)
    return {new.req_id for new in output.scheduled_new_reqs
            if requests[new.req_id].num_preemptions}


def admissions(output, requests: dict[str, Request]) -> int:
    """Requests a step took from waiting: new ones and preempted ones resumed."""
    return len({new.req_id for new in output.scheduled_new_reqs} |
               resumed_req_ids(output, requests))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_and_aborts_leave_nothing_behind(async_scheduling: bool) -> None:
    harness = Harness(async_scheduling=async_scheduling, num_blocks=40,
                      feather={"gate": "bandit", "gate_options": {"seed": 1}})
    requests = [harness.request(f"r{i}", group=i % 3, max_tokens=60) for i in range(9)]
    preempted = admitted = 0
    for n, request in enumerate(requests):
        harness.add(request)
        output = harness.step()
        preempted += len(output.preempted_req_ids)
        admitted += admissions(output, harness.scheduler.requests)
        if n == 5:
            harness.scheduler.finish_requests(["r1", "r4"], RequestStatus.FINISHED_ABORTED)
    while harness.scheduler.has_requests() or harness.in_flight:
        if not harness.scheduler.has_requests():
            harness.scheduler.update_from_output(*harness.in_flight.pop(0))
            continue
        output = harness.step()
        preempted += len(output.preempted_req_ids)
        admitted += admissions(output, harness.scheduler.requests)
        assert harness.steps < 800
    assert preempted > 0
    counts = harness.runtime.counts  # what happened, not how often the gate was asked
    assert counts.add + counts.forced == admitted < counts.asked
    harness.assert_empty()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_each_reward_reaches_the_decisions_of_its_own_step(async_scheduling: bool) -> None:
    """The decisions bound to a scheduler output are the ones its result rewards, with
    its own batch size, even when the next step is scheduled before it reports."""
    harness = Harness(async_scheduling=async_scheduling)
    gate = RecordingGate(Decision.STOP)
    runtime = harness.runtime
    runtime.queue.gate = gate
    bound: dict[int, list] = {}
    end_pass: Callable = runtime.end_pass

    def spying_end_pass(step, running):
        end_pass(step, running)
        bound[step] = runtime._ledger.bound(step)

    runtime.end_pass = spying_end_pass
    kept, sizes = [], {}  # outputs kept alive: a step's key is its output's identity
    for wave in range(4):
        harness.add(*(harness.request(f"w{wave}g{g}r{i}", group=g) for g in range(2)
                      for i in range(2)))
        for _ in range(3):
            kept.append(output := harness.step())
            sizes[id(output)] = len(output.num_scheduled_tokens)
    while harness.scheduler.has_requests():
        kept.append(output := harness.step())
        sizes[id(output)] = len(output.num_scheduled_tokens)
    harness.drain()
    assert gate.rewards, "no decision was ever rewarded"
    rewarded = [(decisions, size) for decisions, size, _ in gate.rewards]
    expected = [(bound[step], sizes[step]) for step in bound if bound[step] and sizes[step]]
    assert sorted(map(repr, rewarded)) == sorted(map(repr, expected))
    assert any(d is Decision.STOP for decisions, _ in rewarded for _, d in decisions)
    harness.assert_empty()


def test_a_more_urgent_request_goes_before_any_less_urgent_one() -> None:
    """Under vLLM's priority policy a class-0 request of a new group is admitted before
    class-1 requests of the running group, though the tree prefers those; within class 1
    the running group's requests come first."""
    harness = Harness(scheduling_policy="priority", max_num_seqs=2, feather={})
    assert harness.scheduler.policy is SchedulingPolicy.PRIORITY
    harness.add(harness.request("run0", group=0, max_tokens=6, priority=1),
                harness.request("run1", group=0, max_tokens=30, priority=1))
    harness.step()
    harness.add(harness.request("lone", group=5, max_tokens=4, priority=1),
                *(harness.request(f"more{i}", group=0, max_tokens=4, priority=1)
                  for i in range(3)),
                harness.request("urgent", group=7, max_tokens=4, priority=0))
    admitted: list[str] = []
    while harness.scheduler.has_requests():
        output = harness.step()
        resumed = resumed_req_ids(output, harness.scheduler.requests)
        admitted += [r.req_id for r in output.scheduled_new_reqs if r.req_id not in resumed]
    assert admitted[0] == "urgent"
    assert admitted[1:] == ["more0", "more1", "more2", "lone"]
    harness.assert_empty()


@pytest.mark.parametrize("feather", [{}, {"fairness": "vtc"}])
def test_preemption_takes_the_least_urgent_class_first(feather: dict) -> None:
    """As under vLLM's priority policy, the least urgent class gives way, however old and
    though admitted first: Feather's running order puts it last; under ``fairness: vtc``,
    which keeps vLLM's running order, vLLM's own priority rule picks it."""
    harness = Harness(scheduling_policy="priority", num_blocks=30, feather=feather)
    harness.add(harness.request("old-low", group=0, max_tokens=120, priority=1))
    harness.step()
    harness.add(*(harness.request(f"high{i}", group=1, max_tokens=120, priority=0)
                  for i in range(3)))
    victims: list[str] = []
    while harness.scheduler.has_requests():
        output = harness.step()
        for victim in output.preempted_req_ids:
            victims.append(victim)
            mine = harness.scheduler.requests[victim]
            assert all((r.priority, r.arrival_time) < (mine.priority, mine.arrival_time)
                       for r in harness.scheduler.running), victim
        assert harness.steps < 1000
    assert victims and victims[0] == "old-low"
    harness.assert_empty()


def test_with_ordering_off_running_keeps_vllms_order_and_the_latest_arrival_gives_way(
        ) -> None:
    """``order_running`` off: vLLM's running list is left as vLLM keeps it (what was
    admitted together stays together), and vLLM's priority rule, set for the pass,
    preempts the latest arrival of the least urgent class, as Feather's order would."""
    harness = Harness(num_blocks=30, feather={"order_running": False})
    requests = [harness.request(rid, group=int(rid.startswith("small")), max_tokens=80)
                for rid in ("big0", "small0", "big1", "big2", "small1", "big3")]
    harness.add(*requests)
    arrival = {r.request_id: r.arrival_time for r in requests}
    victims: list[str] = []
    while harness.scheduler.has_requests():
        before = [r.request_id for r in harness.scheduler.running]
        output = harness.step()
        after = [r.request_id for r in harness.scheduler.running]
        kept = [rid for rid in before if rid in after]
        assert after[:len(kept)] == kept, (before, after)  # vLLM's order, not re-sorted
        for victim in output.preempted_req_ids:
            victims.append(victim)
            assert all(arrival[rid] < arrival[victim] for rid in after), (victim, after)
        assert harness.steps < 400
    assert victims, "the KV cache should force preemption"
    harness.assert_empty()


def test_kv_holding_requests_do_not_pass_a_due_request() -> None:
    """vLLM drains ``kv_holding_waiting`` before the waiting queue. A streaming session's
    next turn that arrives after a request the bound has made due (here: at once, with
    max_overtakes 0) waits for it, so it does not count as one more overtake."""
    harness = Harness(feather={"max_overtakes": 0})
    harness.add(harness.request("long", group=0, max_tokens=40),
                harness.request("session", group=1, max_tokens=2, resumable=True))
    for _ in range(3):
        harness.step()
    assert harness.scheduler.requests["session"] in harness.scheduler.kv_holding_waiting
    harness.add(harness.request("due", group=2))
    harness.scheduler.add_request(harness.request("session", group=1, resumable=True,
                                                  suffix=40))
    harness.step()
    order = [r.request_id for r in harness.scheduler.running]
    assert order.index("due") < order.index("session"), order
    harness.scheduler.finish_requests("session", RequestStatus.FINISHED_ABORTED)
    harness.drain()
    harness.assert_empty()


def preempted_by_feathers_rule(victims: Iterable[str], running: Iterable[str],
                               age: dict[str, tuple], group: dict[str, int]) -> bool:
    """Whether ``victims`` (one step's, in any order) are the end of Feather's order of
    them and ``running``: by class, then groups by their oldest member, members by age.
    So each, when taken, was the newest member of the youngest group of the least
    urgent class. ``age``: (priority, arrival time) by request id."""
    victims, running = list(victims), list(running)
    oldest: dict[tuple, tuple] = {}
    for rid in victims + running:
        key = (age[rid][0], group[rid])
        oldest[key] = min(oldest.get(key, age[rid]), age[rid])

    def rank(rid: str) -> tuple:
        return oldest[(age[rid][0], group[rid])], age[rid]
    return all(rank(r) <= rank(v) for r in running for v in victims)


def test_running_is_kept_grouped_by_age_and_preemption_takes_the_youngest_group() -> None:
    harness = Harness(num_blocks=30)
    requests = [harness.request(rid, group=int(rid.startswith("small")), max_tokens=80)
                for rid in ("big0", "small0", "big1", "big2", "small1", "big3")]
    harness.add(*requests)
    age = {r.request_id: (r.priority, r.arrival_time) for r in requests}
    group = {r.request_id: int(r.request_id.startswith("small")) for r in requests}
    victims: list[str] = []
    while harness.scheduler.has_requests():
        output = harness.step()
        victims += output.preempted_req_ids
        assert preempted_by_feathers_rule(output.preempted_req_ids, harness.scheduled_from,
                                          age, group)
        ordered = [rid for rid in output.num_scheduled_tokens
                   if rid not in {r.req_id for r in output.scheduled_new_reqs}]
        groups = [group[rid] for rid in ordered]
        runs = [g for i, g in enumerate(groups) if i == 0 or g != groups[i - 1]]
        assert len(runs) == len(set(runs)), groups  # each group contiguous
        oldest = [min(age[rid] for rid in ordered if group[rid] == g) for g in runs]
        assert oldest == sorted(oldest), ordered  # the oldest group first
        assert harness.steps < 400
    # The small group arrived after the big one's first member: it gives way first.
    assert set(victims[:2]) == {"small0", "small1"}, victims
    harness.assert_empty()
    assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"


def bound_breaches(bound: int | None, seed: int) -> tuple[int, int]:
    """One group in a KV cache that forces preemption, arrivals every few steps, vLLM's
    own preemption under Feather with ``max_preemptions`` ``bound``: (the times a
    request preempted once already was preempted again while a member of its group that
    never was ran on after the pass, the preemptions in all), counted from outside."""
    rng = random.Random(seed)
    harness = Harness(num_blocks=20, feather={"max_preemptions": bound})
    counts: dict[str, int] = {}
    breaches = total = 0
    for step in range(300):
        if step < 60 and rng.random() < 0.4:
            harness.add(harness.request(f"r{step}", group=0, max_tokens=rng.randrange(20, 60)))
        if not harness.scheduler.has_requests():
            continue
        output = harness.step()
        for rid in output.preempted_req_ids:
            spared = [r for r in harness.scheduled_from if counts.get(r, 0) < 1]
            breaches += bool(counts.get(rid, 0) >= 1 and spared)
            counts[rid] = counts.get(rid, 0) + 1
            total += 1
    harness.drain(limit=2000)
    harness.assert_empty()
    return breaches, total


def test_a_request_at_the_preemption_bound_goes_after_the_rest_of_its_group() -> None:
    """vLLM preempts the end of the running list Feather orders: with ``max_preemptions``
    1, a request preempted once goes after every member of its group never preempted;
    without the bound, vLLM's victims include such repeat victims."""
    assert sum(bound_breaches(None, seed)[0] for seed in range(3)) > 0
    for seed in range(3):
        breaches, total = bound_breaches(1, seed)
        assert breaches == 0 and total > 0


def singleton_against_a_stream(harness: Harness) -> tuple[int, int, int]:
    """A singleton arrives first, then a majority request every other step, under a KV
    cache too small for them all: (the singleton's preemptions, the step it finished,
    all preemptions)."""
    harness.add(harness.request("solo", group=9, max_tokens=200))
    preemptions, finished, majority, total = 0, None, 0, 0
    while harness.scheduler.has_requests():
        if majority < 120 and harness.steps % 2 == 0:
            harness.add(harness.request(f"maj{majority}", group=0, max_tokens=60))
            majority += 1
        output = harness.step()
        total += len(output.preempted_req_ids)
        preemptions += int("solo" in output.preempted_req_ids)
        if finished is None and "solo" in output.finished_req_ids:
            finished = harness.steps
        assert harness.steps < 3000
    return preemptions, finished, total


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_old_singleton_is_not_preempted_for_a_stream_of_majority_requests(
        async_scheduling: bool) -> None:
    """The singleton's group is the oldest, so it stands first and never gives way to the
    majority's; preempting the end of a list ordered with larger groups first, vLLM once
    preempted it 6 times (finishing at step 818 against 201)."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler as VllmAsync
    from vllm.v1.core.sched.scheduler import Scheduler as VllmSync

    vllm_cls = VllmAsync if async_scheduling else VllmSync
    _, fcfs_step, _ = singleton_against_a_stream(
        Harness(num_blocks=40, async_scheduling=async_scheduling, scheduler_cls=vllm_cls))
    harness = Harness(num_blocks=40, async_scheduling=async_scheduling,
                      feather={"gate": "model"})
    preemptions, step, total = singleton_against_a_stream(harness)
    assert preemptions <= 1 and step <= 1.25 * fcfs_step, (preemptions, step, fcfs_step)
    assert harness.runtime.meter.stats.preemptions == total > 0
    harness.drain(limit=5000)
    harness.assert_empty()


@pytest.mark.parametrize("classes", [1, 2])
@pytest.mark.parametrize("seed", range(4))
def test_no_request_is_preempted_for_a_group_of_younger_requests(seed: int,
                                                                 classes: int) -> None:
    """Random arrivals, lengths and aborts in 3 groups and singletons, a KV cache that
    forces preemption, the default gate, sync and async: every victim of vLLM's own
    preemption is the newest member of the youngest group (by its oldest running member)
    of the least urgent class; with two classes under vLLM's priority policy, no request
    is admitted from the waiting queue while a more urgent one that waited since the pass
    began still waits, and one preempted for urgency gave way to a more urgent request
    admitted in the same pass."""
    rng = random.Random(seed)
    policy = {"scheduling_policy": "priority"} if classes > 1 else {}
    harness = Harness(num_blocks=36, async_scheduling=bool(seed % 2), feather={}, **policy)
    order: dict[str, tuple] = {}
    groups: dict[str, int] = {}
    preempted = 0
    for step in range(400):
        for _ in range(rng.choice((0, 0, 1, 2))):
            rid = f"s{step}r{rng.randrange(10**6)}"
            group = rng.choice((0, 1, 2, 10 + step))
            request = harness.request(rid, group=group, max_tokens=rng.randrange(5, 90),
                                      priority=rng.randrange(classes))
            order[rid] = (request.priority, request.arrival_time)
            groups[rid] = group
            harness.add(request)
        if rng.random() < 0.03 and harness.scheduler.running:
            harness.scheduler.finish_requests(
                [rng.choice(harness.scheduler.running).request_id],
                RequestStatus.FINISHED_ABORTED)
        if not harness.scheduler.has_requests():
            continue
        waited = {r.request_id for r in harness.scheduler.waiting}
        output = harness.step()
        preempted += len(output.preempted_req_ids)
        running = harness.scheduled_from
        urgent = harness.scheduler.feather.urgent.victims
        own = output.preempted_req_ids - urgent
        assert preempted_by_feathers_rule(own, running, order, groups), (own, running)
        admitted = [r.req_id for r in output.scheduled_new_reqs]
        assert all(any(order[rid][0] < order[victim][0] for rid in admitted)
                   for victim in urgent), (urgent, admitted)
        still = [rid for rid in waited if rid in harness.runtime.queue and
                 harness.runtime.queue.state(rid) is QueueState.WAITING]
        for rid in admitted:
            assert all(order[w][0] >= order[rid][0] for w in still), (rid, still)
    assert preempted > 0
    harness.drain(limit=5000)
    harness.assert_empty()


def test_the_gate_is_not_asked_while_vllm_has_no_seat_left() -> None:
    """vLLM asks the waiting queue before its own max_num_seqs check: a gate answer then
    could not shape the step, so it is neither asked, counted nor rewarded."""
    harness = Harness(max_num_seqs=2)
    harness.add(*(harness.request(f"r{i}", group=i % 2, max_tokens=30) for i in range(6)))
    harness.step()
    asked = harness.runtime.counts.asked
    assert len(harness.scheduler.running) == 2
    for _ in range(5):
        harness.step()
    assert harness.runtime.counts.asked == asked
    harness.drain()
    harness.assert_empty()


def test_the_model_gate_learns_from_vllms_own_steps_when_ordering_is_off() -> None:
    """With ordering off, every executed step reaches the model gate as its batch, with
    the same group keys the queue gives candidates; with ordering on the gate admits
    without learning, and vLLM's steps are not described for it."""
    harness = Harness(feather={"gate": "model", "order_running": False})
    gate = harness.runtime.queue.gate
    assert isinstance(gate, ModelGate) and gate.layout is BatchLayout.ENGINE
    judged, seen, observed = set(), set(), []
    decide, observe = gate.decide, gate.observe

    def recording_decide(context):
        judged.add(context.candidate_group)
        return decide(context)

    def recording_observe(batch, seconds):
        seen.update(entry.group for entry in batch)
        observed.append(len(batch))
        observe(batch, seconds)

    gate.decide, gate.observe = recording_decide, recording_observe
    schedule, executed = harness.scheduler.schedule, []

    def counting_schedule(throttle_prefills: bool = False):
        output = schedule(throttle_prefills)
        executed.extend([output] if output.num_scheduled_tokens else [])
        return output

    harness.scheduler.schedule = counting_schedule
    harness.add(*(harness.request(f"g{g}r{i}", group=g, max_tokens=8) for g in range(3)
                  for i in range(3)))
    harness.drain()
    assert len(observed) == len(executed) > 0
    assert 0 < gate.model.steps <= len(executed)  # it learns from steps that changed
    assert len(judged) == 3 and judged == seen
    harness.assert_empty()
    ordered = Harness(feather={"gate": "model"})
    assert not ordered.runtime.wants_batches
    ordered.add(*(ordered.request(f"r{i}", group=i) for i in range(3)))
    ordered.drain()
    assert ordered.runtime.queue.gate.model.steps == 0


# ---- faults of Feather's own code -------------------------------------------------------


def test_a_fault_hands_the_pass_to_vllms_own_order(monkeypatch, contained_faults) -> None:
    """With one seat free, Feather admits the waiting request of the running group; when
    its code raises in that pass, vLLM's own order admits the oldest instead, the fault
    is counted once, and Feather serves the next pass again, its picture rebuilt."""
    def second_admission(fault: bool) -> str:
        harness = Harness(max_num_seqs=2)
        harness.add(harness.request("a0", group=0, max_tokens=30))
        harness.step()
        harness.add(harness.request("b0", group=1, max_tokens=30),
                    harness.request("a1", group=0, max_tokens=30))
        if fault:
            monkeypatch.setattr(harness.runtime.queue.tree, "best",
                                lambda *args: 1 / 0)  # this tree only: a rebuild drops it
        output = harness.step()
        if fault:
            assert not harness.runtime.faults.serves
            assert harness.runtime.meter.stats.faults == 1 and harness.runtime.faults.dirty
        harness.add(harness.request("a2", group=0, max_tokens=2))
        harness.drain()
        assert harness.runtime.faults.serves and harness.runtime.faults.active
        harness.assert_empty()
        return output.scheduled_new_reqs[0].req_id

    assert second_admission(fault=False) == "a1"
    assert second_admission(fault=True) == "b0"
    assert [where for where, _ in contained_faults] == ["decide"]


@pytest.mark.parametrize(("member", "where"), [
    ("enter_waiting", "enter_waiting"), ("begin_pass", "begin_pass"), ("decide", "decide"),
    ("admit", "admit"), ("end_pass", "end_pass"), ("preempted", "meter"),
    ("discard", "discard")])
def test_a_fault_at_each_hook_leaves_the_pass_to_vllm_and_the_next_is_feathers(
        member: str, where: str, monkeypatch, contained_faults) -> None:
    """Every call of the adapter into Feather asks the guard's one predicate
    (``faults.serves``): after a fault at any of them no serving call reaches Feather
    until the next pass opens (vLLM's own queue and victims serve), and that pass is
    Feather's again, its picture rebuilt and exact (``Harness.check``)."""
    harness = Harness(num_blocks=32, max_num_seqs=6)  # 3 groups' prefixes take 24 blocks
    runtime = harness.runtime
    spy = ServingSpy(monkeypatch, runtime)
    requests = [harness.request(f"r{i}", group=i % 3, max_tokens=20 + i) for i in range(18)]
    left_at = back = None

    def watch() -> None:
        nonlocal left_at, back
        if contained_faults and left_at is None:
            assert not runtime.faults.serves and runtime.faults.dirty
            left_at = harness.steps
        elif left_at is not None and back is None and harness.steps > left_at:
            back = runtime.faults.serves and not runtime.faults.dirty

    for step in range(9):
        if step == 3:
            spy.break_next(member)
        harness.add(*requests[2 * step: 2 * step + 2])
        watch()
        harness.step()
        watch()
    while harness.scheduler.has_requests() or harness.in_flight:
        harness.step() if harness.scheduler.has_requests() else \
            harness.scheduler.update_from_output(*harness.in_flight.pop(0))
        watch()
    assert [w for w, _ in contained_faults] == [where] and spy.strays == [] and back
    harness.assert_empty()


def test_while_feathers_rebuild_fails_vllm_serves_every_call(monkeypatch,
                                                              contained_faults) -> None:
    """Fourteen passes whose rebuild raises, with preemptions and exits among them: no
    call reaches Feather's serving code (each asks ``faults.serves``), vLLM's own queue
    and victims serve; the next pass is Feather's again and every request finishes once."""
    harness = Harness(num_blocks=32, max_num_seqs=6, feather={"max_faults": 32})
    runtime = harness.runtime
    spy = ServingSpy(monkeypatch, runtime)
    requests = [harness.request(f"r{i}", group=i % 3, max_tokens=20 + i) for i in range(24)]
    for step in range(24):
        if step == 8:  # every seat taken, 18 waiting; preemptions from step 12, exits 19
            spy.break_next("begin_pass", times=14)
        harness.add(*requests[4 * step: 4 * step + 4])
        harness.step()
        assert runtime.faults.serves is not (8 <= step < 22)
    harness.drain()
    assert [w for w, _ in contained_faults] == ["begin_pass"] * 14 and spy.strays == []
    stats = runtime.meter.stats
    assert stats.preemptions > 0 and stats.requests_left == 24 and runtime.faults.active
    harness.assert_empty()


@pytest.mark.parametrize("fairness", ["off", "tenants", "vtc"])
@pytest.mark.parametrize("seed", range(4))
def test_random_faults_in_feathers_code_lose_no_request(seed: int, fairness: str, monkeypatch,
                                                        contained_faults) -> None:
    """Exceptions from the tree, the gate, the meter, the metrics sink, the running order,
    the rebuild after a fault (aimed at it) and the tenant share at
    random calls, sync and async, under KV pressure, with fair share off and on: every
    request is freed exactly once, each fault is counted once (every fault contained is
    one injected: none follows from another), Feather stays on, and its picture is exact
    after every pass its code served."""
    rng = random.Random(seed)
    harness = Harness(num_blocks=48, async_scheduling=bool(seed % 2), max_num_seqs=8,
                      feather={"gate": "bandit", "gate_options": {"seed": seed},
                               "fairness": fairness, "max_faults": 16})
    # 16: a full engine decides nothing for many passes, so injected faults alone, this
    # dense, can come 8 in a row; a cascade is caught below (every fault is injected)
    runtime = harness.runtime
    runtime.meter.sink = PrometheusSink(f"faults{seed}{fairness}")
    freed: Counter[str] = Counter()
    free = harness.scheduler._free_request

    def counting_free(request, *args, **kwargs):
        freed[request.request_id] += 1
        return free(request, *args, **kwargs)

    monkeypatch.setattr(harness.scheduler, "_free_request", counting_free)
    injector = Injector(monkeypatch, seed, rate=0.25)  # 0.3 came within 1 of max_faults
    injector.target_all(fault_targets(fairness))
    arrived = []
    for step in range(300):
        for _ in range(rng.choice((0, 0, 1, 2))):
            rid = f"s{step}r{rng.randrange(10**6)}"
            arrived.append(rid)
            harness.add(harness.request(rid, group=rng.choice((0, 1, 2, 10 + step)),
                                        sampling_params=for_tenant(rng.choice("abc"),
                                                                   rng.randrange(2, 40))))
        if rng.random() < 0.03 and harness.scheduler.running:
            harness.scheduler.finish_requests(
                [rng.choice(harness.scheduler.running).request_id],
                RequestStatus.FINISHED_ABORTED)
        if harness.scheduler.has_requests():
            injector.next_pass(rebuilding=runtime.faults.dirty)
            harness.step()
    injector.armed = False
    injector.next_pass()
    harness.drain(limit=5000)
    harness.scheduler.schedule()  # an idle pass: Feather rebuilt once more, empty
    assert freed == Counter(arrived)
    assert len(injector.raised) == len(contained_faults) == runtime.meter.stats.faults > 10
    assert all(isinstance(error, InjectedFault) for _, error in contained_faults)
    assert set(injector.raised) == {label for _, _, label in fault_targets(fairness)}
    assert runtime.faults.active
    harness.assert_empty()
    stats = runtime.meter.stats
    assert stats.requests_entered == stats.requests_left


def test_faults_in_a_row_turn_feather_off_for_the_engine(monkeypatch, contained_faults,
                                                          caplog) -> None:
    """A fault in every decision: after ``max_faults`` of them in a row Feather is off,
    once, with one error line; vLLM's own order serves every request from then on."""
    harness = Harness(max_num_seqs=2, feather={"max_faults": 3})
    monkeypatch.setattr(ChunkedHashTree, "best", lambda *args: 1 / 0)
    requests = [harness.request(f"r{i}", group=i % 4, max_tokens=3) for i in range(10)]
    harness.add(*requests)
    admitted = []
    while harness.scheduler.has_requests():
        admitted += [r.req_id for r in harness.step().scheduled_new_reqs]
    assert not harness.runtime.faults.active and harness.runtime.meter.stats.faults == 3
    assert [where for where, _ in contained_faults] == ["decide"] * 3
    assert admitted == [r.request_id for r in requests]  # arrival order, every pass
    off = [r for r in caplog.records if "Feather is off" in r.getMessage()]
    assert len(off) == 1 and off[0].levelname == "ERROR"


# ---- tenants: who a request is served for, and the service its tenant is charged ------

FAIR = {"fairness": "tenants"}


def for_tenant(tenant: object, max_tokens: int = 4) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0,
                          extra_args={"tenant": tenant})


def tenant_of(request: Request) -> str:
    return str(request.sampling_params.extra_args["tenant"])


def test_a_request_skipped_and_handed_back_is_refunded_its_admission() -> None:
    """vLLM pops a request and skips it; its loop may end without asking the queue again
    (in ``kv_holding_waiting``) and hand it back: the admission's charge to its tenant is
    taken back (``settle`` holds it first), as when the next question settles it."""
    harness = Harness(feather=FAIR)
    harness.add(harness.request("r", 0, sampling_params=for_tenant("acme")))
    queue, share = harness.scheduler.waiting, harness.runtime.queue.share
    queue.begin_pass()
    assert queue and share.service("acme") == 0
    popped = queue.pop_request()
    assert share.service("acme") > 0  # charged at admission
    queue.prepend_requests([popped])
    assert share.service("acme") == 0
    assert harness.runtime.queue.state("r") is QueueState.WAITING
    harness.drain()
    harness.assert_empty()


def test_the_tenant_is_the_requests_extra_arg(monkeypatch) -> None:
    """Named by ``extra_args["tenant"]`` (an int as its str); none named, or a pooling
    request: the default tenant; a bad id (the offline API lets one through) is served
    as the default tenant, logged once, never raised into the engine."""
    harness = Harness(feather=FAIR)
    lines = logging.handlers.BufferingHandler(capacity=1000)
    monkeypatch.setattr(logging.getLogger("vllm.feather_sched"), "handlers", [lines])
    view = VllmRequests(BLOCK, 128)
    named = harness.request("a", 0, sampling_params=for_tenant("acme"))
    numbered = harness.request("n", 0, sampling_params=for_tenant(7))
    plain = harness.request("p", 0)
    pooling = Request(request_id="pool", prompt_token_ids=[1, 2, 3], sampling_params=None,
                      pooling_params=PoolingParams(), arrival_time=0.0)
    assert [view.tenant(r) for r in (named, numbered, plain, pooling)] == \
        ["acme", "7", "default", "default"]
    bad = [harness.request(f"b{i}", 0, sampling_params=for_tenant(value))
           for i, value in enumerate(["", [1], "x" * 300])]
    assert [view.tenant(r) for r in bad] == ["default"] * 3

    def logged() -> list[str]:
        return [r.getMessage() for r in lines.buffer if "bad tenant" in r.getMessage()]

    assert len(logged()) == 1 and "request b0: extra_args['tenant']" in logged()[0]
    lines.flush()
    harness.add(named, *bad)  # the engine serves them all, and says so once
    harness.drain()
    assert len(logged()) == 1
    assert harness.runtime.queue.share.service("acme") > 0
    harness.assert_empty()


class ServiceLedger:
    """What fair share is charged per tenant (``TenantShare.charge``, spied on) beside
    what vLLM's own accounts say it should be: each admission's known tokens past the
    cache hit vLLM reports for it (the prompt, and a resumed request's recomputation;
    a lone last token is a decode's input, as the simulator counts), and every token
    vLLM appends to a request's output."""

    def __init__(self, harness: Harness) -> None:
        self.harness = harness
        self.charged: Counter[tuple[str, str]] = Counter()
        self.expected: Counter[tuple[str, str]] = Counter()
        self.resumed = self.chunked = self.drafts = 0
        share = harness.runtime.queue.share
        charge = share.charge

        def spying_charge(tenant, computed_tokens, output_tokens):
            self.charged[tenant, "computed"] += computed_tokens
            self.charged[tenant, "generated"] += output_tokens
            return charge(tenant, computed_tokens, output_tokens)

        share.charge = spying_charge
        schedule = harness.scheduler.schedule

        def reading_schedule(*args, **kwargs):
            output = schedule(*args, **kwargs)
            self.scheduled(output)
            return output

        harness.scheduler.schedule = reading_schedule

    def scheduled(self, output) -> None:
        """Read a step's admissions as it is scheduled (before its result frees any)."""
        requests = self.harness.scheduler.requests
        resumed = resumed_req_ids(output, requests)
        for new in output.scheduled_new_reqs:
            self.resumed += new.req_id in resumed
            self.admitted(requests[new.req_id], new.num_computed_tokens)
        cached = output.scheduled_cached_reqs
        for rid, before in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            request = requests[rid]
            if rid in resumed:
                self.resumed += 1
                self.admitted(request, before)
            elif before < request.num_prompt_tokens:
                self.chunked += 1  # a later chunk of a prompt
        self.drafts += sum(map(len, output.scheduled_spec_decode_tokens.values()))

    def admitted(self, request: Request, hit: int) -> None:
        known = request.num_tokens - hit
        if not (known == 1 and request.num_output_tokens):
            self.expected[tenant_of(request), "computed"] += known

    def generated(self, request: Request) -> None:
        self.expected[tenant_of(request), "generated"] += request.max_tokens


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("case", ["chunked", "preempted"])
def test_fair_share_is_charged_what_each_step_computes_and_generates(
        async_scheduling: bool, case: str) -> None:
    """Two tenants of shared prefixes: the share is charged each admission's prompt past
    its cache hit, in chunks where a prompt is longer than a step's budget, each
    recomputation after a preemption, and every generated token, before vLLM frees the
    request, whether the result of a step comes before the next is scheduled or after."""
    chunked = case == "chunked"
    harness = Harness(async_scheduling=async_scheduling, feather=FAIR,
                      num_blocks=256 if chunked else 40,
                      max_num_batched_tokens=256 if chunked else 512)
    ledger = ServiceLedger(harness)
    requests = [harness.request(f"r{i}", group=i % 3, suffix=300 if chunked else 5,
                                sampling_params=for_tenant(f"t{i % 2}", 12 if chunked else 60))
                for i in range(8)]
    harness.add(*requests)
    harness.drain()
    for request in requests:
        ledger.generated(request)
    assert ledger.charged == ledger.expected
    assert ledger.expected["t0", "computed"] < sum(r.num_prompt_tokens for r in requests[::2])
    assert (ledger.chunked if chunked else ledger.resumed) > 0
    harness.assert_empty()


def test_rejected_drafts_are_not_generated_tokens() -> None:
    """Speculative decoding (two drafts a step, the first accepted, the second rejected):
    the share is charged the prompt past its hit and the tokens vLLM appends, not the
    draft positions the step computed."""
    harness = Harness(feather=FAIR, speculative_config={
        "method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2,
        "prompt_lookup_min": 1})
    ledger = ServiceLedger(harness)
    scheduler = harness.scheduler

    def accept_one_draft(output) -> ModelRunnerOutput:
        ids = list(output.num_scheduled_tokens)
        drafts = output.scheduled_spec_decode_tokens
        sampled = []
        for rid in ids:
            request = scheduler.requests[rid]
            done = request.num_computed_tokens >= request.num_tokens
            sampled.append([7, 7][: 1 + len(drafts.get(rid, ())) // 2] if done else [])
        return runner_output(ids, sampled)

    harness.fake_output = accept_one_draft
    update = scheduler.update_from_output

    def drafting_update(output, result):
        outputs = update(output, result)
        running = [r.request_id for r in scheduler.running]
        scheduler.update_draft_token_ids(DraftTokenIds(running, [[9, 9] for _ in running]))
        return outputs

    scheduler.update_from_output = drafting_update
    requests = [harness.request(f"r{i}", group=i % 2, sampling_params=for_tenant(f"t{i % 2}", 9))
                for i in range(4)]
    harness.add(*requests)
    harness.drain()
    for request in requests:
        ledger.generated(request)
    assert ledger.drafts > 0 and ledger.charged == ledger.expected
    harness.assert_empty()


@pytest.mark.parametrize("fairness", ["off", "tenants"])
def test_a_flooding_tenant_does_not_hold_every_seat(fairness: str) -> None:
    """Twelve requests of one tenant behind one prefix, then three of another sharing
    nothing, four seats: Feather's prefix order alone admits the flood first; under
    fair share the other tenant is admitted before the flood drains."""
    harness = Harness(max_num_seqs=4, feather={"fairness": fairness})
    flood = [harness.request(f"flood{i}", group=0, sampling_params=for_tenant("flood", 8))
             for i in range(12)]
    other = [harness.request(f"other{i}", group=1 + i, sampling_params=for_tenant("other", 8))
             for i in range(3)]
    harness.add(*flood, *other)
    admitted = []
    while harness.scheduler.has_requests():
        admitted += [r.req_id for r in harness.step().scheduled_new_reqs]
    last_flood = max(i for i, rid in enumerate(admitted) if rid.startswith("flood"))
    last_other = max(i for i, rid in enumerate(admitted) if rid.startswith("other"))
    assert (last_other < last_flood) is (fairness == "tenants"), admitted
    harness.assert_empty()


# ---- isolation ------------------------------------------------------------------------


def _groups_and_shared(harness: Harness, requests: list[Request]) -> tuple[dict, dict]:
    """Each request's prefix group, and the tokens it shares in one batch of ``requests``
    (what the step log and ``feather:prefix_groups_per_step`` count)."""
    runtime = harness.runtime
    entries = runtime.describe_batch([(r, r.num_prompt_tokens, 1) for r in requests])
    return ({r.request_id: runtime.group(r) for r in requests},
            {r.request_id: e.shared_tokens for r, e in zip(requests, entries, strict=True)})


@pytest.mark.parametrize("caching", [True, False])
def test_requests_across_a_cache_boundary_are_never_one_group(caching: bool) -> None:
    """vLLM's cache boundary (cache_salt, LoRA adapter) splits groups with prefix caching
    on (its block hashes) and off (Feather's token keys, in the request's namespace)."""
    harness = Harness(enable_prefix_caching=caching, enable_lora=True, max_loras=4,
                      max_lora_rank=8)
    adapter = LoRARequest("adapter", 1, "/adapters/0")
    requests = [harness.request("p0", 0), harness.request("p1", 0),
                harness.request("s0", 0, cache_salt="a"), harness.request("s1", 0, cache_salt="b"),
                harness.request("s2", 0, cache_salt="a"),
                harness.request("l0", 0, lora_request=adapter),
                harness.request("l1", 0, lora_request=adapter)]
    assert bool(requests[0].block_hashes) is caching
    harness.add(*requests)
    harness.step()
    groups, shared = _groups_and_shared(harness, requests)
    prefix = PREFIX_BLOCKS * BLOCK
    for same in (("p0", "p1"), ("s0", "s2"), ("l0", "l1")):
        assert groups[same[0]] == groups[same[1]] and shared[same[0]] >= prefix
    assert len({groups[r] for r in ("p0", "s0", "s1", "l0")}) == 4 and shared["s1"] == 0


@pytest.mark.parametrize("caching", [True, False])
def test_isolate_tenants_gives_each_named_tenant_its_own_namespace(caching: bool) -> None:
    for isolate in (False, True):
        harness = Harness(enable_prefix_caching=caching,
                          feather={"isolate_tenants": isolate})
        requests = [harness.request(f"a{i}", 0, sampling_params=for_tenant("acme"))
                    for i in range(2)]
        requests += [harness.request("b0", 0, sampling_params=for_tenant("bob")),
                     harness.request("u0", 0), harness.request("u1", 0)]
        harness.add(*requests)
        harness.step()
        groups, _ = _groups_and_shared(harness, requests)
        assert groups["a0"] == groups["a1"] and groups["u0"] == groups["u1"]
        assert (len({groups["a0"], groups["b0"], groups["u0"]}) == 3) is isolate


def test_vllms_prefill_deferral_test_failing_is_a_contained_fault(monkeypatch,
                                                                   contained_faults) -> None:
    """``compat.prefills_deferred`` reads vLLM's scheduler attributes, which a release may
    rename: the pass goes on (vLLM's own) and the fault is counted, labelled "urgent"."""
    harness = Harness()
    harness.add(harness.request("a0", group=0))
    harness.step()
    monkeypatch.setattr(compat, "prefills_deferred", lambda *args: 1 / 0)
    harness.add(harness.request("a1", group=0))
    harness.step()
    assert [where for where, _ in contained_faults] == ["urgent"]
    monkeypatch.undo()
    harness.drain()
    assert harness.runtime.faults.serves


def test_a_vllm_outside_the_supported_range_is_one_warning_and_feather_runs(
        monkeypatch, caplog) -> None:
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.35.0")
    compat.in_range.cache_clear()
    try:
        harnesses = [Harness(), Harness()]
    finally:
        compat.in_range.cache_clear()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING
            and r.name == "vllm.feather_sched" and "supports vLLM" in r.getMessage()] == [
        "feather-sched supports vLLM >=0.32.0,<0.35, this is vLLM 0.35.0: "
        "FeatherSyncScheduler runs on it untested"]
    harnesses[1].add(harnesses[1].request("a0", group=0))
    harnesses[1].drain()
    harnesses[1].assert_empty()
