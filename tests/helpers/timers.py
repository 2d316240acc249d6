"""Stand-ins for the attention self-check's timer (``Subject.seconds``)."""

from __future__ import annotations

from collections.abc import Callable


def timed_as(faster_from: int | None) -> Callable[..., float]:
    """A ``Subject.seconds`` with the path twice as fast as the engine's kernel on cells of
    at least ``faster_from`` prefix tokens, twice as slow on the others (None: everywhere
    slower), as fast on cells where nothing groups (``Cell.idle``); what the check decides
    from is then known.  The trial's methods are named ``engine`` and ``shared``
    (``selfcheck.Trial``)."""
    def seconds(subject: object, run: Callable[[], object], reps: int) -> float:
        trial = run.__self__  # type: ignore[attr-defined]
        if trial.cell.idle:
            return 1.0
        faster = faster_from is not None and trial.cell.prefix >= faster_from
        return 1.0 if (run.__name__ == "engine") is faster else 0.5
    return seconds
