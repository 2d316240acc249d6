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
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from feather_sched.attention.selfcheck import Shapes, Verdict

TIMEOUT_S = 600.0
"""How long a check may take in its process (Triton compiles cold and every cell run)."""


OOM_SCORE_ADJ = 1000
"""The child's ``/proc/self/oom_score_adj``: the first process the kernel's out-of-memory
killer takes, before the engine's worker (raising one's own score needs no privilege)."""


class CheckFailed(RuntimeError):
    """The check's process gave no verdict (the message says why; ``peak_host_bytes``:
    its own peak resident memory, where it exited by itself)."""

    def __init__(self, message: str, peak_host_bytes: int | None = None) -> None:
        super().__init__(message)
        self.peak_host_bytes = peak_host_bytes


@dataclass(frozen=True)
class ChildLimits:
    """What the check's process may take of the host, set by the child on itself before
    the recipe is read: ``memory_bytes`` of private writable address space
    (``RLIMIT_DATA``: every private writable mapping, the heap and anonymous ``mmap``
    alike; not ``RLIMIT_AS``, which also counts the virtual address space the CUDA driver
    and malloc's arenas reserve without using, far beyond any plan), and
    ``OOM_SCORE_ADJ``.  An allocation past the limit fails in the child (a
    ``MemoryError`` or a CUDA error there), which gives no verdict: the path stays off."""

    memory_bytes: int | None
    oom_score_adj: int = OOM_SCORE_ADJ

    def apply(self) -> None:
        """Limit this process (the child, before any work)."""
        import resource

        Path("/proc/self/oom_score_adj").write_text(str(self.oom_score_adj))
        if self.memory_bytes is not None:
            _, hard = resource.getrlimit(resource.RLIMIT_DATA)
            limit = self.memory_bytes if hard == resource.RLIM_INFINITY else \
                min(self.memory_bytes, hard)
            resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))


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
    limits: ChildLimits = ChildLimits(None)
    """The child's memory limit (from the check's plan, ``check_memory.child_limits``) and
    out-of-memory score."""


def run_isolated(recipe: Recipe, timeout_s: float | None = None) -> Verdict:
    """The verdict ``recipe``'s check gives in a child process (see the module
    docstring), its shapes replaced by ``recipe.shapes`` and its ``peak_host_bytes`` the
    child's own peak resident memory (``resident_peak``, read by the child at its end
    and by this process while it runs); ``CheckFailed`` where the child gives none. The
    caller is never touched by what happens in the child.

    The child is a fresh interpreter (``python -m feather_sched.attention.isolation``,
    this process's ``sys.path``), not a ``multiprocessing`` child: an engine's worker
    may be a daemonic process, which may not have those. It limits itself
    (``recipe.limits``), reads the pickled recipe from a file and writes its answer to
    another; its own session, so a timeout ends it and whatever it started.
    ``timeout_s``: ``TIMEOUT_S`` where None."""
    timeout_s = TIMEOUT_S if timeout_s is None else timeout_s
    with tempfile.TemporaryDirectory(prefix="feather-check-") as folder:
        given, answer = Path(folder) / "recipe.pickle", Path(folder) / "answer.json"
        given.write_bytes(pickle.dumps(recipe))
        environment = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        limits = json.dumps(asdict(recipe.limits))
        child = subprocess.Popen([sys.executable, "-m", __name__, str(given), str(answer),
                                  limits], env=environment, stdin=subprocess.DEVNULL,
                                 start_new_session=True)
        ended = _wait(child, timeout_s)
        if ended is None:
            _end(child)
            raise CheckFailed(f"the self-check's process gave no verdict in {timeout_s:.0f} "
                              "s (killed)") from None
        code, peak = ended
        message = json.loads(answer.read_text()) if answer.exists() else None
    peak = max(peak, (message or {}).get("peak_host_bytes") or 0) or None
    if message is None or code != 0:
        raise CheckFailed(_why_no_verdict(code), peak)
    if message["kind"] != "verdict":
        raise CheckFailed(f"the self-check raised in its process: {message['payload']}", peak)
    verdict = replace(Verdict.from_json(message["payload"]), peak_host_bytes=peak)
    return verdict if recipe.shapes is None else replace(verdict, shapes=recipe.shapes)


def _wait(child: subprocess.Popen, timeout_s: float) -> tuple[int, int] | None:
    """The child's exit code and its own peak resident bytes as last read while it ran
    (``resident_peak``, every 50 ms), or None where it still runs after ``timeout_s``.
    Not ``wait4``'s ``ru_maxrss``: exec keeps the peak of the memory it replaces, which
    under ``vfork`` is this process's."""
    deadline, peak = time.monotonic() + timeout_s, 0
    while (code := child.poll()) is None:
        peak = max(peak, resident_peak(child.pid) or 0)
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)
    return code, peak


def resident_peak(pid: int | str = "self") -> int | None:
    """Process ``pid``'s peak resident bytes since its exec (``VmHWM``; None where it is
    gone or the system has no ``/proc``)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return next((int(line.split()[1]) * 1024 for line in status.splitlines()
                 if line.startswith("VmHWM:")), None)


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
    message["peak_host_bytes"] = resident_peak()
    Path(answer_path).write_text(json.dumps(message))


def resolve(path: str) -> Callable[..., Any]:
    """The function a "module:function" path names."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


if __name__ == "__main__":
    ChildLimits(**json.loads(sys.argv[3])).apply()
    child_main(*sys.argv[1:3])
