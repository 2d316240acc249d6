"""Feather inside SGLang 0.5.23, driven through SGLang's real scheduling objects.

``SchedulePolicy`` (Feather's subclass), ``PrefillAdder`` (Feather's subclass),
``RadixCache.create_simulated()``, a CPU ``TokenToKVPoolAllocator``, ``ScheduleBatch`` and
``Req`` are SGLang's own classes; each admission round below repeats the loop of
``Scheduler._get_new_batch_prefill_raw`` (calc_priority, then ``init_next_round_input`` and
``add_one_req`` per waiting request until a result other than CONTINUE, with priority
preemption where the batch is full), and requests enter the waiting queue through
SGLang's own ``Scheduler._add_request_to_queue`` (priority defaults, queue limit).  Where
running requests must hold KV (priority preemption releases it), the engine keeps a real
``ReqToTokenPool`` and ``RadixCache`` and runs SGLang's ``prepare_for_extend``.
"""

from __future__ import annotations

import io
import random
import sys
import time
from array import array
from collections import Counter
from collections.abc import Callable
from contextlib import redirect_stdout
from types import SimpleNamespace

import pytest

from feather_sched.bench.cht.sglang_policy import published_server_args, sglang_installed
from feather_sched.gates.base import BatchLayout

if not sglang_installed():
    pytest.skip("SGLang is not installed (scripts/setup.sh --sglang)", allow_module_level=True)

import torch
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH, Req, ScheduleBatch
from sglang.srt.managers.schedule_policy import (
    AddReqResult,
    PrefillAdder,
    SchedulePolicy,
)
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

from feather_sched.core.cht import ChunkedHashTree
from feather_sched.core.config import FeatherConfig, FeatherConfigError
from feather_sched.core.queue import QueueState
from feather_sched.gates.model import ModelGate
from feather_sched.gates.step_model import StepPrior
from feather_sched.integrations.sglang import launch as sglang_launch
from feather_sched.integrations.sglang import scheduler as feather_sglang
from feather_sched.integrations.sglang.scheduler import (
    FeatherPrefillAdder,
    FeatherSchedulePolicy,
    FeatherSGLang,
    running_requests,
)
from feather_sched.models import TINY_LLAMA
from feather_sched.telemetry.prometheus import PrometheusSink
from tests.helpers.faults import InjectedFault, Injector, ServingSpy, fault_targets

CHUNK = 16
PREFIX = 4 * CHUNK
"""Each group's shared prefix: four whole chunks."""
SUFFIX = CHUNK // 2
"""Per-request tokens after the prefix: less than a chunk, so a group shares every key."""
GROUPS = "ABCDE"
STRICT = {"max_loss": 0, "floor_start": 0, "floor_step": 0}
"""ChunkLossGate that stops at the first candidate that costs any shared chunk."""
PREEMPTION_THRESHOLD = 10
"""SGLang's default ``--priority-scheduling-preemption-threshold``."""


@pytest.fixture(autouse=True)
def _server_args():
    with published_server_args():
        yield


def _prompt(group: str, index: int) -> array:
    base = (GROUPS.index(group) + 1) * 1000
    prefix = [base + t for t in range(PREFIX)]
    suffix = [50_000 + index * SUFFIX + t for t in range(SUFFIX)]
    return array("q", prefix + suffix)


def _req(group: str, index: int, max_new_tokens: int = 8, priority: int | None = None
         ) -> Req:
    return Req(f"{group}{index}", "", _prompt(group, index),
               SamplingParams(max_new_tokens=max_new_tokens), priority=priority)


def _group(req: Req) -> str:
    return req.rid[0]


def _scheduler(tree_cache, priority: bool, low_first: bool, max_queued: int | None,
               aborted: list[str]) -> Scheduler:
    """An SGLang ``Scheduler``, not started, with the state its request-queue methods read
    (``_add_request_to_queue``: priority defaults, queue limit); aborts land in
    ``aborted``."""
    scheduler = object.__new__(Scheduler)
    tokenizer = SimpleNamespace(send_output=lambda abort, req: aborted.append(req.rid))
    vars(scheduler).update(
        enable_priority_scheduling=priority, schedule_low_priority_values_first=low_first,
        abort_on_priority_when_disabled=False, disaggregation_mode=DisaggregationMode.NULL,
        max_queued_requests=max_queued, waiting_queue=[], processed_tokens_counter=0,
        enable_hicache_storage=False, enable_lmcache=False, tree_cache=tree_cache,
        rust_server=None, ipc_channels=SimpleNamespace(send_to_tokenizer=tokenizer),
        beam_coordinator=SimpleNamespace(retire_group=lambda req: None))
    return scheduler


