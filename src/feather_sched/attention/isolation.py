"""The self-check run where a fault cannot reach the engine: in a child process started
fresh (a new interpreter, not a fork: it shares no CUDA context, memory or lock with the
engine's worker), under a timeout.

A device fault (an illegal address) poisons the CUDA context of the process it happens
in, and a host out-of-memory kill is a SIGKILL: neither can be caught where it happens.
So the worker hands the child (a fresh interpreter, ``run_isolated``) a ``Recipe`` (how
to build the check's subject there, and the shapes the verdict is kept for), and reads
back the verdict as JSON; a child that crashes, is killed, hangs past the timeout or
raises gives ``CheckFailed`` with the reason, which ``selfcheck.checked`` turns into
"off" and the engine's log line. The child's device memory is all freed when it exits,
before the engine allocates its KV cache. Engine-agnostic: the recipe names the engine
adapter's factory.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
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
    kept for, as the engine sees them (``cached_check`` reads them)."""

    shapes: Shapes | None
    """None: the verdict keeps the shapes the child's subject has."""
    factory: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    run: str = "feather_sched.attention.selfcheck:check"
    run_kwargs: dict[str, Any] = field(default_factory=dict)
    """Passed to ``run`` after the subject (e.g. a smaller grid)."""


def run_isolated(recipe: Recipe, timeout_s: float | None = None) -> Verdict:
    """The verdict ``recipe``'s check gives in a child process (see the module
    docstring), its shapes replaced by ``recipe.shapes``; ``CheckFailed`` where the
    child gives none. The caller is never touched by what happens in the child.

    The child is a fresh interpreter (``python -m feather_sched.attention.isolation``,
    this process's ``sys.path``), not a ``multiprocessing`` child: an engine's worker
    may be a daemonic process, which may not have those. It reads the pickled recipe
    from a file and writes its answer to another; its own session, so a timeout ends it
    and whatever it started. ``timeout_s``: ``TIMEOUT_S`` where None."""
    timeout_s = TIMEOUT_S if timeout_s is None else timeout_s
    with tempfile.TemporaryDirectory(prefix="feather-check-") as folder:
        given, answer = Path(folder) / "recipe.pickle", Path(folder) / "answer.json"
        given.write_bytes(pickle.dumps(recipe))
        environment = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        child = subprocess.Popen([sys.executable, "-m", __name__, str(given), str(answer)],
                                 env=environment, stdin=subprocess.DEVNULL,
                                 start_new_session=True)
        try:
            code = child.wait(timeout_s)
        except subprocess.TimeoutExpired:
            _end(child)
            raise CheckFailed(f"the self-check's process gave no verdict in {timeout_s:.0f} "
                              "s (killed)") from None
        message = json.loads(answer.read_text()) if answer.exists() else None
    if message is None or code != 0:
        raise CheckFailed(_why_no_verdict(code))
    if message["kind"] != "verdict":
        raise CheckFailed(f"the self-check raised in its process: {message['payload']}")
    verdict = Verdict.from_json(message["payload"])
    return verdict if recipe.shapes is None else replace(verdict, shapes=recipe.shapes)


def _end(child: subprocess.Popen) -> None:
    """Kill the child's session (it and whatever it started), and reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGKILL)
    child.wait()


def _why_no_verdict(exitcode: int) -> str:
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"the self-check's process was killed by {name}"
    return f"the self-check's process exited with code {exitcode} before its verdict"


def child_main(recipe_path: str, answer_path: str) -> None:
    """The child's work: build the subject, run the check, write the verdict (or why
    not) as JSON."""
    try:
        recipe = pickle.loads(Path(recipe_path).read_bytes())
        subject = resolve(recipe.factory)(**recipe.kwargs)
        verdict = resolve(recipe.run)(subject, **recipe.run_kwargs)
        message = {"kind": "verdict", "payload": verdict.to_json()}
    except Exception as error:  # reported to the parent, which decides
        message = {"kind": "error", "payload": f"{type(error).__name__}: {error}"}
    Path(answer_path).write_text(json.dumps(message))


def resolve(path: str) -> Callable[..., Any]:
    """The function a "module:function" path names."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


if __name__ == "__main__":
    child_main(*sys.argv[1:3])
