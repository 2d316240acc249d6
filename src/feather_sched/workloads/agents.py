"""Agent programs: many LLM turns each, with tool time between them, in a closed loop.

Turn ``t + 1`` of a program arrives its tool time after turn ``t`` ends, and its prompt is
turn ``t``'s prompt, turn ``t``'s output (the tool call) and the tool's output; turn 0 is
the program's agent type's system-and-tools block, then its task.  Every turn but the last
ends in a tool call (finish reason ``tool_calls``), the last in ``stop``.  A program is
known in full in advance; only the arrival of turns after the first depends on the run,
so the simulator's driver (``sim.programs``) releases each turn when its predecessor ends.
The distributions are stated in ``AgentShape``, its defaults shaped after published agent
statistics (their sources: docs/sessions.md, "Workload").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from feather_sched.workloads.spec import (
    ArrivalSpec,
    RequestSpec,
    Workload,
    arrival_times,
    check_positive,
    check_vocab,
    random_tokens,
)

TOOL_CALLS, STOP = "tool_calls", "stop"


@dataclass(frozen=True)
class LogNormal:
    """A log-normal by its median and ``sigma`` (of the log), clipped to ``[low, high]``."""

    median: float
    sigma: float
    low: float
    high: float

    def __post_init__(self) -> None:
        values = (self.median, self.sigma, self.low, self.high)
        if not all(math.isfinite(v) for v in values) or self.median <= 0 or self.sigma < 0 \
                or not 0 <= self.low <= self.high:
            raise ValueError(f"invalid log-normal {self}")

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.clip(rng.lognormal(math.log(self.median), self.sigma, size=n),
                       self.low, self.high)


@dataclass(frozen=True)
class AgentShape:
    """The statistics agent programs are drawn from (tokens, seconds)."""

    agent_types: int = 4
    system_tokens: LogNormal = LogNormal(3000, 0.4, 1024, 8192)
    """The system-and-tools block, one per agent type."""
    task_tokens: LogNormal = LogNormal(600, 0.6, 64, 4096)
    turns: LogNormal = LogNormal(8, 0.6, 2, 30)
    output_tokens: LogNormal = LogNormal(120, 0.7, 8, 1024)
    """Each turn's output: reasoning and the tool call."""
    tool_output_tokens: LogNormal = LogNormal(400, 1.0, 16, 4096)
    tool_s: LogNormal = LogNormal(2.0, 1.0, 0.05, 60.0)

    def __post_init__(self) -> None:
        check_positive(agent_types=self.agent_types)


@dataclass(frozen=True)
class AgentTurn:
    """One turn: its request (``arrival_s`` is the open-loop time: start plus the tool times
    before it with no LLM time; the driver sets the real one), the tool time before it,
    and how it ends."""

    spec: RequestSpec
    tool_s: float
    finish_reason: str
    output_tokens: np.ndarray = field(repr=False)
    """The ids of the tokens it generates (the next turn's prompt holds them)."""


@dataclass(frozen=True)
class AgentProgram:
    program: int
    agent_type: int
    turns: tuple[AgentTurn, ...]

    @property
    def start_s(self) -> float:
        return self.turns[0].spec.arrival_s


@dataclass
class AgentWorkload:
    """Agent programs, by start time."""

    name: str
    programs: list[AgentProgram]

    @classmethod
    def single_turns(cls, workload: Workload) -> AgentWorkload:
        """Each request of ``workload`` a program of one turn that ends in ``stop``: a
        workload without sessions, for the closed-loop driver."""
        empty = np.zeros(0, dtype=np.int32)
        return cls(workload.name, [AgentProgram(i, 0, (AgentTurn(spec, 0.0, STOP, empty),))
                                   for i, spec in enumerate(workload.requests)])

    def open_loop(self) -> Workload:
        """All turns at their open-loop times (for description and open-loop replay)."""
        return Workload(self.name, [t.spec for p in self.programs for t in p.turns])

    def describe(self) -> str:
        turns = [len(p.turns) for p in self.programs]
        last = [p.turns[-1].spec.prompt.size for p in self.programs]
        return (f"{self.name}: {len(self.programs)} programs, {sum(turns)} turns "
                f"(mean {np.mean(turns):.1f}), final context mean {np.mean(last):.0f} tokens; "
                + self.open_loop().describe())


def agent_programs(*, programs: int, arrival: ArrivalSpec | None = None,
                   shape: AgentShape | None = None, seed: int = 0,
                   vocab_size: int = 32000) -> AgentWorkload:
    """``programs`` agent programs drawn from ``shape``, starting as ``arrival`` says (None:
    all at 0), agent types round robin.  Request ids are ``p<program>-t<turn>``; ``group``
    is the program, ``shared_len`` what a turn shares with its predecessor's prompt and
    output (its system block for the first).  O(total tokens)."""
    check_positive(programs=programs)
    check_vocab(vocab_size)
    shape = shape or AgentShape()
    rng = np.random.default_rng(seed)
    systems = [random_tokens(rng, int(n), vocab_size)
               for n in shape.system_tokens.draw(rng, shape.agent_types)]
    starts = arrival_times(programs, arrival, rng)
    return AgentWorkload("agents", [
        _program(rng, p, p % shape.agent_types, systems[p % shape.agent_types], float(start),
                 shape, vocab_size)
        for p, start in enumerate(starts)])


def _program(rng: np.random.Generator, index: int, agent_type: int, system: np.ndarray,
             start_s: float, shape: AgentShape, vocab_size: int) -> AgentProgram:
    count = int(np.rint(shape.turns.draw(rng, 1)[0]))
    outputs = shape.output_tokens.draw(rng, count).round().astype(int)
    tool_outputs = shape.tool_output_tokens.draw(rng, count).round().astype(int)
    tools = shape.tool_s.draw(rng, count)
    task = random_tokens(rng, int(shape.task_tokens.draw(rng, 1)[0]), vocab_size)
    steps = [Step(random_tokens(rng, int(outputs[t]), vocab_size),
                  random_tokens(rng, int(tool_outputs[t]), vocab_size),
                  0.0 if t == 0 else float(tools[t]),
                  STOP if t == count - 1 else TOOL_CALLS) for t in range(count)]
    return chained(index, agent_type, start_s, system, task, steps)


@dataclass(frozen=True)
class Step:
    """One turn of a program as ``chained`` strings them: what the model generates, what
    follows it in the next turn's prompt (a tool's output, a user's message), the time
    before the turn (tool or user time), and how it ends."""

    output: np.ndarray
    then: np.ndarray
    before_s: float
    finish_reason: str


def chained(index: int, agent_type: int, start_s: float, system: np.ndarray,
            task: np.ndarray, steps: list[Step]) -> AgentProgram:
    """Program ``index``: turn 0's prompt ``system`` then ``task``, each next turn's its
    predecessor's prompt, output and ``then``; open-loop arrivals (start plus the times
    before).  Request ids ``p<index>-t<turn>``, ``group`` the program, ``shared_len`` what
    a turn shares with its predecessor's prompt and output (``system`` for the first).
    O(total tokens)."""
    prompt, shared, arrival = np.concatenate([system, task]), system.size, start_s
    turns = []
    for t, step in enumerate(steps):
        arrival += step.before_s
        spec = RequestSpec(f"p{index}-t{t}", prompt, step.output.size, arrival, group=index,
                           shared_len=shared)
        turns.append(AgentTurn(spec, step.before_s, step.finish_reason, step.output))
        shared = prompt.size + step.output.size
        prompt = np.concatenate([prompt, step.output, step.then])
    return AgentProgram(index, agent_type, tuple(turns))