class Engine:
    """The pieces of an SGLang scheduler the admission round touches, all real objects.

    ``priority``, ``low_first``: SGLang's ``--enable-priority-scheduling`` (with its
    preemption) and ``--schedule-low-priority-values-first``; ``max_queued``:
    ``--max-queued-requests``; ``kv``: running requests hold KV rows (a real
    ``ReqToTokenPool`` and ``RadixCache``), as priority preemption needs; ``fairness``,
    ``isolate_tenants``, ``options``: Feather's options; ``seats``: SGLang's
    ``max_running_requests`` as Feather is told it.
    """

    def __init__(self, gate: str = "chunk-loss", gate_options: dict | None = None,
                 feather: bool = True, pool_tokens: int = 1 << 16, *, priority: bool = False,
                 low_first: bool = False, max_queued: int | None = None,
                 kv: bool = False, fairness: str = "off", isolate_tenants: bool = False,
                 seats: int | None = None, options: dict | None = None) -> None:
        self.allocator = TokenToKVPoolAllocator(pool_tokens, torch.float16, "cpu", None, False)
        self.kv = kv
        if kv:
            self.req_to_token_pool = ReqToTokenPool(64, 1024, "cpu", False)
            self.tree_cache = RadixCache(CacheInitParams(
                disable=False, req_to_token_pool=self.req_to_token_pool,
                token_to_kv_pool_allocator=self.allocator, page_size=1))
            self.model_config = ModelConfig(str(TINY_LLAMA))
        else:
            self.tree_cache = RadixCache.create_simulated(mock_allocator=self.allocator)
        self.batch = ScheduleBatch(reqs=[])
        """The running batch, holding KV (``kv`` engines)."""
        self.feather = None
        self.priority = priority
        if feather:
            strict = gate_options is STRICT  # to see STOP alone: no fairness bound
            bounds = {"max_overtakes": None, "max_stops": None} if strict else {}
            config = FeatherConfig(gate=gate, gate_options=gate_options or {},
                                   chunk_tokens=CHUNK, min_passing_tokens=PREFIX,
                                   fairness=fairness, isolate_tenants=isolate_tenants,
                                   **bounds, **(options or {}))
            self.feather = FeatherSGLang(config, priority_scheduling=priority,
                                         low_priority_values_first=low_first,
                                         priority_preemption=priority, seats=seats)
            self.policy = FeatherSchedulePolicy(
                self.feather, self.tree_cache, False, priority, low_first,
                chunked_req=lambda: None)
            self.adder_class = self.feather.adder_class
        else:
            self.policy = SchedulePolicy("fcfs", self.tree_cache, False, priority, low_first)
            self.adder_class = PrefillAdder
        self.aborted: list[str] = []
        self.scheduler = _scheduler(self.tree_cache, priority, low_first, max_queued,
                                    self.aborted)
        self.scheduler.feather = self.feather
        self.running: list[Req] = []
        self.steps = 0

    @property
    def waiting(self) -> list[Req]:
        return self.scheduler.waiting_queue

    @waiting.setter
    def waiting(self, reqs: list[Req]) -> None:
        self.scheduler.waiting_queue = reqs

    def arrive(self, *reqs: Req) -> None:
        """SGLang's ``Scheduler._add_request_to_queue``, through Feather's hook."""
        for req in reqs:
            self._add_to_queue(req)

    def _add_to_queue(self, req: Req, is_retracted: bool = False) -> None:
        feather_sglang._hook_add_request_to_queue(Scheduler._add_request_to_queue,
                                                  self.scheduler, req,
                                                  is_retracted=is_retracted)

    def admission_round(self, max_requests: int | None = None, skip=lambda req: False,
                        seats: int | None = None) -> list[Req]:
        """One pass of ``Scheduler._get_new_batch_prefill_raw``'s admission loop, with its
        ``continue`` branches (LoRA slots, pooling mode, prefetch) standing in as ``skip``,
        inside Feather's ``get_new_batch_prefill`` hook (begin and end of the round).
        ``seats``: the running requests SGLang allows; a full batch ends the round unless
        priority preemption makes room (``kv`` engines)."""
        running_batch = self.batch if self.kv else ScheduleBatch(reqs=list(self.running))
        if self.feather is not None:
            self.feather.begin_round(running_requests(running_batch, chunked=None),
                                     self.waiting)
        self.policy.calc_priority(self.waiting, running_batch)
        adder = self.adder_class(
            1, self.tree_cache, self.allocator, running_batch, 0.5, 1 << 16, None,
            priority_scheduling_preemption_threshold=PREEMPTION_THRESHOLD,
            prefill_max_requests=max_requests)
        for req in self.waiting:
            if adder.budget_state() == AddReqResult.OTHER:
                break
            if skip(req):
                continue
            full = seats is not None and len(adder.can_run_list) >= seats - len(running_batch.reqs)
            if full and (not self.priority or not adder.preempt_to_schedule(req)):
                break
            req.init_next_round_input(self.tree_cache)
            result = adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
            if result != AddReqResult.CONTINUE:
                break
        admitted = list(adder.can_run_list)
        chosen = set(admitted)
        self.waiting = [req for req in self.waiting if req not in chosen]
        for req in adder.preempt_list:  # SGLang re-queues them, whether or not admitted
            self._add_to_queue(req)
        self._run(admitted)
        if self.feather is not None:
            self.feather.end_round(list(self.running), time.perf_counter())
            if not self.feather.faults.dirty:  # the exact picture (rebuilt after a fault)
                assert self.running_ids() == {r.rid for r in self.running}
        return admitted

    def _run(self, admitted: list[Req]) -> None:
        """The admitted requests join the running ones (``kv``: their prefill batch takes
        its KV and merges into the running batch)."""
        if not self.kv:
            for req in admitted:
                self.tree_cache.unlock(req.lock)  # the engine would hold it until the end
            self.running += admitted
            return
        if admitted:
            batch = ScheduleBatch.init_new(admitted, self.req_to_token_pool, self.allocator,
                                           self.tree_cache, self.model_config, False,
                                           SpeculativeAlgorithm.NONE)
            batch.prepare_for_extend()
            if self.batch.is_empty():
                self.batch = batch
            else:
                self.batch.merge_batch(batch)
        self.running = list(self.batch.reqs)

    def running_ids(self) -> set[str]:
        return set(self.feather.runtime.queue.running_ids())

    def finish(self, *reqs: Req, reason=None) -> None:
        """A decode step's result finished ``reqs``: Feather's process_batch_result hook sees
        it (under fair share, the running requests' service)."""
        for req in reqs:
            req.finished_reason = reason or FINISH_LENGTH(length=8)
        self.steps += 1
        batch = ScheduleBatch(reqs=list(self.running), forward_iter=self.steps,
                              forward_mode=ForwardMode.DECODE)
        batch.launch_ts = time.monotonic() - 0.01
        scheduler = SimpleNamespace(feather=self.feather)

        def decoded(scheduler, batch, result) -> None:  # a token each, as a decode step's
            for req in batch.reqs:
                req.output_ids.append(7)

        feather_sglang._hook_process_batch_result(decoded, scheduler, batch, None)
        self.running = [req for req in self.running if not req.finished()]


def _interleaved(count: int, groups: str = GROUPS) -> list[Req]:
    return [_req(groups[i % len(groups)], i) for i in range(count)]


# ---- (a) order ------------------------------------------------------------------------


def test_policy_orders_the_running_group_first_then_by_arrival() -> None:
    engine = Engine(gate="always")
    engine.arrive(_req("C", 0))
    assert [r.rid for r in engine.admission_round(max_requests=1)] == ["C0"]

    waiting = _interleaved(20, "ABCD")
    engine.arrive(*waiting)
    engine.policy.calc_priority(engine.waiting, _running_batch(engine))

    order = [req.rid for req in engine.waiting]
    expected = [r.rid for r in waiting if _group(r) == "C"]
    expected += [r.rid for r in waiting if _group(r) != "C"]
    assert order == expected
    runtime = engine.feather.runtime
    assert order[0] == runtime.decide().request_id
    assert [runtime.queue.tree.missing_chunks(rid) for rid in order] == [0] * 5 + [4] * 15


def test_the_waiting_list_follows_the_trees_rank_not_the_fewest_missing_chunks() -> None:
    """Past the running group, requests that share nothing with it keep arrival order:
    the tree's rank (``FeatherRuntime.rank_waiting``).  Fewest missing chunks first (the
    paper's rule, which ``cht`` rejects) would put the short prompt before the long one
    that arrived before it, and starve long prompts."""
    engine = Engine(gate="always")
    engine.arrive(_req("C", 0))
    engine.admission_round(max_requests=1)
    long_prompt = Req("long", "", array("q", range(7000, 7000 + 8 * PREFIX)),
                      SamplingParams(max_new_tokens=8))
    short_prompt = Req("short", "", array("q", range(9000, 9000 + PREFIX)),
                       SamplingParams(max_new_tokens=8))
    engine.arrive(long_prompt, _req("C", 1), short_prompt, _req("C", 2))
    engine.policy.calc_priority(engine.waiting, _running_batch(engine))
    assert [req.rid for req in engine.waiting] == ["C1", "C2", "long", "short"]
    tree = engine.feather.runtime.queue.tree
    assert tree.missing_chunks("short") < tree.missing_chunks("long")  # the old rule's order


def test_order_follows_the_tree_as_a_new_group_is_admitted() -> None:
    engine = Engine(gate="always")
    engine.arrive(*_interleaved(12, "ABC"))
    admitted = engine.admission_round()
    # Nothing runs: the oldest (A0) first, then its group, which now costs nothing.
    assert [_group(r) for r in admitted] == list("AAAABBBBCCCC")
    assert engine.feather.runtime.queue.num_running == 12


# ---- (b) STOP -------------------------------------------------------------------------


def test_stop_holds_back_other_groups_though_the_budget_allows_more() -> None:
    plain = Engine(feather=False)
    feather = Engine(gate="chunk-loss", gate_options=STRICT)
    for engine in (plain, feather):
        engine.arrive(_req("C", 0))
        assert [r.rid for r in engine.admission_round(max_requests=1)] == ["C0"]
        engine.arrive(*_interleaved(16, "ABCD"))

    assert len(plain.admission_round()) == 16  # SGLang alone: the budget takes all
    admitted = feather.admission_round()
    assert {_group(r) for r in admitted} == {"C"} and len(admitted) == 4
    runtime = feather.feather.runtime
    assert runtime.counts.stop == 1 and runtime.counts.add == 1 + 4
    assert len(runtime) == 12 and runtime.queue.num_running == 5

    # Next round: still only the running group is welcome, and none of it waits.
    assert feather.admission_round() == []
    assert len(feather.waiting) == 12


