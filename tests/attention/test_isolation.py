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
from feather_sched.attention.isolation import CheckFailed, Recipe, resolve, run_isolated
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
