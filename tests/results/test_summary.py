"""``recomputed_tokens``: what preemptions made the engine compute again, against an
independent count of the simulator's re-admissions, and None where a client cannot see it."""

from __future__ import annotations

import zlib
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest

from feather_sched.results.records import RequestRecord, RunResult
from feather_sched.results.summary import job_figures, recomputed_tokens, summarize
from feather_sched.sim.block_pool import BlockPool
from feather_sched.sim.engine import EngineConfig, SimEngine
from feather_sched.sim.fcfs import FcfsPolicy
from feather_sched.workloads.spec import RequestSpec, Workload

BLOCK = 4


class StubCost:
    """1 ms a step plus 0.1 ms a request."""

    def step(self, batch) -> SimpleNamespace:
        return SimpleNamespace(seconds=0.001 + 0.0001 * len(batch), hbm_bytes=1.0,
                               l2_bytes=1.0, weight_bytes=1.0)


def specs(count: int = 30) -> list[RequestSpec]:
    """Three groups sharing 16-token prefixes, 6 own tokens each (22: never whole blocks,
    so a re-prefill always computes at least 2 tokens), outputs of 10 to 38 tokens."""
    made = []
    for i in range(count):
        group = i % 3
        head = np.random.default_rng(group + 1).integers(1, 1000, 16)
        tail = np.random.default_rng(zlib.crc32(f"r{i}".encode())).integers(1000, 30000, 6)
        made.append(RequestSpec(f"r{i}", np.concatenate([head, tail]), 10 + 7 * (i % 5),
                                0.0, group, 16))
    return made


Admissions = dict[str, list[tuple[int, int]]]


def simulate(num_blocks: int, monkeypatch) -> tuple[RunResult, Admissions]:
    """A run with no chunked prefill (the budget never binds), and each request's
    admissions as the KV pool saw them: (tokens to compute, prompt tokens among them)."""
    engine = SimEngine(StubCost(), EngineConfig(
        block_tokens=BLOCK, num_blocks=num_blocks, max_num_batched_tokens=1 << 20,
        charge_scheduler_time=False, group_tokens=8))
    admissions: Admissions = defaultdict(list)
    allocate = BlockPool.allocate
    prompt = {s.request_id: s.prompt.size for s in specs()}

    def counted(pool, request_id, keys, num_tokens, *, query_tokens=None) -> bool:
        done = allocate(pool, request_id, keys, num_tokens, query_tokens=query_tokens)
        if done:
            cached = len(keys) * BLOCK
            admissions[request_id].append((query_tokens - cached,
                                           prompt[request_id] - cached))
        return done

    monkeypatch.setattr(BlockPool, "allocate", counted)
    return engine.run(Workload("test", specs()), FcfsPolicy()).run_result(), admissions


def test_a_thrashing_run_counts_every_re_prefill_with_its_outputs(monkeypatch) -> None:
    run, admissions = simulate(40, monkeypatch)
    summary = summarize(run)
    assert summary["preemptions"] > 0
    readmitted = [a for mine in admissions.values() for a in mine[1:]]
    assert len(readmitted) == summary["preemptions"]  # none mid-prefill: no chunking
    with_outputs = sum(tokens for tokens, _ in readmitted)
    prompt_only = sum(prompt for _, prompt in readmitted)
    assert with_outputs > prompt_only > 0
    assert summary["recomputed_tokens"] == with_outputs
    assert any(mine[0][0] < 22 for mine in admissions.values())  # first prefills hit cache


def test_a_run_without_preemptions_recomputes_nothing(monkeypatch) -> None:
    run, admissions = simulate(1024, monkeypatch)
    summary = summarize(run)
    assert summary["preemptions"] == 0 and summary["recomputed_tokens"] == 0
    assert all(len(mine) == 1 for mine in admissions.values())


def record(preemptions: int | None, computed: int, cached: int = 4) -> RequestRecord:
    return RequestRecord("r", 20, 0, 0.0, cached_tokens=cached, computed_tokens=computed,
                         preemptions=preemptions)


def test_per_request_figures_are_clipped_and_summed() -> None:
    # 20-token prompts with 4 cached at first: the first prefill computes 16
    assert recomputed_tokens([record(0, 16), record(1, 16 + 23), record(2, 10)]) == 23
    assert recomputed_tokens([]) == 0


def test_unobserved_where_a_preempted_requests_recompute_is_not_counted() -> None:
    client = record(1, 0)
    client.prefill_cached(4)  # a client's figure: the first prefill only
    assert not client.counts_recompute and client.computed_tokens == 16
    assert recomputed_tokens([record(0, 16), client]) is None
    never_preempted = record(0, 0)
    never_preempted.prefill_cached(4)
    assert recomputed_tokens([never_preempted]) == 0
    assert recomputed_tokens([record(None, 16)]) == 0  # counted: nothing beyond the first
    unknown = record(None, 0)
    unknown.prefill_cached(4)
    assert recomputed_tokens([unknown]) is None
    assert summarize(RunResult("server", [unknown], 1.0, preemptions=3))[
        "recomputed_tokens"] is None


def test_job_figures_time_each_job_from_first_arrival_to_last_end():
    def turn(group: int, submitted: float, first_token: float, end: float,
             ok: bool = True) -> RequestRecord:
        return RequestRecord(f"{group}-{submitted}", 10, group, submitted, [first_token],
                             end, success=ok)

    records = [turn(0, 0.0, 0.5, 1.0), turn(0, 3.0, 3.1, 4.0),
               turn(1, 1.0, 2.0, 2.5), turn(1, 4.0, 4.3, 6.0),
               turn(2, 0.0, 0.1, 0.2), turn(2, 1.0, 1.1, 1.2, ok=False)]
    figures = job_figures(records)
    assert figures["jobs"] == 3 and figures["jobs_completed"] == 2
    assert figures["mean_jct_s"] == pytest.approx(4.5)  # 4.0 and 5.0 s
    assert figures["mean_first_turn_ttft_ms"] == pytest.approx(750.0)
    assert figures["mean_later_turn_ttft_ms"] == pytest.approx(200.0)
    assert figures["turn_ttft_ms"] == pytest.approx([750.0, 200.0])
    run = RunResult("x", records, 6.0, jobs=True)
    assert summarize(run)["mean_jct_s"] == pytest.approx(4.5)
    assert "mean_jct_s" not in summarize(RunResult("x", records, 6.0))
