"""Feather's files under vLLM data parallelism: each rank's scheduler writes its own.

vLLM 0.32.0's real scheduler classes, driven as ``test_vllm_scheduler.Harness`` drives
them, built from the ``VllmConfig`` of ``--data-parallel-size 2`` as vLLM's engine core
makes it for each rank (``EngineCoreProc.run_engine_core``): a dense model's ranks run as
independent engines (``data_parallel_size`` 1, the rank kept in ``data_parallel_index``),
a MoE model's keep ``data_parallel_rank``.  This CPU build runs one engine core in
process, so the two ranks' schedulers are built side by side here, both alive at once.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed")

from typer.testing import CliRunner
from vllm.engine.arg_utils import EngineArgs

from feather_sched.cli import app
from feather_sched.gates.bandit import UCBBanditGate
from feather_sched.gates.base import Decision, GateContext
from feather_sched.telemetry.stats import SchedulerStats
from feather_sched.telemetry.steplog import read_steps
from tests.integrations.vllm.test_scheduler import Harness

FILES = {"state_file": "bandit.json", "stats_file": "stats.json", "step_log": "steps.csv"}


@pytest.fixture(autouse=True)
def _no_multiprocessing(monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


@contextmanager
def engine_core_of_rank(dp_rank: int, moe: bool) -> Iterator[None]:
    """Engine configs made as vLLM's ``run_engine_core`` makes rank ``dp_rank``'s."""
    create = EngineArgs.create_engine_config

    def create_for_rank(self, *args, **kwargs):
        config = create(self, *args, **kwargs)
        parallel = config.parallel_config
        parallel.data_parallel_rank_local = dp_rank
        parallel.data_parallel_index = dp_rank
        if moe:
            parallel.data_parallel_rank = dp_rank
        else:
            parallel.reconfigure_for_independent_dp_rank()
        return config

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(EngineArgs, "create_engine_config", create_for_rank)
        yield


def rank(dp_rank: int, directory: Path, moe: bool = False, **names: str) -> Harness:
    """The Feather scheduler of data-parallel rank ``dp_rank`` of 2 (bandit gate), its
    file options the ``names`` (default ``FILES``) in ``directory``."""
    files = {option: str(directory / name) for option, name in (names or FILES).items()}
    with engine_core_of_rank(dp_rank, moe):
        return Harness(data_parallel_size=2, feather={"gate": "bandit", **files})


def serve(harness: Harness, requests: int) -> None:
    """``requests`` requests of two prefix groups, run to the end; then shut down."""
    harness.add(*(harness.request(f"r{i}", group=i % 2, max_tokens=6) for i in range(requests)))
    harness.drain()
    harness.scheduler.shutdown()


def pretrained(path: Path, decisions: int) -> None:
    """A bandit table with ``decisions`` rewarded decisions (as ``feather pretrain``'s)."""
    gate = UCBBanditGate()
    context = GateContext(batch_size=5, chunk_loss=2, sharing_waiters=0, num_waiting=3)
    gate.reward([(context, Decision.STOP)] * decisions, batch_size=5, seconds=0.5)
    gate.save(path)


@pytest.mark.parametrize("moe", [False, True])
def test_each_rank_resolves_its_own_files(tmp_path, moe: bool, caplog) -> None:
    with caplog.at_level("INFO", logger="feather_sched"):
        configs = [rank(r, tmp_path, moe).scheduler.feather.config for r in (0, 1)]
    for r, config in enumerate(configs):
        assert (config.placement.rank, config.placement.ranks) == (r, 2)
        assert (config.state_file, config.stats_file, config.step_log) == tuple(
            str(tmp_path / name.replace(".", f".rank{r}.")) for name in FILES.values())
        assert f"scheduler rank {r} of 2 writes state_file {config.state_file}" in caplog.text


def test_two_ranks_write_their_own_files_and_calibrate_fits_them_merged(tmp_path) -> None:
    ranks = [rank(r, tmp_path) for r in (0, 1)]  # both alive, each log open
    requests = (4, 6)
    for harness, count in zip(ranks, requests, strict=True):
        serve(harness, count)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "bandit.rank0.json", "bandit.rank1.json", "stats.rank0.json", "stats.rank1.json",
        "steps.rank0.csv", "steps.rank1.csv"]
    logged = 0
    for r, count in enumerate(requests):
        stats = SchedulerStats.read(tmp_path / f"stats.rank{r}.json")
        steps = read_steps(tmp_path / f"steps.rank{r}.csv")
        assert stats.requests_entered == count and stats.steps == len(steps) > 0
        assert {len(batch) for batch, _ in steps} <= set(range(1, count + 1))
        logged += len(steps)
    result = CliRunner().invoke(app, ["calibrate", str(tmp_path), "--hardware", "h100-sxm",
                                      "--model", "tiny-llama", "--out",
                                      str(tmp_path / "cpu.json")])
    assert result.exit_code == 0, result.output
    assert f"fitted {logged} steps of 2 log(s)" in result.output


def test_every_rank_warm_starts_from_the_shared_table_then_from_its_own(tmp_path,
                                                                        caplog) -> None:
    shared = tmp_path / "bandit.json"
    pretrained(shared, 3)
    table = shared.read_bytes()
    with caplog.at_level("INFO", logger="feather_sched"):
        first = [rank(r, tmp_path, state_file="bandit.json") for r in (0, 1)]
    for r, harness in enumerate(first):
        assert harness.runtime.queue.gate.learned_decisions == 3
        assert f"bandit table loaded from {shared} (3 learned decisions); saved to " \
               f"{tmp_path / f'bandit.rank{r}.json'}" in caplog.text
        serve(harness, 8)
    assert shared.read_bytes() == table  # read by every rank, written by none
    caplog.clear()
    with caplog.at_level("INFO", logger="feather_sched"):
        restarted = [rank(r, tmp_path, state_file="bandit.json") for r in (0, 1)]
    for r, (before, after) in enumerate(zip(first, restarted, strict=True)):
        own = tmp_path / f"bandit.rank{r}.json"
        learned = before.runtime.queue.gate.learned_decisions
        assert learned > 3 and json.loads(own.read_text())["table"]
        assert after.runtime.queue.gate.table == before.runtime.queue.gate.table
        assert f"bandit table loaded from {own} ({learned} learned decisions)\n" in caplog.text
