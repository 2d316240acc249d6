"""Urgent preemption (``UrgentRoom``) on vLLM 0.32's real ``Scheduler`` and
``AsyncScheduler``, driven as ``test_scheduler``'s harness drives them (fabricated outputs;
the async variant keeps one step in flight, as vLLM's engine core does on GPUs), and on
the real CPU engine (sync: vLLM on CPU has no async scheduling), whose greedy outputs show
that a victim finishes as if never preempted."""

from __future__ import annotations

import logging
import os
from collections import Counter, defaultdict
from dataclasses import replace

import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed")

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm.v1.request import RequestStatus

from feather_sched.integrations.vllm import urgent
from feather_sched.models import TINY_LLAMA
from tests.helpers.vllm_engines import shut_down
from tests.integrations.vllm.test_scheduler import Harness


@pytest.fixture(autouse=True)
def _no_multiprocessing(monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


class Outputs:
    """Every token vLLM's ``update_from_output`` hands out, and every finish, by request."""

    def __init__(self, harness: Harness) -> None:
        self.tokens: defaultdict[str, list[int]] = defaultdict(list)
        self.finished: Counter[str] = Counter()
        update = harness.scheduler.update_from_output

        def recording(scheduler_output, model_runner_output):
            result = update(scheduler_output, model_runner_output)
            for outputs in result.values():
                for output in outputs.outputs:
                    self.tokens[output.request_id] += output.new_token_ids
                    self.finished[output.request_id] += output.finish_reason is not None
            return result

        harness.scheduler.update_from_output = recording


def urgent_harness(async_scheduling: bool, urgent: int, **engine: object) -> Harness:
    return Harness(async_scheduling=async_scheduling, scheduling_policy="priority",
                   feather={"max_urgent_preemptions": urgent}, **engine)


def run(harness: Harness, arrivals: dict[int, list], limit: int = 400) -> dict:
    """Add ``arrivals`` (step: requests) and drive to the end: the step each request was
    first scheduled, the preemptions of each step, and the outputs."""
    outputs, first, victims = Outputs(harness), {}, []
    lengths = {}
    while arrivals or harness.scheduler.has_requests() or harness.in_flight:
        for request in arrivals.pop(harness.steps, []):
            lengths[request.request_id] = request.max_tokens
            harness.add(request)
        if not harness.scheduler.has_requests():
            if harness.in_flight:
                harness.scheduler.update_from_output(*harness.in_flight.pop(0))
            else:
                harness.steps += 1  # nothing yet: time passes
            continue
        output = harness.step()
        for rid in output.num_scheduled_tokens:
            first.setdefault(rid, harness.steps)
        victims.append(sorted(output.preempted_req_ids))
        assert harness.steps < limit, "the engine stalled"
    assert outputs.finished == Counter(lengths.keys())  # each exactly once
    assert {rid: len(t) for rid, t in outputs.tokens.items()} == lengths
    harness.assert_empty()
    return {"first": first, "victims": victims, "stats": harness.runtime.meter.stats}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_urgent_request_takes_the_seat_of_the_newest_less_urgent_decode(
        async_scheduling: bool) -> None:
    """Two seats held by long class-1 decodes: a class-0 request runs in the step it
    arrives, the younger decode giving way once (and finishing in full); with the
    option at 0 it waits for a decode to finish."""
    def scenario(urgent: int) -> dict:
        harness = urgent_harness(async_scheduling, urgent, max_num_seqs=2)
        low = [harness.request(f"low{i}", group=i, max_tokens=60, priority=1)
               for i in range(2)]
        return run(harness, {0: low, 5: [harness.request("urgent", group=2, priority=0)]})

    preempting, waiting = scenario(1), scenario(0)
    assert preempting["first"]["urgent"] == 6
    assert [v for v in preempting["victims"] if v] == [["low1"]]
    assert (preempting["stats"].preemptions, preempting["stats"].urgent_preemptions) == (1, 1)
    assert waiting["first"]["urgent"] > 55
    assert waiting["stats"].preemptions == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_urgent_request_takes_only_the_kv_blocks_it_needs(async_scheduling: bool) -> None:
    """A KV cache nearly full of two long class-1 decodes (11 of 29 blocks each, 7 free):
    a class-0 request of 9 blocks runs in the step it arrives, and one decode gives way,
    not both; with the option at 0 it waits until a decode finishes. One that shares a
    running decode's 8-block prefix needs one block: nobody gives way."""
    def scenario(urgent: int, group: int = 2) -> dict:
        harness = urgent_harness(async_scheduling, urgent, num_blocks=30)
        low = [harness.request(f"low{i}", group=i, max_tokens=60, priority=1)
               for i in range(2)]
        return run(harness, {0: low,
                             30: [harness.request("urgent", group=group, priority=0)]})

    preempting, waiting, sharing = scenario(1), scenario(0), scenario(1, group=0)
    assert preempting["first"]["urgent"] == 31
    assert [v for v in preempting["victims"] if v] == [["low1"]]
    assert preempting["stats"].urgent_preemptions == 1
    assert waiting["first"]["urgent"] > 55
    assert waiting["stats"].preemptions == 0
    assert sharing["first"]["urgent"] == 31 and sharing["stats"].preemptions == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_victim_whose_prefix_stays_held_is_not_preempted_for_kv_room(
        async_scheduling: bool) -> None:
    """The end of Feather's class-1 order shares its 8-block prefix with a running class-0
    request, so preempting it frees only its own 3 blocks, too few for the urgent request's
    9 (4 free); the older class-1 request frees 11. Only that one gives way."""
    harness = urgent_harness(async_scheduling, 1, num_blocks=30)
    running = [harness.request("anchor", group=0, max_tokens=60, priority=0),
               harness.request("loner", group=1, max_tokens=60, priority=1),
               harness.request("sharer", group=0, max_tokens=60, priority=1)]
    result = run(harness, {0: running, 30: [harness.request("urgent", group=2, priority=0)]})
    assert [v for v in result["victims"] if v] == [["loner"]]
    assert result["first"]["urgent"] == 31


@pytest.mark.parametrize("saturated", [False, True])
def test_no_room_is_made_in_a_pass_whose_prefills_vllm_defers(saturated: bool) -> None:
    """Under data parallelism vLLM throttles prefills on some steps (its DP prefill
    balancing), deferring them while decodes run unless its last pass left requests
    waiting for capacity: then nobody is preempted for an urgent request, and in the next
    pass room is made and it runs. Saturated (a third request waits for a seat), vLLM
    admits on the throttled step too, and so the urgent request goes at once."""
    harness = urgent_harness(False, 1, max_num_seqs=2)
    harness.add(*(harness.request(f"low{i}", group=i, max_tokens=60, priority=1)
                  for i in range(2 + saturated)))
    for _ in range(3):
        harness.step()
    assert harness.scheduler.prefill_capacity_bound is saturated
    harness.add(harness.request("urgent", group=3, priority=0))
    throttled = harness.step(throttle_prefills=True)
    if saturated:
        assert throttled.preempted_req_ids == {"low1"}
        assert "urgent" in throttled.num_scheduled_tokens
    else:
        assert not throttled.preempted_req_ids
        assert "urgent" not in throttled.num_scheduled_tokens
        output = harness.step()
        assert output.preempted_req_ids == {"low1"} and "urgent" in output.num_scheduled_tokens
    harness.drain()
    harness.assert_empty()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_no_request_gives_way_to_its_own_class_nor_beyond_the_bound(
        async_scheduling: bool) -> None:
    """Two seats. A class-1 arrival does not preempt class 1; class-0 arrivals preempt
    each class-1 request once (the bound, 1), never a class-0 one; a third finds both
    at their bound and waits for a seat."""
    harness = urgent_harness(async_scheduling, 1, max_num_seqs=2)
    low = [harness.request(f"low{i}", group=i, max_tokens=80, priority=1) for i in range(2)]
    result = run(harness, {
        0: low, 3: [harness.request("late-low", group=3, max_tokens=4, priority=1)],
        5: [harness.request("u0", group=4, max_tokens=30, priority=0)],
        8: [harness.request("u1", group=5, max_tokens=30, priority=0)],
        11: [harness.request("u2", group=6, max_tokens=4, priority=0)]})
    victims = [v for step in result["victims"] for v in step]
    assert Counter(victims) == {"low0": 1, "low1": 1}
    assert result["stats"].urgent_preemptions == 2
    assert result["first"]["u0"] == 6 and result["first"]["u1"] == 9
    assert result["first"]["u2"] > 35  # after u0 or u1 finished
    assert result["first"]["late-low"] > result["first"]["u2"]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_less_urgent_held_request_does_not_take_the_urgent_ones_seat(
        async_scheduling: bool) -> None:
    """Two seats: a class-1 decode, and a class-1 streaming session between turns (it
    keeps its seat). Its next turn and a class-0 request arrive together: the session,
    back in ``kv_holding_waiting``, which vLLM drains first, would take the one seat; the
    urgent request goes first instead, in the step it arrives, and nobody is preempted."""
    harness = urgent_harness(async_scheduling, 1, max_num_seqs=2)
    session = harness.request("session", group=1, max_tokens=2, priority=1, resumable=True)
    harness.add(harness.request("low", group=0, max_tokens=40, priority=1), session)
    while session.status is not RequestStatus.WAITING_FOR_STREAMING_REQ:
        harness.step()
    harness.add(harness.request("session", group=1, priority=1, resumable=True, suffix=40),
                harness.request("urgent", group=2, priority=0))
    output = harness.step()
    assert "urgent" in output.num_scheduled_tokens
    assert "session" not in output.num_scheduled_tokens and not output.preempted_req_ids
    harness.scheduler.finish_requests("session", RequestStatus.FINISHED_ABORTED)
    harness.drain()
    harness.assert_empty()


def test_a_fault_in_urgent_preemption_hands_the_pass_to_vllm(monkeypatch,
                                                            contained_faults) -> None:
    """An exception in the urgent victims' choice: contained and counted once, that pass
    served by vLLM's own order (the urgent request waits), the next by Feather (it goes
    in); every request finishes once, in full."""
    harness = urgent_harness(False, 1, max_num_seqs=2)
    urgent_victims = harness.runtime.urgent_victims

    def failing_once(*args):
        monkeypatch.setattr(harness.runtime, "urgent_victims", urgent_victims)
        raise ZeroDivisionError

    monkeypatch.setattr(harness.runtime, "urgent_victims", failing_once)
    low = [harness.request(f"low{i}", group=i, max_tokens=20, priority=1) for i in range(2)]
    result = run(harness, {0: low, 3: [harness.request("urgent", group=2, priority=0)]})
    assert [where for where, _ in contained_faults] == ["urgent"]
    assert result["first"]["urgent"] == 5 and result["stats"].urgent_preemptions == 1


def test_a_vllm_without_a_private_member_leaves_urgent_preemption_off(monkeypatch,
                                                                       caplog) -> None:
    """A vLLM release without one of the members ``urgent.PRIVATE`` names: one warning
    when the scheduler is built, naming it, and the urgent request waits for a seat as
    under vLLM's own priority policy; nothing raises."""
    monkeypatch.setattr(urgent, "PRIVATE", (*urgent.PRIVATE, "_gone_in_this_release"))
    # a logger of the test's own: an engine's logging set-up may have disabled Feather's
    monkeypatch.setattr(urgent, "logger", logging.getLogger("tests.vllm_urgent"))
    harness = urgent_harness(False, 1, max_num_seqs=2)
    low = [harness.request(f"low{i}", group=i, max_tokens=30, priority=1) for i in range(2)]
    result = run(harness, {0: low, 3: [harness.request("urgent", group=2, priority=0)]})
    warned = [r.getMessage() for r in caplog.records
              if r.levelno == logging.WARNING and "urgent preemption" in r.getMessage()]
    assert len(warned) == 1 and "_gone_in_this_release" in warned[0]
    assert result["first"]["urgent"] > 25 and result["stats"].preemptions == 0


# ---- the real engine ---------------------------------------------------------------------

BLOCK = 32
KV_BYTES_PER_TOKEN = 2 * 8 * 64 * 2 * 4  # layers x KV heads x head dim x (K, V) x fp32


@pytest.fixture(scope="module")
def engine():
    """One engine: 3 seats, 26 KV blocks of 32 tokens (25 usable), vLLM's priority
    policy; fp32, so that equal greedy tokens do not rest on bf16 rounding alike in a
    victim's recomputed prefill and in its decodes."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    llm = LLM(model=str(TINY_LLAMA), load_format="dummy", skip_tokenizer_init=True,
              enforce_eager=True, seed=0, dtype="float32", max_model_len=512,
              block_size=BLOCK, max_num_seqs=3, scheduling_policy="priority",
              kv_cache_memory_bytes=26 * BLOCK * KV_BYTES_PER_TOKEN,
              scheduler_cls="feather_sched.integrations.vllm.FeatherScheduler")
    yield llm
    shut_down(llm)


def generate(llm: LLM, urgent: int, arrivals: dict[int, list[tuple]]) -> dict:
    """Run ``arrivals`` (step: (id, prompt, max tokens, priority)) on the engine with
    ``max_urgent_preemptions`` ``urgent``, from an empty prefix cache: each request's
    tokens, the step of its first token, and the scheduler's stats for the run."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    runtime = scheduler.feather.runtime
    runtime.config = replace(runtime.config, max_urgent_preemptions=urgent)
    stats = runtime.meter.stats
    before = (stats.preemptions, stats.urgent_preemptions)
    assert llm.reset_prefix_cache()
    engine, tokens, first, step = llm.llm_engine, {}, {}, 0
    while arrivals or engine.has_unfinished_requests():
        for rid, prompt, length, priority in arrivals.pop(step, []):
            engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt),
                               SamplingParams(max_tokens=length, temperature=0.0,
                                              ignore_eos=True), priority=priority)
        for out in engine.step():
            rid = out.request_id.rsplit("-", 1)[0]
            if out.outputs[0].token_ids:
                first.setdefault(rid, step)
            if out.finished:
                assert rid not in tokens  # each finishes once
                tokens[rid] = list(out.outputs[0].token_ids)
        step += 1
        assert step < 400
    return {"tokens": tokens, "first": first,
            "preemptions": (stats.preemptions - before[0],
                            stats.urgent_preemptions - before[1])}