def test_empty_batch_always_admits_so_the_next_group_starts() -> None:
    engine = Engine(gate="chunk-loss", gate_options=STRICT)
    engine.arrive(*_interleaved(8, "AB"))
    assert {_group(r) for r in engine.admission_round()} == {"A"}
    engine.finish(*engine.running)
    assert {_group(r) for r in engine.admission_round()} == {"B"}


# ---- (c) every request exactly once, above SGLang's 128-request LPM cap ----------------


@pytest.mark.parametrize("gate, options", [("chunk-loss", STRICT), ("chunk-loss", None),
                                           ("bandit", None), ("always", None),
                                           ("model", {"prior": "h100-sxm/llama-3-8b"})])
def test_every_request_is_admitted_once_and_the_tree_empties(gate, options) -> None:
    from sglang.srt.managers import schedule_policy

    engine = Engine(gate=gate, gate_options=options)
    requests = _interleaved(300)
    engine.arrive(*requests[:200])
    assert len(engine.waiting) > schedule_policy.WAITING_QUEUE_PREFIX_MATCH_MAX
    admitted: list[str] = []
    rounds = 0
    while engine.waiting or engine.running:
        rounds += 1
        assert rounds < 1000, "admission stalled"
        if rounds == 3:
            engine.arrive(*requests[200:])
        batch = engine.admission_round(max_requests=16)
        admitted += [req.rid for req in batch]
        if gate == "chunk-loss" and options is STRICT:
            groups = {_group(r) for r in engine.running}
            assert len(groups) <= 1, f"round {rounds} mixed groups {groups}"
        # The oldest running requests finish after one decode step.
        engine.finish(*engine.running[:16])
    assert Counter(admitted) == Counter(req.rid for req in requests)
    runtime = engine.feather.runtime
    assert len(runtime) == 0 and runtime.queue.num_running == 0
    assert not runtime._record.tracked
    assert runtime.meter.stats.steps == rounds


def test_first_round_above_the_cap_admits_one_group() -> None:
    engine = Engine(gate="chunk-loss", gate_options=STRICT)
    engine.arrive(*_interleaved(200))
    batch = engine.admission_round()
    assert len(batch) == 40 and {_group(r) for r in batch} == {"A"}


# ---- (d) aborts and retractions -------------------------------------------------------


def test_aborted_waiting_and_running_requests_leave_the_tree() -> None:
    engine = Engine(gate="always")
    engine.arrive(*_interleaved(6, "AB"))
    engine.admission_round(max_requests=2)  # A0, A2 run
    queue = engine.feather.runtime.queue
    waiting_victim = next(r for r in engine.waiting if r.rid == "B3")
    engine.waiting.remove(waiting_victim)  # Scheduler.abort_request pops it from waiting
    running_victim = engine.running[0]
    engine.finish(running_victim, reason=FINISH_ABORT())  # aborted while running
    assert running_victim.rid not in queue
    engine.admission_round(max_requests=0)  # next round reconciles
    assert waiting_victim.rid not in queue
    assert queue.num_running == 1 and len(queue) == 3


def test_running_request_removed_without_a_result_is_reconciled() -> None:
    engine = Engine(gate="always")
    engine.arrive(*_interleaved(4, "AB"))
    engine.admission_round(max_requests=2)
    gone = engine.running.pop()  # left the running batch by a path no hook saw
    gone.finished_reason = FINISH_ABORT()
    engine.admission_round(max_requests=0)
    assert gone.rid not in engine.feather.runtime
    assert engine.feather.runtime.queue.num_running == 1


@pytest.mark.parametrize("through_hook", [True, False])
def test_retracted_request_returns_to_waiting_and_is_admitted_again(through_hook) -> None:
    engine = Engine(gate="always")
    engine.arrive(*_interleaved(4, "AB"))
    engine.admission_round(max_requests=2)
    queue = engine.feather.runtime.queue
    victim = engine.running.pop()
    if through_hook:  # Scheduler.update_running_batch -> _add_request_to_queue(retracted)
        engine._add_to_queue(victim, is_retracted=True)
        assert queue.state(victim.rid) is QueueState.WAITING
    else:
        engine.waiting.append(victim)
    admitted = engine.admission_round(max_requests=1)
    assert [r.rid for r in admitted] == [victim.rid]  # its group runs: it goes first
    assert queue.state(victim.rid) is QueueState.RUNNING
    assert queue.num_running == 2 and len(queue) == 2


def test_requests_sglang_skips_stay_waiting_and_the_offered_one_is_judged() -> None:
    """SGLang's loop ``continue``s past requests (LoRA slots full, another pooling mode,
    prefetch pending); Feather judges the request actually offered, and every request
    SGLang admits is running in Feather's picture (checked after each round)."""
    engine = Engine(gate="chunk-loss", gate_options=STRICT)
    engine.arrive(_req("A", 100))
    engine.admission_round()
    engine.arrive(*_interleaved(12, "AB"))
    lora_busy = {"A0", "A2"}  # the tree's first candidates, skipped by SGLang
    admitted = engine.admission_round(skip=lambda req: req.rid in lora_busy)
    assert {r.rid for r in admitted} == {"A4", "A6", "A8", "A10"}
    runtime = engine.feather.runtime
    assert all(runtime.queue.state(rid) is QueueState.WAITING for rid in lora_busy)
    assert runtime.counts.stop == 1  # the first B offered ended the round
    admitted = engine.admission_round()
    assert {r.rid for r in admitted} == lora_busy  # no longer skipped: their group, first


# ---- (e) priority scheduling (--enable-priority-scheduling) ---------------------------


@pytest.mark.parametrize("low_first", [False, True])
def test_priority_classes_rank_requests_as_sglang_does(low_first) -> None:
    """Feather's classes order requests exactly as SGLang's own priority scheduling
    (``fcfs``: priority, then arrival) when their prefixes do not tell them apart, both
    ways round, and a request without a priority (SGLang gives it the least urgent value of
    the signed 64-bit range) is least urgent and admitted like any other."""
    priorities = [3, None, 7, -2, 3, 7, None, 0]

    def requests() -> list[Req]:  # no two share a chunk
        return [Req(f"R{i}", "", array("q", range(i * 1000, i * 1000 + PREFIX)),
                    SamplingParams(max_new_tokens=8), priority=p)
                for i, p in enumerate(priorities)]

    sglang = Engine(feather=False, priority=True, low_first=low_first)
    sglang.arrive(*requests())
    sglang.policy.calc_priority(sglang.waiting)
    expected = [req.rid for req in sglang.waiting]
    assert expected[-2:] == ["R1", "R6"]  # no priority: last, in arrival order

    engine = Engine(gate="always", priority=True, low_first=low_first)
    engine.arrive(*requests())
    engine.policy.calc_priority(engine.waiting)
    assert [req.rid for req in engine.waiting] == expected
    view = engine.feather.runtime.view
    assert view.priority(engine.waiting[-1]) == sys.maxsize
    assert [req.rid for req in engine.admission_round()] == expected


def test_priorities_are_ignored_without_priority_scheduling() -> None:
    """Without ``--enable-priority-scheduling`` SGLang keeps a request's priority but
    ignores it (``--abort-on-priority-when-disabled`` off): so does Feather."""
    engine = Engine(gate="always")
    engine.arrive(_req("C", 0))
    engine.admission_round()
    engine.arrive(_req("A", 1, priority=9), _req("C", 2, priority=-9))
    assert [req.rid for req in engine.admission_round(max_requests=1)] == ["C2"]
    assert engine.feather.runtime.queue.priority("A1") == 0


