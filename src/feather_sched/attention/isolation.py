"""The self-check run where a fault cannot reach the engine: in a child process started
fresh (``spawn``: a new interpreter sharing no CUDA context, memory or lock with the
engine's worker), under a timeout.

A device fault (an illegal address) poisons the CUDA context of the process it happens
in, and a host out-of-memory kill is a SIGKILL: neither can be caught where it happens.
So the worker hands the child a ``Recipe`` (how to build the check's subject there, and
the shapes the verdict is kept for), and reads back the verdict as JSON; a child that
crashes, is killed, hangs past the timeout or raises gives ``CheckFailed`` with the
reason, which ``selfcheck.checked`` turns into "off" and the engine's log line. The
child's device memory is all freed when it exits, before the engine allocates its KV
cache. Engine-agnostic: the recipe names the engine adapter's factory.
"""

from __future__ import annotations

import importlib
import multiprocessing
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from feather_sched.attention.selfcheck import Shapes, Verdict

TIMEOUT_S = 600.0
"""How long a check may take in its process (Triton compiles cold and every cell run)."""


class CheckFailed(RuntimeError):
    """The check's process gave no verdict (the message says why)."""


@dataclass(frozen=True)
class Recipe:
    """How the child builds the check: ``factory`` ("module:function", called with
    ``kwargs``, all picklable) returns the ``selfcheck.Subject``; ``run`` ("module:
    function") measures it (default ``selfcheck.check``). ``shapes``: what the verdict is
    kept for, as the engine sees them."""

    shapes: Shapes
    factory: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    run: str = "feather_sched.attention.selfcheck:check"


def run_isolated(recipe: Recipe, timeout_s: float = TIMEOUT_S) -> Verdict:
    """The verdict ``recipe``'s check gives in a child process (see the module
    docstring), its shapes replaced by ``recipe.shapes``; ``CheckFailed`` where the
    child gives none. The caller is never touched by what happens in the child."""
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_child, args=(recipe, sender), daemon=True,
                              name="feather-attention-check")
    process.start()
    sender.close()  # the child holds the only writer: its death ends the pipe
    started = time.monotonic()
    message = None
    try:
        if receiver.poll(timeout_s):
            message = receiver.recv()
    except (EOFError, OSError):
        message = None
    finally:
        receiver.close()
    timed_out = message is None and time.monotonic() - started >= timeout_s
    _reap(process)
    if message is None:
        raise CheckFailed(_why_no_verdict(process.exitcode, timed_out, timeout_s))
    kind, payload = message
    if kind != "verdict":
        raise CheckFailed(f"the self-check raised in its process: {payload}")
    verdict = Verdict.from_json(payload)
    return replace(verdict, shapes=recipe.shapes)


def _reap(process: multiprocessing.process.BaseProcess) -> None:
    """End the child: give it a moment to exit, then kill it."""
    process.join(5)
    if process.is_alive():
        process.kill()
        process.join()


def _why_no_verdict(exitcode: int | None, timed_out: bool, timeout_s: float) -> str:
    if timed_out:
        return f"the self-check's process gave no verdict in {timeout_s:.0f} s (killed)"
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"the self-check's process was killed by {name}"
    return f"the self-check's process exited with code {exitcode} before its verdict"


def _child(recipe: Recipe, sender: Any) -> None:
    """The child's work: build the subject, run the check, send the verdict (or why not)."""
    try:
        subject = resolve(recipe.factory)(**recipe.kwargs)
        verdict = resolve(recipe.run)(subject)
        sender.send(("verdict", verdict.to_json()))
    except Exception as error:  # reported to the parent, which decides
        sender.send(("error", f"{type(error).__name__}: {error}"))
    finally:
        sender.close()


def resolve(path: str) -> Callable[..., Any]:
    """The function a "module:function" path names."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)
