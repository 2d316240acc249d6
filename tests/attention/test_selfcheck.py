"""The shared-prefix attention self-check's decision, on a subject whose kernels are plain
torch: exactness first, then the break-even, the verdict's line, and its cache."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from feather_sched.attention import groups, selfcheck
from feather_sched.attention.selfcheck import Cell, Shapes, Verdict

SHAPES = Shapes(device="test CPU", q_heads=4, kv_heads=2, head_dim=16, dtype="float32",
                block_size=16, layout="vec", max_rows=64, max_context=16384,
                versions=(("torch", torch.__version__),))


class Trial:
    def __init__(self, subject: Subject, cell: Cell, seed: int) -> None:
        self.subject, self.cell = subject, cell
        generator = torch.Generator().manual_seed(seed)
        self.expected = torch.randn(cell.rows, 4, 16, generator=generator)

    def engine(self) -> torch.Tensor:
        return self.expected

    def shared(self) -> torch.Tensor:
        return self.expected + self.subject.error(self.cell)

    def reference(self) -> torch.Tensor | None:
        return self.expected.double() if self.cell.rows <= 16 else None


class Subject:
    """Kernels whose error and speed-up per cell a test sets."""

    def __init__(self, speedup, error=lambda cell: 0.0, shapes: Shapes = SHAPES,
                 idle_cost: bool = False) -> None:
        self.speedup, self.error, self.shapes = speedup, error, shapes
        self.idle_cost = idle_cost
        self.trials: list[Cell] = []

    def trial(self, cell: Cell, seed: int) -> Trial:
        self.trials.append(cell)
        return Trial(self, cell, seed)

    def seconds(self, run, reps: int) -> float:
        cell = run.__self__.cell
        return 1.0 if run.__name__ == "engine" else 1.0 / self.speedup(cell)


def test_on_from_the_shortest_prefix_from_which_every_cell_is_faster() -> None:
    verdict = selfcheck.check(Subject(lambda c: 1.5 if c.prefix >= 2048 else 0.9))
    assert verdict.on and verdict.min_shared_tokens == 2048
    assert verdict.line().startswith("on (self-check on test CPU, 4q/2kv/d16 float32")
    assert "1.50x at" in verdict.line() and "0.90x at" in verdict.line()
    assert "groups from 2048 shared tokens" in verdict.line()
    # a cell slower above a faster one moves the break-even past it
    dip = selfcheck.check(Subject(lambda c: 0.8 if c.prefix == 2048 else 1.5))
    assert dip.on and dip.min_shared_tokens == 4096


def test_each_group_size_groups_from_its_own_break_even() -> None:
    """A lone small group saves least against the path's fixed costs: where it pays only
    from a longer prefix than larger groups, each size keeps its own break-even (kept in
    the cache as measured); a larger size never waits longer than a smaller one."""
    small_late = selfcheck.check(Subject(
        lambda c: 1.5 if c.prefix >= (4096 if c.per_group == 4 else 1024) else 0.9))
    assert small_late.on and small_late.by_size == ((4, 4096), (16, 1024))
    assert small_late.min_shared_tokens == 1024
    assert "by size: 4+ rows from 4096, 16+ rows from 1024" in small_late.line()
    assert Verdict.from_json(json.loads(json.dumps(small_late.to_json()))) == small_late
    assert [small_late.groups(rows, tokens) for rows, tokens in (
        (2, 4096), (15, 2048), (16, 1024), (64, 512))] == [True, False, True, False]
    # what the tensor-parallel vote sends: each size's ask, whatever sizes a grid measured
    assert small_late.required((2, 4, 15, 16, 64)) == [4096, 4096, 4096, 1024, 1024]
    other_grid = Verdict(True, "test", 64, SHAPES, by_size=((2, 128), (3, 64)))
    assert other_grid.required(selfcheck.GRID_SIZES) == [64, 64]
    never = selfcheck.check(Subject(lambda c: 0.9 if c.per_group == 4 else 1.5))
    assert never.on and never.by_size == ((4, None), (16, 512))
    assert never.required((4, 16)) == [groups.NEVER, 512] and not never.groups(8, 8192)
    assert "4+ rows from never" in never.line()
    large_late = selfcheck.check(Subject(
        lambda c: 1.5 if c.prefix >= (2048 if c.per_group == 4 else 8192) else 0.9))
    assert large_late.by_size == ((4, 2048), (16, 2048))


def test_a_path_measured_slower_everywhere_keeps_auto_off_with_its_figures() -> None:
    verdict = selfcheck.check(Subject(lambda c: 0.7))
    assert not verdict.on and verdict.min_shared_tokens is None
    assert verdict.line().startswith("off (self-check on test CPU")
    assert "not faster than the engine's kernel" in verdict.line() and "0.70x at" in verdict.line()
    # within the timing margin counts as not faster
    assert not selfcheck.check(Subject(lambda c: 1 + selfcheck.MARGIN / 2)).on


def test_a_path_that_costs_where_nothing_groups_is_measured_there_too() -> None:
    """A GPU path launches (empty) work on every step: a subject with an idle cost is timed
    on a batch of singletons too, and is off where that step is slower by more than the
    margin, however fast it is where rows group; one without is never timed there."""
    fast = lambda c: 1.0 if c.idle else 2.0  # noqa: E731
    plain = Subject(fast)
    assert selfcheck.check(plain).on and not any(c.idle for c in plain.trials)
    costly = Subject(fast, idle_cost=True)
    verdict = selfcheck.check(costly)
    assert verdict.on and selfcheck.IDLE_CELL in costly.trials
    assert "1.00x where nothing groups" in verdict.line()
    slow = selfcheck.check(Subject(lambda c: 1 - 2 * selfcheck.IDLE_MARGIN if c.idle else 2.0,
                                   idle_cost=True))
    assert not slow.on and "on a step where nothing groups" in slow.line()
    assert "0.90x the engine's kernel" in slow.line()


def test_an_inexact_path_is_off_before_anything_is_timed() -> None:
    timed = []
    subject = Subject(lambda c: 3.0, error=lambda c: 0.1 if c.suffix == 1 else 0.0)
    subject.seconds = lambda run, reps: timed.append(run) or 1.0
    verdict = selfcheck.check(subject)
    assert not verdict.on and "not exact at 1K 1x2" in verdict.line() and timed == []
    assert selfcheck.check(Subject(lambda c: 3.0, error=lambda c: 1e-6)).on  # rounding
    nan = selfcheck.check(Subject(lambda c: 3.0, error=lambda c: float("nan")))
    assert not nan.on


def test_the_grid_is_what_the_engine_can_hold() -> None:
    small = replace(SHAPES, max_rows=16, max_context=1200)
    subject = Subject(lambda c: 2.0, shapes=small)
    verdict = selfcheck.check(subject)
    assert all(c.rows <= 16 and c.prefix + c.suffix < 1200 for c in subject.trials)
    assert verdict.on and {r.cell.prefix for r in verdict.cells if r.speedup} == {512, 1024}
    none_fit = selfcheck.check(Subject(lambda c: 2.0, shapes=replace(SHAPES, max_context=300)))
    assert not none_fit.on and "no cell of the grid fits" in none_fit.line()


def test_a_verdict_is_kept_per_device_versions_and_shapes(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("FEATHER_CACHE_DIR", str(tmp_path))
    runs = []

    def run(subject):
        runs.append(subject.shapes)
        return selfcheck.check(subject, reps=1)

    first = selfcheck.cached_check(Subject(lambda c: 2.0), run)
    again = selfcheck.cached_check(Subject(lambda c: 0.5), run)  # the same shapes: cached
    assert len(runs) == 1 and again.cached and again.on and again == first
    assert again.line().endswith("; cached)")
    other = replace(SHAPES, versions=(("torch", "0.0"),))
    assert not selfcheck.cached_check(Subject(lambda c: 0.5, shapes=other), run).on
    assert len(runs) == 2 and other.key() != SHAPES.key()


def test_a_broken_or_unwritable_cache_is_measured_again_and_never_raises(
        monkeypatch, tmp_path, caplog) -> None:
    monkeypatch.setenv("FEATHER_CACHE_DIR", str(tmp_path))
    path = tmp_path / "attention-check" / f"{SHAPES.key()}.json"
    path.parent.mkdir()
    path.write_text('{"format": "feather-attention-check", "version": 1, "on": tr')
    assert selfcheck.cached_check(Subject(lambda c: 2.0)).on
    assert Verdict.from_json(json.loads(path.read_text())).on  # rewritten whole
    with pytest.raises(ValueError, match="not a feather-attention-check"):
        Verdict.from_json({"format": "other"})
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("FEATHER_CACHE_DIR", str(blocked))
    with caplog.at_level(logging.WARNING, logger="feather_sched"):
        assert selfcheck.cached_check(Subject(lambda c: 2.0)).on
    assert "could not keep its attention self-check" in caplog.text


def test_relative_error_is_per_row_and_infinite_for_nan() -> None:
    expected = torch.ones(3, 2, 4)
    output = expected.clone()
    output[1] *= 1.1
    assert selfcheck.relative_error(output, expected) == pytest.approx(0.1)
    output[2, 0, 0] = float("nan")
    assert selfcheck.relative_error(output, expected) == float("inf")


def _vote(rank: int, store: str, on: bool, tokens: int | None, answers) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    by_size = ((4, None), (16, tokens)) if on and tokens and tokens % 1000 == 0 else ()
    verdict = None if tokens is None else Verdict(on, "test", tokens if on else None, SHAPES,
                                                  by_size=by_size)
    group = SimpleNamespace(cpu_group=dist.group.WORLD)  # an engine's TP group, as both have
    engine = SimpleNamespace(model_parallel_is_initialized=lambda: True,
                             get_tp_group=lambda: group)
    agreed = selfcheck.tp_vote(verdict, engine)
    answers.put((rank, None if agreed is None else (agreed.on, agreed.min_shared_tokens,
                                                    agreed.reason, agreed.by_size)))
    dist.destroy_process_group()


OFF = "another tensor-parallel rank found it off"


@pytest.mark.parametrize("votes, expected", [
    (((True, 512), (True, 2048)), {(True, 2048, "test", ((4, 2048), (16, 2048)))}),
    (((True, 512), (True, 1000)), {(True, 1000, "test", ((4, None), (16, 1000)))}),
    (((True, 512), (False, 0)), {(False, None, OFF, ()), (False, None, "test", ())}),
    (((True, 512), (False, None)), {(False, None, OFF, ()), None})],
    ids=["both-on", "by-size", "one-off", "one-failed"])
def test_tensor_parallel_ranks_agree_on_one_verdict(votes, expected, tmp_path) -> None:
    """Two real ranks (gloo, as the engines' host-side groups) through ``tp_vote``, where
    vLLM's and SGLang's adapters vote: on only if both are, from the longer break-even of
    each group size (a rank's one break-even stands for every size; a size either finds
    never worth grouping is never grouped); a rank whose check failed (None) votes off."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    answers = context.Queue()
    ranks = [context.Process(target=_vote, args=(rank, str(tmp_path / "store"), on, tokens,
                                                 answers))
             for rank, (on, tokens) in enumerate(votes)]
    for rank in ranks:
        rank.start()
    got = dict(answers.get(timeout=120) for _ in ranks)
    for rank in ranks:
        rank.join(30)
    assert set(got.values()) == expected


def test_before_an_engines_parallel_groups_exist_a_verdict_stands_alone() -> None:
    verdict = Verdict(True, "test", 512, SHAPES)
    engine = SimpleNamespace(model_parallel_is_initialized=lambda: False)
    assert selfcheck.tp_vote(verdict, engine) is verdict