def test_a_more_urgent_request_goes_before_one_that_shares_the_running_prefix() -> None:
    """Strict priority: while a more urgent request waits, no less urgent one is admitted,
    though it would cost no shared chunk; a gate that stops at the urgent one's chunk loss
    thus admits nobody."""
    for gate, options, expected in [("always", None, ["A2", "C1"]),
                                    ("chunk-loss", STRICT, [])]:
        engine = Engine(gate=gate, gate_options=options, priority=True)
        engine.arrive(_req("C", 0, priority=0))
        engine.admission_round()
        engine.arrive(_req("C", 1, priority=0), _req("A", 2, priority=20))
        assert [req.rid for req in engine.admission_round()] == expected
    assert engine.feather.runtime.counts.stop == 1
    assert [req.rid for req in engine.waiting] == ["A2", "C1"]


def test_within_a_class_the_prefix_order_holds() -> None:
    engine = Engine(gate="always", priority=True)
    engine.arrive(_req("C", 0, priority=0))
    engine.admission_round()
    classes = {"A1": 5, "C1": 0, "C2": 5, "A3": 0, "B4": 5, "C5": 5, "B6": 0, "C7": 0}
    engine.arrive(*(_req(rid[0], int(rid[1]), priority=p) for rid, p in classes.items()))
    engine.policy.calc_priority(engine.waiting, _running_batch(engine))
    # the urgent class (5): its running group first, then by arrival; then class 0 alike
    assert [req.rid for req in engine.waiting] == ["C2", "C5", "A1", "B4",
                                                   "C1", "C7", "A3", "B6"]
    assert [req.rid for req in engine.admission_round(max_requests=2)] == ["C2", "C5"]


def test_retraction_takes_the_least_urgent_class_first(monkeypatch) -> None:
    engine = Engine(gate="always", priority=True)
    b0, a0, b1, a1 = (_req("B", 0, priority=0), _req("A", 0, priority=9),
                      _req("B", 1, priority=0), _req("A", 1, priority=9))
    engine.arrive(b0, a0, b1, a1)
    engine.admission_round()
    monkeypatch.setattr(feather_sglang, "_process_feather", engine.feather)
    batch = [a1, b1, a0, b0]
    order = feather_sglang._hook_decode_retraction_order(lambda reqs: [], batch)
    assert [batch[i].rid for i in order] == ["A0", "A1", "B0", "B1"]  # retracted from the end


def _full_batch_of_a(gate: str, options: dict | None = None) -> Engine:
    """Three requests of group A (priorities 0, 0, 5) fill the engine's three seats; then
    an urgent request of group B (priority 20, over SGLang's preemption threshold above
    each) and one more of group A (priority 0) arrive."""
    engine = Engine(gate=gate, gate_options=options, priority=True, kv=True)
    engine.arrive(*(_req("A", i, priority=p) for i, p in enumerate([0, 0, 5])))
    assert len(engine.admission_round(seats=3)) == 3
    engine.arrive(_req("B", 0, priority=20), _req("A", 3, priority=0))
    return engine


def test_priority_preemption_leaves_feathers_picture_exact() -> None:
    """Priority preemption (``PrefillAdder.preempt_to_schedule``) releases, for the urgent
    request, Feather's urgent victim, the newest member of the least urgent class's
    youngest group (A1, not the more urgent A2); A1 waits again in both pictures and, as
    its group still runs and it arrived first, comes before A3 in Feather's order."""
    engine = _full_batch_of_a("always")
    runtime = engine.feather.runtime
    assert runtime.preemption_victim(engine.running).rid == "A1"
    admitted = engine.admission_round(seats=3)  # asserts Feather's running set is SGLang's
    assert [req.rid for req in admitted] == ["B0"]
    a1 = next(req for req in engine.waiting if req.rid == "A1")
    assert not a1.kv.holds_kv  # SGLang released it
    assert runtime.queue.state("A1") is QueueState.WAITING
    assert {r.rid for r in engine.running} == {"A0", "A2", "B0"}
    engine.policy.calc_priority(engine.waiting, engine.batch)
    assert [req.rid for req in engine.waiting] == ["A1", "A3"]


def test_no_priority_preemption_for_a_request_feather_stops() -> None:
    """A gate's STOP for the urgent request comes before SGLang preempts for it: the
    running requests keep their KV, and the round ends."""
    engine = _full_batch_of_a("chunk-loss", STRICT)
    assert engine.admission_round(seats=3) == []
    assert {r.rid for r in engine.running} == {"A0", "A1", "A2"}
    assert all(req.kv.holds_kv for req in engine.running)  # none released
    assert [req.rid for req in engine.waiting] == ["B0", "A3"]
    assert engine.feather.runtime.counts.stop == 1


def _running_a0_b0_a1(pool_tokens: int = 1 << 16) -> Engine:
    """A0, B0 and A1 (priority 0, in that order) hold KV in SGLang's running batch."""
    engine = Engine(gate="always", priority=True, kv=True, pool_tokens=pool_tokens)
    engine.arrive(_req("A", 0, priority=0), _req("B", 0, priority=0), _req("A", 1, priority=0))
    assert len(engine.admission_round()) == 3
    return engine


def _by_rid(reqs: list[Req], rid: str) -> Req:
    return next(req for req in reqs if req.rid == rid)


def test_an_urgent_request_preempts_feathers_victim_for_a_seat_once() -> None:
    """Every seat taken, an urgent request preempts Feather's victim through SGLang's own
    release: B0, the newest member of the youngest group (SGLang's own rule would take
    the latest entry, A1).  B0 gives its KV back, waits again and runs again; then it has
    been preempted ``max_urgent_preemptions`` (1) times, and the next urgent request
    takes A1 instead."""
    engine = _running_a0_b0_a1()
    engine.arrive(_req("C", 0, priority=20))
    assert [r.rid for r in engine.admission_round(seats=3)] == ["C0"]
    b0 = _by_rid(engine.waiting, "B0")
    assert not b0.kv.holds_kv and {r.rid for r in engine.running} == {"A0", "A1", "C0"}
    runtime = engine.feather.runtime
    assert runtime.queue.state("B0") is QueueState.WAITING
    assert runtime.meter.stats.preemptions == 1

    engine.finish(_by_rid(engine.running, "C0"))
    engine.batch.filter_batch()  # SGLang drops finished requests from the running batch
    assert [r.rid for r in engine.admission_round(seats=3)] == ["B0"]
    assert runtime.preemption_victim(engine.running).rid == "B0"  # the bound spares it
    engine.arrive(_req("C", 1, priority=20))
    assert [r.rid for r in engine.admission_round(seats=3)] == ["C1"]
    assert [r.rid for r in engine.waiting] == ["A1"]
    assert runtime.meter.stats.preemptions == 2 and runtime.meter.stats.max_request_preemptions == 1


def test_sglangs_own_victim_while_feather_is_out_of_the_round(monkeypatch,
                                                               contained_faults) -> None:
    """A fault as the round starts hands it to SGLang: its own priority preemption takes
    its own victim (the latest entry, A1), and nothing is lost."""
    engine = _running_a0_b0_a1()
    monkeypatch.setattr(engine.feather.runtime, "begin_pass", lambda *args: 1 / 0)
    engine.arrive(_req("C", 0, priority=20))
    assert [r.rid for r in engine.admission_round(seats=3)] == ["C0"]
    assert [r.rid for r in engine.waiting] == ["A1"] and not engine.waiting[0].kv.holds_kv
    assert [where for where, _ in contained_faults] == ["begin_pass"]


