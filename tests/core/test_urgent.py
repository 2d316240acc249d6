"""Urgent preemption's core (``core.urgent``): the rule ``fewest_victims`` and the protocol
``make_room`` that vLLM's adapter and the simulator run, on fake runtimes and engines."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace

from feather_sched.core.urgent import fewest_victims, make_room
from feather_sched.gates.base import Decision
from tests.core.test_runtime import Frees


@dataclass(eq=False)
class Job:
    rid: str
    priority: int = 1


def end_first(remaining: Sequence[Job]) -> Job:
    """A stand-in for ``preemption_victim``: the end of the list."""
    return remaining[-1]


def test_the_run_is_the_shortest_that_makes_room_then_pruned_latest_first() -> None:
    old, mid, young = Job("old"), Job("mid"), Job("young")
    room = Frees(needed=5, frees={"old": 5, "mid": 1, "young": 1})
    assert fewest_victims([old, mid, young], room, end_first) == [old]
    assert room.tried == [["young"], ["young", "mid"], ["young", "mid", "old"],
                          ["young", "old"], ["old"]]
    assert fewest_victims([old, mid, young], Frees(), end_first) == [young]  # one seat


def test_no_victims_when_even_all_of_them_leave_no_room() -> None:
    room = Frees(needed=9)
    assert fewest_victims([Job("a"), Job("b")], room, end_first) == []
    assert room.tried == [["b"], ["b", "a"]]
    assert fewest_victims([], room, end_first) == []


class Runtime:
    """The calls ``make_room`` makes of a runtime, recorded; ``answer`` is its
    ``decide()``, ``victims`` its ``urgent_victims`` answer."""

    def __init__(self, candidate: Job | None, answer: Decision | None = Decision.ADD,
                 victims: Sequence[Job] = (), waiting: int = 1) -> None:
        self._candidate, self.waiting = candidate, waiting
        self.answer, self.victims = answer, list(victims)
        self.calls: list[str] = []

    def __len__(self) -> int:
        return self.waiting

    def candidate(self) -> Job | None:
        self.calls.append("candidate")
        return self._candidate

    def decide(self, offered: Job | None = None) -> SimpleNamespace | None:
        self.calls.append("decide")
        if self.answer is None:
            return None
        return SimpleNamespace(decision=self.answer, request_id=self._candidate.rid)

    def urgent_victims(self, running: Sequence[Job], request: Job, room) -> list[Job]:
        self.calls.append("urgent_victims")
        return self.victims

    def promise(self, request: Job) -> None:
        self.calls.append(f"promise {request.rid}")


class Engine:
    """An engine for ``make_room``: its room has ``free`` seats (``made_by``: a victim
    frees one), ``skips`` the requests it would not admit; it records its preemptions."""

    def __init__(self, free: int = 0, skips: tuple[str, ...] = ()) -> None:
        self.free, self.skips = free, skips
        self.rooms: list[str] = []
        self.preempted: list[str] = []

    @staticmethod
    def priority(request: Job) -> int:
        return request.priority

    @staticmethod
    def request_id(request: Job) -> str:
        return request.rid

    def room(self, request: Job):
        self.rooms.append(request.rid)
        if request.rid in self.skips:
            return None
        return SimpleNamespace(made_by=lambda victims: self.free + len(victims) >= 1)

    def preempt(self, victim: Job) -> None:
        self.preempted.append(victim.rid)


RUNNING = [Job("low-old"), Job("low-new")]
URGENT = Job("urgent", priority=0)


def test_victims_are_preempted_then_the_add_promised() -> None:
    runtime, engine = Runtime(URGENT, victims=[RUNNING[1]]), Engine()
    assert make_room(runtime, RUNNING, engine) is URGENT
    assert runtime.calls == ["candidate", "decide", "urgent_victims", "promise urgent"]
    assert engine.rooms == ["urgent"] and engine.preempted == ["low-new"]


def test_room_already_there_is_found_without_asking_the_gate() -> None:
    runtime, engine = Runtime(URGENT), Engine(free=1)
    assert make_room(runtime, RUNNING, engine) is URGENT
    assert runtime.calls == ["candidate"] and engine.preempted == []


def test_nothing_happens_where_urgency_may_not_act() -> None:
    cases = [  # (runtime, engine, running): each leaves everything as it was
        (Runtime(URGENT), Engine(), []),  # nothing runs
        (Runtime(URGENT, waiting=0), Engine(), RUNNING),  # nothing waits
        (Runtime(None), Engine(), RUNNING),  # no candidate
        (Runtime(Job("same", priority=1)), Engine(), RUNNING),  # not more urgent
        (Runtime(URGENT), Engine(skips=("urgent",)), RUNNING),  # the engine would skip it
        (Runtime(URGENT, answer=Decision.STOP), Engine(), RUNNING),  # not the runtime's ADD
        (Runtime(URGENT, answer=None), Engine(), RUNNING),
        (Runtime(URGENT, victims=[]), Engine(), RUNNING),  # no set makes room
    ]
    for runtime, engine, running in cases:
        assert make_room(runtime, running, engine) is None
        assert engine.preempted == [] and not any(
            call.startswith("promise") for call in runtime.calls)


def test_call_runs_the_runtimes_calls_alone() -> None:
    """The simulator times each policy call through ``call``: the engine's room and
    preemption, its own work, never pass through it."""
    runtime, engine = Runtime(URGENT, victims=[RUNNING[0]]), Engine()
    through: list[str] = []

    def call(action, *args):
        through.append(action.__name__)
        return action(*args)

    assert make_room(runtime, RUNNING, engine, call) is URGENT
    assert through == ["candidate", "decide", "urgent_victims", "promise"]
    assert engine.rooms == ["urgent"] and engine.preempted == ["low-old"]
