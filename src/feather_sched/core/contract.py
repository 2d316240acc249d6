"""``RuntimeContract``: the members of ``FeatherRuntime`` an engine adapter may use.

vLLM (``integrations.vllm``), SGLang (``integrations.sglang``) and the simulator's
policies (``sim``) drive Feather through these members and nothing else, each with its
contract in one docstring, the edge cases included (vLLM's ``v1/core/sched/interface.py``
is the model).  ``FeatherRuntime`` is the implementation; ``tests/core/test_contract.py``
checks that it has every member with this signature and that the adapters use no other,
and docs/architecture.md's table is generated from here (``feather_sched.docs``).

The calls of one scheduling pass, in order: ``enter_waiting`` as requests arrive or
return, ``begin_pass``, ``decide`` and ``admit`` while the engine has room, ``end_pass``,
then ``end_step`` once the step ran; ``discard`` whenever a request leaves the engine.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import Protocol

from feather_sched.core.config import FeatherConfig
from feather_sched.core.faults import FaultGuard
from feather_sched.core.queue import Admission
from feather_sched.core.urgent import Room
from feather_sched.core.view import R, RequestId
from feather_sched.gates.base import BatchLayout
from feather_sched.telemetry.stats import AdmissionCounts, StepMeter
from feather_sched.telemetry.steplog import BatchEntry


class RuntimeContract(Protocol[R]):
    """What an adapter may call on a ``FeatherRuntime`` over the engine's requests ``R``."""

    # ---- the pass ---------------------------------------------------------------------

    def enter_waiting(self, request: R) -> None:
        """The engine holds ``request`` in the waiting queue Feather orders; idempotent
        (new, preempted, skipped or resumed with a longer prompt alike)."""

    def discard(self, request_id: RequestId) -> bool:
        """The engine let go of the request (finished, aborted, rejected) in any state:
        True the first time, False for a request Feather does not know."""

    def begin_pass(self, running: Sequence[R], waiting: Iterable[R] | None = None,
                   held: Iterable[R] = ()) -> list[R]:
        """A pass starts: Feather's running set becomes the engine's (after a fault its
        picture is rebuilt from ``running``, ``waiting``, required then, and ``held``);
        returns ``running`` in Feather's order, as given with ``order_running`` off."""

    def decide(self, offered: R | None = None) -> Admission | None:
        """The admission (ADD or STOP, forced or not) for the engine's ``offered`` request
        or the queue's own candidate; None when nothing waits; cached until something
        changes."""

    def admit(self, request: R) -> None:
        """The engine admits ``request``, which must be the subject of the last ADD
        (RuntimeError otherwise); under fair share its tenant is charged its prompt."""

    def hold(self, request_id: RequestId) -> None:
        """The engine took the request out of the waiting queue without running it: no
        candidate until it returns; an admission of it in this pass is void, its charge
        refunded."""

    def end_pass(self, step: Hashable, running: Sequence[R]) -> None:
        """The pass formed ``step``: the running set is reconciled again, and the ADDs
        whose request runs, and the STOPs, are counted and bound to ``step``."""

    def end_step(self, step: Hashable, batch_size: int, seconds: float,
                 batch: Sequence[BatchEntry] | None = None) -> None:
        """Step ``step`` ran ``batch_size`` requests in ``seconds``: the gate's reward
        reaches exactly the decisions bound to it (an empty step is ignored)."""

    # ---- service under fair share -----------------------------------------------------

    @property
    def fair_share(self) -> bool:
        """Whether fair share between tenants is on (``fairness``: ``tenants`` or ``vtc``):
        only then is a request's tenant checked where it enters."""

    @property
    def counts_service(self) -> bool:
        """Whether ``served`` does anything (fair share is on, or the metrics count each
        named tenant's service): the adapter may skip the calls otherwise."""

    def served(self, request_id: RequestId, computed_tokens: int,
               generated_tokens: int) -> None:
        """A step computed ``computed_tokens`` prompt tokens (cache hits not,
        recomputation yes) and generated ``generated_tokens`` for the request: its
        tenant's service; call it before ``discard``."""

    # ---- ordering and preemption ------------------------------------------------------

    def order(self, running: Sequence[R]) -> list[R]:
        """``running`` in Feather's order, which is its preemption order (the end first);
        the engine's order under ``fairness: vtc``."""

    def batch_order(self, running: Sequence[R]) -> list[R]:
        """``order(running)`` with each prefix group gathered where its first member
        stands: how a batch is laid out."""

    def rank_waiting(self, waiting: Sequence[R]) -> list[R]:
        """The engine's waiting list in the order Feather would admit it (the candidate
        first), for an engine that walks its own list; the list is not changed."""

    def preemption_victim(self, running: Sequence[R]) -> R:
        """The running request to preempt for KV room: the end of ``order(running)``
        (an engine that preempts the end of the list ``begin_pass`` returned need not
        ask)."""

    def urgent_victims(self, running: Sequence[R], request: R, room: Room[R]) -> list[R]:
        """The fewest running requests to preempt together for waiting ``request`` of a
        more urgent class, which lacks a seat or KV room, where the engine's
        ``room.made_by(victims)`` tells whether a set makes room: the end of Feather's
        order first, each counted as an urgent victim (at most ``max_urgent_preemptions``
        times); [] when none does."""

    def promise(self, request: R) -> bool:
        """The engine preempted ``urgent_victims`` for ``request``'s ADD: that ADD holds
        until it runs or the pass ends, however the victims' return changes the queue.
        False where fair share gives the freed room to another request instead."""

    def preempted(self, request: R, *, urgent: bool = False) -> None:
        """The engine preempted ``request`` (``urgent``: for a more urgent request):
        counted in the stats; its return to waiting is ``enter_waiting``'s."""

    def passes_due(self, request: R) -> bool:
        """Whether running ``request`` by a path that bypasses Feather's queue would pass
        a waiting request a bound has made due (the adapter then runs the due one
        first)."""

    # ---- beside the pass --------------------------------------------------------------

    def reconcile(self, running: Iterable[R], waiting: Iterable[R] | None = None) -> None:
        """Make Feather's running set the engine's; given its whole ``waiting`` queue,
        enter those and discard requests in neither (an engine with paths no call
        shows)."""

    def candidate(self) -> R | None:
        """The request ``decide()`` would judge next, without asking the gate; None when
        nothing waits."""

    def request(self, request_id: RequestId) -> R:
        """The engine's request object for an id Feather knows (KeyError otherwise)."""

    def is_running(self, request_id: RequestId) -> bool:
        """Whether Feather has the request in its running set."""

    def age_key(self, request: R) -> tuple[int, float, float]:
        """The request's (class, arrival on ``clock``, order of entry) as Feather's queue
        holds it; one it does not hold counts as arriving now, after the others."""

    def now(self) -> float:
        """The time on Feather's clock, in seconds (``age_key``'s arrivals are on it)."""

    def describe_batch(self, rows: Iterable[tuple[R, int, int]]) -> list[BatchEntry]:
        """A step's batch for ``end_step``: ``rows`` of (request, context tokens, new
        tokens) described in Feather's chunks, the same in every engine."""

    def __len__(self) -> int:
        """Requests waiting in Feather's queue."""

    @property
    def wants_batches(self) -> bool:
        """Whether ``end_step`` should be given each step's batch (``describe_batch``):
        for the step log or a gate that learns from batches."""

    @property
    def layout(self) -> BatchLayout:
        """How the engine lays its batch out: ``FEATHER`` (in ``batch_order``) with
        ``order_running`` on, unless the adapter said ``engine_keeps_its_order``."""

    @property
    def batch_has_groups(self) -> bool:
        """Whether the batch's layout can matter: Feather's layout and a prefix group of
        two or more running (adapters skip ``batch_order`` otherwise)."""

    def engine_keeps_its_order(self) -> None:
        """The adapter found that batch ordering cannot act in this engine: the layout is
        ``ENGINE`` from now on (``begin_pass`` still orders the running list)."""

    # ---- its parts --------------------------------------------------------------------

    name: str
    """The scheduler's name in logs, stats and metrics."""
    config: FeatherConfig
    """The options, validated (read only)."""
    faults: FaultGuard
    """Containment: the adapter opens each pass with ``faults.open_pass``, asks
    ``faults.serves`` before each piece of Feather's serving, calls Feather's code through
    ``faults.call``/``attempt``, and passes the engine's queues to ``begin_pass`` while
    ``faults.dirty``."""
    meter: StepMeter
    """Stats, step log and saved gate state: the adapter reports each engine call to it
    (``meter.scheduled``)."""
    counts: AdmissionCounts
    """The admission decisions counted so far (read only)."""


def members() -> list[str]:
    """The contract's member names, as declared: the calls and properties, then the parts."""
    declared = [name for name, value in vars(RuntimeContract).items()
                if (callable(value) or isinstance(value, property))
                and (not name.startswith("_") or name == "__len__")]
    return declared + list(RuntimeContract.__annotations__)