@pytest.mark.parametrize("priority", [0, 5])
def test_no_preemption_within_a_class_or_sglangs_threshold(priority) -> None:
    """A request of the running requests' class, or more urgent by no more than SGLang's
    ``--priority-scheduling-preemption-threshold`` (10), waits for a seat."""
    engine = _running_a0_b0_a1()
    engine.arrive(_req("C", 0, priority=priority))
    assert engine.admission_round(seats=3) == []
    assert all(req.kv.holds_kv for req in engine.running) and len(engine.running) == 3
    assert engine.feather.runtime.meter.stats.preemptions == 0


def test_an_urgent_request_without_kv_room_preempts_until_it_fits() -> None:
    """Seats to spare but no KV room: SGLang's own admission refuses the urgent request
    (``AddReqResult.NO_TOKEN``, where SGLang would not preempt); Feather's victim goes,
    and SGLang's admission, tried again, takes it.  A request that would not fit with
    every running request preempted preempts none."""
    engine = _running_a0_b0_a1(pool_tokens=256)
    urgent = _req("C", 0, priority=20)
    engine.arrive(urgent)
    assert [r.rid for r in engine.admission_round()] == ["C0"]
    assert [r.rid for r in engine.waiting] == ["B0"] and urgent.kv.holds_kv

    huge = Req("huge", "", array("q", range(9000, 9000 + 1000)),
               SamplingParams(max_new_tokens=8), priority=20)
    engine.arrive(huge)
    assert engine.admission_round() == []
    assert {r.rid for r in engine.running} == {"A0", "A1", "C0"}
    assert engine.feather.runtime.meter.stats.preemptions == 1


@pytest.mark.parametrize("seats", [None, 3])
def test_no_preemption_where_a_hybrid_model_lacks_mamba_slots(monkeypatch, seats) -> None:
    """SGLang's adder for a hybrid Mamba model counts its free state slots once, when built
    (``rem_mamba_slots``): with none left, no release this round gives the urgent request
    one, so nobody is preempted, for KV room (every eligible one was) or for a seat."""
    engine = _running_a0_b0_a1(pool_tokens=256)
    built = engine.adder_class.__init__

    def without_mamba_slots(adder, *args, **kwargs):
        built(adder, *args, **kwargs)
        adder.rem_mamba_slots, adder._mamba_slot_cost = 0, 1

    monkeypatch.setattr(engine.adder_class, "__init__", without_mamba_slots)
    monkeypatch.setattr(engine.adder_class, "_mamba_gap_budget_for_req",
                        lambda adder, req, include_host_hit=False: 1)
    engine.arrive(_req("C", 0, priority=20))
    assert engine.admission_round(seats=seats) == []
    assert {r.rid for r in engine.running} == {"A0", "B0", "A1"}
    assert engine.feather.runtime.meter.stats.preemptions == 0


def test_queue_limit_aborts_the_least_urgent_waiting_request() -> None:
    """With ``--max-queued-requests`` full, SGLang aborts the latest least urgent waiting
    request for a more urgent arrival; Feather forgets it and admits the urgent one first."""
    engine = Engine(gate="always", priority=True, max_queued=2)
    engine.arrive(_req("A", 0, priority=0), _req("B", 1, priority=0), _req("C", 2, priority=20))
    assert engine.aborted == ["B1"]
    assert [req.rid for req in engine.admission_round(max_requests=1)] == ["C2"]
    runtime = engine.feather.runtime
    assert "B1" not in runtime and len(runtime) == 1


def test_hooks_install_feather_under_priority_scheduling(monkeypatch) -> None:
    monkeypatch.setattr(feather_sglang, "_process_feather", None)  # restored afterwards
    monkeypatch.setenv("FEATHER_SGLANG", "1")
    scheduler = _stub_scheduler(RadixCache.create_simulated())
    scheduler.enable_priority_scheduling = scheduler.schedule_low_priority_values_first = True
    feather_sglang._hook_init_schedule_policy(lambda s: None, scheduler)
    assert isinstance(scheduler.policy, FeatherSchedulePolicy)
    assert scheduler.policy.enable_priority_scheduling
    view = scheduler.feather.runtime.view
    assert view.priority(_req("A", 0, priority=3)) < view.priority(_req("A", 1, priority=4))


# ---- tenants ----------------------------------------------------------------------------


def _tenant_req(group: str, index: int, tenant: str, priority: int) -> Req:
    req = _req(group, index, priority=priority)
    req.sampling_params.custom_params = {"tenant": tenant}
    return req


def test_the_share_decides_who_takes_the_seat_an_urgent_request_freed() -> None:
    """Four seats held two each by tenants v and t, each with an urgent request waiting,
    both at their seat share: t's, the less served, is offered first and preempts
    Feather's victim, one of v's (the most served tenant's requests go last).  v is then
    below its seat share and t at its, so the share gives the freed seat to v's urgent
    request: SGLang does not add t's in that round, and the next one admits v's first."""
    engine = Engine(gate="always", priority=True, kv=True, fairness="tenants", seats=4)
    engine.arrive(*(_tenant_req(g, i, tenant, 0) for g, tenant in (("A", "v"), ("B", "t"))
                   for i in range(2)))
    assert len(engine.admission_round(seats=4)) == 4
    runtime = engine.feather.runtime
    runtime.served("A0", 100_000, 0)  # v far ahead of t
    engine.arrive(_tenant_req("C", 0, "t", 20), _tenant_req("C", 1, "v", 20))
    assert engine.admission_round(seats=4) == []
    assert runtime.meter.stats.preemptions == 1
    victim = next(req for req in engine.waiting if req.rid in ("A0", "A1"))
    assert not victim.kv.holds_kv and runtime.queue.state(victim.rid) is QueueState.WAITING
    assert [r.rid for r in engine.admission_round(seats=4)] == ["C1", "C0"]  # v's first
    assert runtime.meter.stats.preemptions == 2  # t's preempts in turn: v has none left


def test_the_tenant_is_custom_params_and_a_bad_one_is_refused_as_sglang_refuses() -> None:
    """Under fair share a request's tenant is its ``SamplingParams.custom_params["tenant"]``
    (an integer as its string, none the default tenant); an invalid one aborts the
    request as it enters SGLang's queue, with SGLang's own bad-request abort saying why,
    and it is still admitted once, to finish."""
    engine = Engine(gate="always", fairness="tenants")
    named = [(7, "7"), ("team-a", "team-a"), (None, "default"), (["x"], "default")]
    reqs = [Req(f"R{i}", "", _prompt("A", i),
                SamplingParams(max_new_tokens=8, custom_params=None if raw is None else
                               {"tenant": raw, "other": 1}))
            for i, (raw, _) in enumerate(named)]
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(tp_rank=0):  # a scheduler process's (its abort logs on 0)
        engine.arrive(*reqs)
    queue = engine.feather.runtime.queue
    assert [queue.tenant(req.rid) for req in reqs] == [tenant for _, tenant in named]
    assert [req.to_finish is None for req in reqs] == [True, True, True, False]
    assert reqs[3].to_finish.message.startswith("Invalid request: tenant must be a non-empty")
    assert reqs[3].to_finish.status_code == 400
    assert [r.rid for r in engine.admission_round()] == ["R0", "R1", "R2", "R3"]
    runtime = engine.feather.runtime
    runtime.served("R1", 10, 1)  # what a step counts (the server: served)
    hits, prompt = queue.share.hit_weight, runtime.view.prompt_tokens(reqs[1])
    assert queue.share.service("team-a") == hits * prompt + (1 - hits) * 10 + 2 * 1


# ---- faults of Feather's own code -------------------------------------------------------


