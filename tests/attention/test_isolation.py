"""The self-check in its own process: a check that crashes, is killed, hangs or raises
leaves the caller alive and the verdict off with its reason; one that finishes hands its
verdict back, kept for the caller's shapes. The faults strike in a fake subject's factory
and, where SGLang is installed, after SGLang's Triton subject was built in the child from
its recipe (``integrations.sglang.attention_check.triton_recipe``)."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import replace

import pytest

from feather_sched.attention import selfcheck
from feather_sched.attention.isolation import (
    CheckFailed,
    ChildLimits,
    Recipe,
    resolve,
    run_isolated,
)
from feather_sched.attention.selfcheck import Cell, Shapes
from tests.helpers.selfcheck_fakes import ExactTrial

SHAPES = Shapes(device="test CPU", q_heads=4, kv_heads=2, head_dim=16, dtype="float32",
                block_size=16, layout="vec", max_rows=64, max_context=16384)
HERE = __name__


class FasterSubject:
    """Exact, and twice as fast everywhere."""

    shapes, idle_cost = SHAPES, False

    def trial(self, cell: Cell, seed: int) -> ExactTrial:
        return ExactTrial(cell)

    def seconds(self, run, reps: int) -> float:
        return 2.0 if run.__name__ == "engine" else 1.0


def faster() -> FasterSubject:
    return FasterSubject()


def crashes() -> None:
    os.abort()  # SIGABRT, as a device fault's abort would end the process


def killed() -> None:
    os.kill(os.getpid(), signal.SIGKILL)  # what a host out-of-memory kill sends


def exits() -> None:
    os._exit(3)


def hangs() -> None:
    time.sleep(600)


def raises() -> None:
    raise MemoryError("CUDA out of memory")


def after(fault: str, factory: str, kwargs: dict) -> None:
    """A recipe's real subject built, then ``fault``."""
    resolve(factory)(**kwargs)
    globals()[fault]()


def recipe(factory: str, engine: str = "fake") -> Recipe:
    """A recipe whose child ends in ``factory``: the fake subject's, or after SGLang's
    Triton subject was built in the child (``engine`` "sglang")."""
    if engine == "fake":
        return Recipe(SHAPES, f"{HERE}:{factory}")
    from feather_sched.bench.cht.sglang_policy import sglang_installed

    if not sglang_installed():
        pytest.skip("SGLang is not installed (scripts/setup.sh --sglang)")
    from feather_sched.integrations.sglang.attention_check import TritonShapes, triton_recipe

    real = triton_recipe(TritonShapes(4, 2, 16, "float16", 16, 2, 64, 4096, "cpu"), ())
    return replace(real, factory=f"{HERE}:after",
                   kwargs={"fault": factory, "factory": real.factory, "kwargs": real.kwargs})


def test_a_finished_check_hands_back_its_verdict_for_the_callers_shapes() -> None:
    verdict = run_isolated(Recipe(SHAPES, f"{HERE}:faster"), timeout_s=120)
    assert verdict.on and verdict.shapes == SHAPES and verdict.min_shared_tokens == 512
    assert all(c.speedup == 2.0 for c in verdict.cells if c.speedup is not None)


@pytest.mark.parametrize("factory, reason, engine", [
    ("crashes", "killed by SIGABRT", "fake"), ("killed", "killed by SIGKILL", "fake"),
    ("exits", "exited with code 3 before its verdict", "fake"),
    ("raises", "raised in its process: MemoryError: CUDA out of memory", "fake"),
    # how a death is seen is run_isolated's, whatever the subject: once after SGLang's
    # real subject (its imports, pools and kernels) was built in the child
    ("crashes", "killed by SIGABRT", "sglang")])
def test_a_check_that_dies_or_raises_leaves_the_caller_up_and_the_verdict_off(
        factory, reason, engine) -> None:
    started = time.monotonic()
    verdict, why = selfcheck.checked(lambda: run_isolated(recipe(factory, engine),
                                                          timeout_s=120))
    assert verdict is None and why.startswith("off: the self-check could not run (")
    assert reason in why, why
    assert time.monotonic() - started < 100  # a death is seen at once, not at the timeout


def test_a_hung_check_is_killed_at_its_timeout() -> None:
    """The timeout is ``run_isolated``'s, whatever the subject (the deaths above are also
    seen after SGLang's subject was built in the child)."""
    started = time.monotonic()
    verdict, why = selfcheck.checked(lambda: run_isolated(recipe("hangs"), timeout_s=3))
    assert verdict is None and "gave no verdict in 3 s (killed)" in why, why
    assert time.monotonic() - started < 40


def test_a_failed_check_is_not_run_again_in_the_process(monkeypatch, tmp_path) -> None:
    """An engine that builds its builders twice (vLLM's MRV2) pays for a failed or hung
    check once: the second asks get the first failure."""
    monkeypatch.setenv("FEATHER_CACHE_DIR", str(tmp_path))
    runs = []

    def run(subject):
        runs.append(subject)
        raise CheckFailed("the self-check's process was killed by SIGKILL")

    for _ in range(2):
        verdict, why = selfcheck.checked(lambda: selfcheck.cached_check(recipe("x"), run))
        assert verdict is None and "SIGKILL" in why
    assert len(runs) == 1


def grows(megabytes: int) -> FasterSubject:
    """Holds ``megabytes`` of private memory, touched, then is a subject."""
    global _held
    _held = bytearray(megabytes << 20)
    return FasterSubject()


def oom_score() -> FasterSubject:
    """Reports its own out-of-memory score adjustment through the verdict's reason."""
    return ScoredSubject(int(open("/proc/self/oom_score_adj").read()))


class ScoredSubject(FasterSubject):
    def __init__(self, score: int) -> None:
        self.shapes = replace(SHAPES, layout=f"oom_score_adj {score}")


def test_the_child_is_the_oom_killers_first_and_limited_to_its_plan() -> None:
    limits = ChildLimits(None)
    verdict = run_isolated(Recipe(None, f"{HERE}:oom_score", limits=limits), timeout_s=120)
    assert verdict.shapes.layout == "oom_score_adj 1000" and limits.oom_score_adj == 1000
    bounded = ChildLimits(1 << 30)  # far above the interpreter, far below 2 GiB
    assert run_isolated(Recipe(SHAPES, f"{HERE}:grows", {"megabytes": 64}, limits=bounded),
                        timeout_s=120).on
    with pytest.raises(CheckFailed, match="MemoryError"):
        run_isolated(Recipe(SHAPES, f"{HERE}:grows", {"megabytes": 2048}, limits=bounded),
                     timeout_s=120)


def test_each_childs_own_peak_is_recorded_not_the_largest_so_far() -> None:
    big = run_isolated(Recipe(SHAPES, f"{HERE}:grows", {"megabytes": 512}), timeout_s=120)
    small = run_isolated(Recipe(SHAPES, f"{HERE}:grows", {"megabytes": 8}), timeout_s=120)
    assert big.peak_host_bytes > (512 << 20) > small.peak_host_bytes
    assert small.peak_host_bytes > (8 << 20)
    with pytest.raises(CheckFailed) as failed:
        run_isolated(Recipe(SHAPES, f"{HERE}:raises"), timeout_s=120)
    assert 0 < failed.value.peak_host_bytes < (512 << 20)