def prompt(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + 31 * t) % 31000 + 1 for t in range(length)]


@pytest.mark.real_engine
@pytest.mark.parametrize("lacking", ["seat", "blocks"])
def test_the_real_engine_lets_an_urgent_request_in_and_the_victim_finishes_the_same(
        engine: LLM, lacking: str) -> None:
    """vLLM's CPU engine, greedy: with its 3 seats taken by class-1 decodes, or its KV
    cache by two long ones (22 of 25 blocks, the urgent prompt needing 4), a class-0
    request gets its first token in the step it arrives (with the option at 0, after a
    decode finishes), one decode gives way, and every request's tokens are those of the
    run without preemption."""
    if lacking == "seat":
        low = [(f"low{i}", prompt(i, 40), 24, 1) for i in range(3)]
        arrivals = {0: low, 3: [("urgent", prompt(9, 40), 4, 0)]}
    else:
        low = [(f"low{i}", prompt(i, 320), 36, 1) for i in range(2)]
        arrivals = {0: low, 8: [("urgent", prompt(9, 100), 4, 0)]}
    arrival = max(arrivals)
    waiting = generate(engine, 0, dict(arrivals))
    preempting = generate(engine, 1, dict(arrivals))
    assert waiting["preemptions"] == (0, 0) and preempting["preemptions"] == (1, 1)
    assert preempting["first"]["urgent"] == arrival
    assert waiting["first"]["urgent"] > arrival + 15
    assert preempting["tokens"] == waiting["tokens"]
    assert {rid: len(t) for rid, t in preempting["tokens"].items()} == \
        {rid: length for step in arrivals.values() for rid, _, length, _ in step}