def test_a_fault_hands_the_round_to_sglangs_own_order(monkeypatch, contained_faults) -> None:
    """With room for one, Feather admits the waiting request of the running group; when
    its code raises as the round starts, SGLang's ``fcfs`` order admits the oldest,
    and Feather serves the next round again, its picture rebuilt."""
    def second_admission(fault: bool) -> str:
        engine = Engine(gate="always")
        engine.arrive(_req("A", 0))
        engine.admission_round()
        engine.arrive(_req("B", 1), _req("A", 2))
        if fault:
            monkeypatch.setattr(engine.feather.runtime.queue.tree, "best",
                                lambda *args: 1 / 0)  # this tree only: a rebuild drops it
        admitted = engine.admission_round(max_requests=1)
        assert engine.feather.faults.dirty is fault
        engine.arrive(_req("A", 3))
        assert [r.rid for r in engine.admission_round(max_requests=1)] == ["A2" if fault
                                                                          else "A3"]
        assert not engine.feather.faults.dirty and engine.running_ids() == {
            r.rid for r in engine.running}
        return admitted[0].rid

    assert second_admission(fault=False) == "A2"
    assert second_admission(fault=True) == "B1"
    assert [where for where, _ in contained_faults] == ["order"]


def test_the_running_batch_is_put_in_group_order_and_left_alone_on_a_fault(
        monkeypatch, contained_faults) -> None:
    """SGLang's real running batch (KV held, ``filter_batch``): Feather puts each group's
    requests together; when its order raises, the batch stays as SGLang has it."""
    def run(fault: bool) -> list[str]:
        engine = Engine(gate="always", kv=True)
        for req in (_req("A", 0), _req("B", 1), _req("A", 2)):
            engine.arrive(req)
            engine.admission_round()
        assert [r.rid for r in engine.batch.reqs] == ["A0", "B1", "A2"]
        if fault:
            monkeypatch.setattr(engine.feather.runtime, "batch_order", lambda reqs: 1 / 0)
        engine.feather.order_running(engine.batch)
        return [r.rid for r in engine.batch.reqs]

    assert run(fault=False) == ["A0", "A2", "B1"]
    assert run(fault=True) == ["A0", "B1", "A2"]
    assert [where for where, _ in contained_faults] == ["order_running"]


def test_the_retraction_order_is_sglangs_own_on_a_fault(monkeypatch, contained_faults) -> None:
    engine = Engine(gate="always")
    batch = [_req("A", 0), _req("B", 1)]
    engine.arrive(*batch)
    monkeypatch.setattr(feather_sglang, "_process_feather", engine.feather)
    sglangs = lambda reqs: [1, 0]  # noqa: E731
    assert feather_sglang._hook_decode_retraction_order(sglangs, batch) == [0, 1]
    monkeypatch.setattr(engine.feather.runtime, "order", lambda reqs: 1 / 0)
    assert feather_sglang._hook_decode_retraction_order(sglangs, batch) == [1, 0]
    assert [where for where, _ in contained_faults] == ["retraction_order"]


def _rounds(engine: Engine, requests: list[Req], rounds: int,
            watch: Callable[[int, str], None]) -> list[Req]:
    """``rounds`` rounds of two arrivals, an admission round of up to two and the oldest
    running request finishing (``watch(n, step)`` before round ``n`` and past each of its
    steps), then rounds until every request has finished; the requests admitted."""
    admitted: list[Req] = []
    for n in range(rounds):
        watch(n, "start")
        engine.arrive(*requests[2 * n: 2 * n + 2])
        watch(n, "arrived")
        admitted += engine.admission_round(max_requests=2)
        watch(n, "admitted")
        engine.finish(*engine.running[:1])
        watch(n, "finished")
    while engine.waiting or engine.running:
        admitted += engine.admission_round()
        engine.finish(*engine.running)
    return admitted


@pytest.mark.parametrize(("member", "where"), [
    ("enter_waiting", "enter_waiting"), ("begin_pass", "begin_pass"),
    ("rank_waiting", "order"), ("decide", "decide"), ("admit", "admit"),
    ("end_pass", "end_pass"), ("discard", "step")])
def test_a_fault_at_each_hook_leaves_the_round_to_sglang_and_the_next_is_feathers(
        member: str, where: str, monkeypatch, contained_faults) -> None:
    """Every call of the adapter into Feather asks the guard's one predicate
    (``faults.serves``): after a fault at any of them no serving call reaches Feather
    until the next round opens (SGLang's own admission and order serve), and that round
    is Feather's again, its picture rebuilt and exact (``Engine.admission_round``)."""
    engine = Engine(gate="always")
    faults = engine.feather.faults
    spy = ServingSpy(monkeypatch, engine.feather.runtime)
    left_in: list = []
    back: list[bool] = []

    def watch(n: int, step: str) -> None:
        if n == 3 and not left_in:
            spy.break_next(member)
            left_in.append(-1)
        elif contained_faults and len(left_in) == 1:
            assert not faults.serves and faults.dirty
            left_in.append((n, step))
        elif len(left_in) == 2 and step == "admitted" and (n, step) != left_in[1] and \
                not back:  # the first round after the fault
            back.append(faults.serves and not faults.dirty)

    requests = _interleaved(24)
    admitted = _rounds(engine, requests, 12, watch)
    assert [w for w, _ in contained_faults] == [where] and spy.strays == [] and back == [True]
    assert Counter(r.rid for r in admitted) == Counter(r.rid for r in requests)


def test_while_feathers_rebuild_fails_sglang_serves_every_call(monkeypatch,
                                                               contained_faults) -> None:
    """Five rounds whose rebuild raises, with arrivals, admissions and exits in them: no
    call reaches Feather's serving code (each asks ``faults.serves``); the next round is
    Feather's again and every request is admitted once."""
    engine = Engine(gate="always")
    runtime = engine.feather.runtime
    spy = ServingSpy(monkeypatch, runtime)

    def watch(n: int, step: str) -> None:
        if (n, step) == (2, "start"):
            spy.break_next("begin_pass", times=5)

    requests = _interleaved(24)
    admitted = _rounds(engine, requests, 12, watch)
    assert [w for w, _ in contained_faults] == ["begin_pass"] * 5 and spy.strays == []
    assert Counter(r.rid for r in admitted) == Counter(r.rid for r in requests)
    assert runtime.faults.serves and len(runtime) == 0


@pytest.mark.parametrize("fairness", ["off", "tenants", "vtc"])
@pytest.mark.parametrize("seed", range(3))
def test_random_faults_in_feathers_code_lose_no_request(seed: int, fairness: str,
                                                        monkeypatch, contained_faults) -> None:
    """Exceptions from the tree, the gate, the meter, the metrics sink, the running order,
    the rebuild after a fault (aimed at it) and the tenant share at random rounds, with
    fair share off and on (each step's service counted): every request is admitted
    exactly once and leaves Feather once, and each fault is counted once (every fault
    contained is one injected: none follows from another)."""
    rng = random.Random(seed)
    engine = Engine(gate="bandit", fairness=fairness)
    runtime = engine.feather.runtime
    runtime.meter.sink = PrometheusSink(f"sglang-faults{seed}{fairness}")
    injector = Injector(monkeypatch, seed, rate=0.4)
    injector.target_all(fault_targets(fairness))
    requests, admitted = _interleaved(400), []
    for req in requests:
        req.sampling_params.custom_params = {"tenant": rng.choice("abc")}
    while requests or engine.waiting or engine.running:
        count = rng.randrange(6)
        engine.arrive(*requests[:count])
        requests = requests[count:]
        injector.next_pass(rebuilding=runtime.faults.dirty)
        admitted += engine.admission_round(max_requests=rng.randrange(1, 9))
        engine.finish(*rng.sample(engine.running, min(len(engine.running), rng.randrange(6))))
        assert len(admitted) < 4000, "admission stalled"
    injector.armed = False
    engine.admission_round()  # an idle round: Feather rebuilt once more, empty
    assert Counter(r.rid for r in admitted) == Counter(r.rid for r in _interleaved(400))
    assert len(injector.raised) == len(contained_faults) == runtime.meter.stats.faults > 10
    assert all(isinstance(error, InjectedFault) for _, error in contained_faults)
    assert set(injector.raised) == {label for _, _, label in fault_targets(fairness)}
    assert runtime.faults.active and not runtime._record.tracked and len(runtime) == 0
    stats = runtime.meter.stats
    assert stats.requests_entered == stats.requests_left  # those Feather saw: each once
    if fairness != "off":
        assert all(runtime.queue.share.service(tenant) > 0 for tenant in "abc")


def test_faults_in_a_row_turn_feather_off_in_the_scheduler(monkeypatch, contained_faults,
                                                           caplog) -> None:
    """A fault in every round: after ``max_faults`` of them in a row Feather is off, with
    one error line; SGLang's ``fcfs`` order admits every request from then on."""
    engine = Engine(gate="always")
    engine.feather.faults.limit = 3
    monkeypatch.setattr(ChunkedHashTree, "best", lambda *args: 1 / 0)
    requests = _interleaved(12)
    engine.arrive(*requests)
    admitted = []
    while engine.waiting:
        admitted += engine.admission_round(max_requests=2)
        engine.finish(*engine.running)
    assert admitted == requests  # arrival order, every round
    assert not engine.feather.faults.active and engine.feather.runtime.meter.stats.faults == 3
    assert [where for where, _ in contained_faults] == ["order"] * 3
    off = [r for r in caplog.records if "Feather is off" in r.getMessage()]
    assert len(off) == 1 and off[0].levelname == "ERROR"


# ---- plumbing -------------------------------------------------------------------------


def test_step_time_feeds_the_meter() -> None:
    engine = Engine(gate="bandit")
    engine.arrive(*_interleaved(4, "AB"))
    engine.admission_round()
    running = len(engine.running)
    engine.finish()
    stats = engine.feather.runtime.meter.stats
    assert stats.steps == 1 and stats.batched_requests == running >= 2
    assert stats.step_s >= 0.01


def test_hooks_target_real_scheduler_methods_and_register_once() -> None:
    import pkgutil

    from sglang.srt.plugins.hook_registry import HookRegistry

    for target in feather_sglang.HOOKS:
        owner, name = target.rsplit(".", 1)
        assert callable(getattr(pkgutil.resolve_name(owner), name)), target
    feather_sglang.register()
    feather_sglang.register()
    for target, hook in feather_sglang.HOOKS.items():
        assert [h for _, h, _ in HookRegistry._hooks[target]].count(hook) == 1


def _stub_scheduler(tree_cache) -> SimpleNamespace:
    return SimpleNamespace(
        tree_cache=tree_cache, enable_hierarchical_cache=False,
        enable_priority_scheduling=False, schedule_low_priority_values_first=False,
        chunked_req=None, dllm_config=None, policy="sglang's", max_running_requests=48,
        max_total_num_tokens=4096)


def test_hooks_are_inert_unless_feather_is_selected(monkeypatch) -> None:
    monkeypatch.delenv("FEATHER_SGLANG", raising=False)
    scheduler = _stub_scheduler(RadixCache.create_simulated())
    feather_sglang._hook_init_schedule_policy(lambda s: None, scheduler)
    assert scheduler.feather is None and scheduler.policy == "sglang's"
    adder = feather_sglang._hook_get_prefill_adder_class(lambda s: PrefillAdder, scheduler)
    assert adder is PrefillAdder


def test_tensor_parallel_schedulers_refuse_feather_at_start_up(monkeypatch) -> None:
    """Every TP rank runs a scheduler that must form the same batches; Feather's decisions
    read per-process inputs, so a TP scheduler asked for Feather fails to start, saying
    why, instead of running SGLang's order.  SGLang's own runtime context (TP 2) and its
    own ``Scheduler.init_schedule_policy``, through Feather's hook."""
    from sglang.srt.runtime_context import get_context, get_parallel

    monkeypatch.setenv("FEATHER_SGLANG", "1")
    with get_context().override_server_args(device="cpu", tp_size=2):
        assert get_parallel().tp_size == 2
        scheduler = object.__new__(Scheduler)
        vars(scheduler).update(vars(_stub_scheduler(RadixCache.create_simulated())),
                               schedule_policy="fcfs", tp_size=get_parallel().tp_size)
        with pytest.raises(FeatherConfigError, match=r"cannot run in this SGLang scheduler: "
                           r"tensor parallelism \(tp_size 2\).*diverge and hang"):
            feather_sglang._hook_init_schedule_policy(Scheduler.init_schedule_policy,
                                                      scheduler)
        assert scheduler.feather is None
    monkeypatch.delenv("FEATHER_SGLANG")  # SGLang's own policies stay as they are
    with get_context().override_server_args(device="cpu", tp_size=2):
        feather_sglang._hook_init_schedule_policy(Scheduler.init_schedule_policy, scheduler)
    assert type(scheduler.policy) is SchedulePolicy and scheduler.feather is None


def test_the_tree_orders_the_list_without_asking_the_gate() -> None:
    engine = Engine(gate="bandit")
    engine.arrive(*_interleaved(8, "AB"))
    engine.admission_round(max_requests=3)
    counts = engine.feather.runtime.counts
    # once per offer: three admitted, the fourth refused by SGLang's own request cap
    assert (counts.asked, counts.add) == (4, 3)


def test_retraction_takes_the_youngest_groups_newest_member_first(monkeypatch) -> None:
    """SGLang retracts from the end of ``_get_decode_retraction_order``: under Feather the
    newest member of the youngest group (by its oldest member), whatever its output
    length or place in the batch: B0, though A1 arrived later, as A0 is older."""
    engine = Engine(gate="always")
    a0, b0, a1 = _req("A", 0), _req("B", 0), _req("A", 1)
    engine.arrive(a0, b0, a1)
    batch = [b0, a1, a0]
    a1.output_ids = [1] * 50  # SGLang's own rule would keep the longest-running
    sglangs = lambda reqs: list(range(len(reqs)))  # noqa: E731
    monkeypatch.setattr(feather_sglang, "_process_feather", None)
    assert feather_sglang._hook_decode_retraction_order(sglangs, batch) == [0, 1, 2]
    monkeypatch.setattr(feather_sglang, "_process_feather", engine.feather)
    order = feather_sglang._hook_decode_retraction_order(sglangs, batch)
    assert [batch[i].rid for i in order] == ["A0", "A1", "B0"]


def test_retracted_requests_are_counted_as_preemptions(monkeypatch) -> None:
    """SGLang's ``retract_decode`` returns what it retracted: each is one preemption of
    its request, in the stats file (and on /metrics)."""
    engine = Engine(gate="always")
    a0, b0, a1 = _req("A", 0), _req("B", 0), _req("A", 1)
    engine.arrive(a0, b0, a1)
    engine.admission_round()
    retract = lambda batch: ([a1, b0], 0.5, [])  # noqa: E731
    monkeypatch.setattr(feather_sglang, "_process_feather", engine.feather)
    assert feather_sglang._hook_retract_decode(retract, object())[0] == [a1, b0]
    stats = engine.feather.runtime.meter.stats
    assert stats.preemptions == 2 and stats.max_request_preemptions == 1
    assert "sglang.srt.managers.schedule_batch.ScheduleBatch.retract_decode" in \
        feather_sglang.HOOKS


def installed(monkeypatch, options: str) -> SimpleNamespace:
    """A stub scheduler over a simulated radix cache after SGLang's
    ``init_schedule_policy`` hook ran with Feather selected and ``options`` (JSON)."""
    monkeypatch.setattr(feather_sglang, "_process_feather", None)  # restored afterwards
    monkeypatch.setenv("FEATHER_SGLANG", "1")
    monkeypatch.setenv("FEATHER_SGLANG_OPTIONS", options)
    scheduler = _stub_scheduler(RadixCache.create_simulated())
    feather_sglang._hook_init_schedule_policy(lambda s: None, scheduler)
    return scheduler


def test_hooks_install_feather_when_selected(monkeypatch) -> None:
    scheduler = installed(monkeypatch, '{"gate": "bandit", "chunk_tokens": 64}')
    assert isinstance(scheduler.policy, FeatherSchedulePolicy)
    assert scheduler.feather.config.gate == "bandit"
    assert scheduler.feather.config.chunk_tokens == 64
    assert scheduler.feather.runtime.queue.seats == 48  # the model gate's free seats
    assert scheduler.feather.runtime.queue.kv_tokens == 4096  # with them: fits_all
    adder = feather_sglang._hook_get_prefill_adder_class(lambda s: PrefillAdder, scheduler)
    assert issubclass(adder, FeatherPrefillAdder) and adder.feather is scheduler.feather
    assert feather_sglang._process_feather is scheduler.feather  # for the retraction hook


def test_the_model_gate_gets_sglangs_model_for_its_prior(monkeypatch) -> None:
    """The hook describes SGLang's model config (and device, where SGLang names one) to
    the runtime; this CPU has no built-in profile, so the model gate starts cold."""
    monkeypatch.setenv("FEATHER_SGLANG", "1")
    monkeypatch.setenv("FEATHER_SGLANG_OPTIONS", '{"order_running": false}')
    scheduler = _stub_scheduler(RadixCache.create_simulated())
    scheduler.model_config = ModelConfig(str(TINY_LLAMA))
    shape = feather_sglang.engine_shape(scheduler)
    assert shape.device_name is None and shape.dtype_bytes == 2
    assert shape.model_config["num_hidden_layers"] == 2
    assert StepPrior.for_engine(shape)[0] is None
    monkeypatch.setattr(feather_sglang, "_process_feather", None)  # restored afterwards
    feather_sglang._hook_init_schedule_policy(lambda s: None, scheduler)
    gate = scheduler.feather.runtime.queue.gate
    assert isinstance(gate, ModelGate) and gate.model.prior is None
    assert gate.layout is BatchLayout.ENGINE
    assert feather_sglang.engine_shape(_stub_scheduler(None)) is None

# ---- isolation ------------------------------------------------------------------------


def _bounded(rid: str, index: int, tenant: str | None = None, **boundary: str) -> Req:
    """Group A's prompt ``index`` with SGLang's cache boundary fields (``cache_salt``,
    ``extra_key``, ``lora_id``) and a tenant (``custom_params``) where given."""
    params = SamplingParams(max_new_tokens=8,
                            custom_params=None if tenant is None else {"tenant": tenant})
    return Req(rid, "", _prompt("A", index), params, **boundary)


def _groups_and_shared(engine: Engine, reqs: list[Req]) -> tuple[dict, dict]:
    """Each request's prefix group, and the tokens it shares in one batch of ``reqs``
    (what the step log and ``feather:prefix_groups_per_step`` count)."""
    runtime = engine.feather.runtime
    entries = runtime.describe_batch([(req, len(req.origin_input_ids), 1) for req in reqs])
    return ({req.rid: runtime.group(req) for req in reqs},
            {req.rid: entry.shared_tokens for req, entry in zip(reqs, entries, strict=True)})


@pytest.mark.parametrize("field", ["cache_salt", "extra_key", "lora_id"])
def test_requests_across_a_cache_boundary_are_never_one_group(field: str) -> None:
    engine = Engine(gate="always")
    reqs = [_bounded("P0", 0), _bounded("P1", 1),
            _bounded("S0", 0, **{field: "tenant-a"}), _bounded("S1", 1, **{field: "tenant-b"}),
            _bounded("S2", 2, **{field: "tenant-a"})]
    engine.arrive(*reqs)
    assert len(engine.admission_round()) == 5
    groups, shared = _groups_and_shared(engine, reqs)
    assert groups["P0"] == groups["P1"] and shared["P0"] == shared["P1"] == PREFIX
    assert groups["S0"] == groups["S2"] and shared["S0"] == shared["S2"] == PREFIX
    assert len({groups["P0"], groups["S0"], groups["S1"]}) == 3 and shared["S1"] == 0


def test_a_waiting_request_is_not_ranked_by_a_prefix_across_a_boundary() -> None:
    for salts, expected in ((("a", "b", "a"), ["a2"]), ((None, None, None), ["b1", "a2"])):
        engine = Engine(gate="chunk-loss", gate_options=STRICT)
        first, other, same = (_bounded(f"{name}{i}", i, cache_salt=salt)
                              for i, (name, salt) in enumerate(zip("aba", salts, strict=True)))
        engine.arrive(first)
        assert engine.admission_round(max_requests=1) == [first]
        engine.arrive(other, same)
        # Salted: b1 shares nothing with the running a0 (the gate stops at it), and a2
        # passes it; unsalted, all three are one group and both are admitted in order.
        assert [req.rid for req in engine.admission_round()] == expected


@pytest.mark.parametrize("isolate", [False, True])
def test_isolate_tenants_gives_each_named_tenant_its_own_namespace(isolate: bool) -> None:
    engine = Engine(gate="always", isolate_tenants=isolate)
    reqs = [_bounded("A0", 0, "alice"), _bounded("A1", 1, "alice"), _bounded("B0", 0, "bob"),
            _bounded("U0", 0), _bounded("U1", 1)]
    engine.arrive(*reqs)
    engine.admission_round()
    groups, _ = _groups_and_shared(engine, reqs)
    assert groups["A0"] == groups["A1"] and groups["U0"] == groups["U1"]
    assert (len({groups["A0"], groups["B0"], groups["U0"]}) == 3) is isolate


# ---- launcher -------------------------------------------------------------------------


def test_launcher_turns_the_feather_policy_into_environment() -> None:
    environ: dict[str, str] = {}
    argv = sglang_launch.configure(
        ["--model-path", "m", "--schedule-policy=feather", "--feather-options",
         '{"gate": "always"}', "--port", "1"], environ)
    assert argv == ["--model-path", "m", "--schedule-policy", "fcfs", "--port", "1"]
    assert environ == {"FEATHER_SGLANG": "1", "FEATHER_SGLANG_OPTIONS": '{"gate": "always"}'}

    environ = {}
    assert sglang_launch.configure(["--schedule-policy", "lpm"], environ) == [
        "--schedule-policy", "lpm"]
    assert environ == {}


def test_launcher_rejects_bad_feather_options() -> None:
    with pytest.raises(SystemExit, match="gate"):
        sglang_launch.configure(["--schedule-policy", "feather", "--feather-options",
                                 '{"gate": "nope"}'], {})
    with pytest.raises(SystemExit, match="needs --schedule-policy feather"):
        sglang_launch.configure(["--feather-options", "{}"], {})


def test_launcher_help_shows_feather_and_sglang_options() -> None:
    out = io.StringIO()
    with redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        sglang_launch.main(["--help"])
    assert exit_info.value.code == 0
    text = out.getvalue()
    assert "--schedule-policy feather" in text and "--feather-options" in text
    assert "--model-path" in text


def _running_batch(engine: Engine) -> ScheduleBatch:
    return ScheduleBatch(reqs=list(engine.running))
