"""FeatherQueue: which waiting request to admit next, and whether to admit it at all.

The Chunked Hash Tree (``cht``) ranks waiting requests by the prefix they share with the
running set; an ADD/STOP gate answers for the candidate; bounds on waiting override both.
The requests and their moves are the queue's book (``book.QueueBook``).  Priority classes
are strict.  The candidate, in the most urgent class waiting: a ``promise``d request; a
starved one (``max_wait_s``, one a pass); the oldest at its fairness bound; while the
engine could run everything in flight (``fits_all``), the oldest (or, with
``shortest_when_all_fits``, the fewest prompt tokens left to compute); else the tree's best.
A candidate a bound names is admitted whatever the gate says; after a STOP every answer
is STOP until ``new_step``.  With fair share (``share``), all of these but the promise
pick among the tenants the share admits now: each bound acts in its tenant's turn.
Without ``prefix_order`` (VTC) the least served tenant's FIFO head goes next.  Why:
docs/fairness.md.  Costs: ``QueueBook``'s; ``decide`` is cached until the next change.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import numpy as np

from feather_sched.core.book import QueueBook, QueueState
from feather_sched.core.cht import (
    DEFAULT_CHUNK_TOKENS,
    CHTError,
    ChunkedHashTree,
)
from feather_sched.core.fairness import DEFAULT_MAX_OVERTAKES, DEFAULT_MAX_STOPS
from feather_sched.core.tenants import TenantShare, grown
from feather_sched.gates.base import BatchLayout, Decision, Gate, GateContext
from feather_sched.gates.heuristic import AlwaysAddGate

RequestId = Hashable

DEFAULT_MAX_WAIT_S = 30.0
DEFAULT_MIN_PASSING_TOKENS = 256


@dataclass(frozen=True)
class Admission:
    """The queue's answer for one candidate."""

    request_id: RequestId
    decision: Decision
    forced: bool
    """True when a waiting bound overrode the tree's order and the gate."""
    context: GateContext | None
    """What the gate was shown (None when it was not asked: forced, already stopped, or
    a gate that always adds)."""


class FeatherQueue(QueueBook):
    """A waiting queue ordered by shared prefix with the running set, gated per pass."""

    def __init__(
        self,
        gate: Gate | None = None,
        *,
        max_overtakes: int | None = DEFAULT_MAX_OVERTAKES,
        max_stops: int | None = DEFAULT_MAX_STOPS,
        max_wait_s: float | None = DEFAULT_MAX_WAIT_S,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        min_passing_tokens: int = DEFAULT_MIN_PASSING_TOKENS,
        clock: Callable[[], float] = time.monotonic,
        share: TenantShare | None = None,
        prefix_order: bool = True,
        shortest_when_all_fits: bool = False,
    ) -> None:
        """``share``: fair share between tenants (None: off, every tenant alike);
        ``prefix_order`` off (with a ``share``): VTC's order, the least served tenant's
        oldest request first (``TenantFifo``), a returning one at its tenant's head;
        ``shortest_when_all_fits``: while everything fits, the fewest uncached tokens
        first, not the oldest (``_chosen``)."""
        if not prefix_order and share is None:
            raise ValueError("an order without prefixes is a share's: give a share")
        if max_wait_s is not None and max_wait_s < 0:
            raise ValueError(f"max_wait_s must be non-negative or None, got {max_wait_s}")
        if min_passing_tokens < 0:
            raise ValueError(f"min_passing_tokens must be non-negative, got {min_passing_tokens}")
        self.gate: Gate = gate if gate is not None else AlwaysAddGate()
        self._seats: int | None = None
        self.kv_tokens: int | None = None
        """The engine's KV cache in tokens, where its adapter knows it: with ``seats``,
        what tells whether the engine could run every request in flight at once
        (``fits_all``)."""
        self.layout = BatchLayout.FEATHER
        """How the engine lays its batch out (``use_layout``); in the engine's own layout
        admission order is the batch's, and the tree's order keeps a group's members side
        by side even when everything fits."""
        super().__init__(max_overtakes=max_overtakes, max_stops=max_stops,
                         max_wait_s=max_wait_s, chunk_tokens=chunk_tokens,
                         min_rank_chunks=max(1, -(-min_passing_tokens // chunk_tokens)),
                         clock=clock, share=share, prefix_order=prefix_order,
                         uncached_order=shortest_when_all_fits)

    @property
    def seats(self) -> int | None:
        """The engine's cap on running requests, where its adapter knows it (the gate is
        told the seats left free; the share's seat shares follow it, ``refresh``)."""
        return self._seats

    @seats.setter
    def seats(self, seats: int | None) -> None:
        self._seats = seats
        if self.share is not None:
            self.share.refresh(seats)

    def use_layout(self, layout: BatchLayout) -> None:
        """The engine lays its batch out so from now on; the gate is told too. O(1)."""
        self.layout = layout
        self.gate.use_layout(layout)

    def clear(self) -> None:
        """Forget every request (``QueueBook.clear``) and this pass's answer; the gate
        keeps what it learned."""
        self._bests = _TenantBests()
        self._closed = False
        self._forced: RequestId | None = None
        """The request the starvation guard admitted in this pass."""
        self._promised: RequestId | None = None
        """The request the engine preempted running requests for in this pass."""
        self._admission: Admission | None = None
        self._asked_for: RequestId | None = None
        super().clear()

    # ---- admission ---------------------------------------------------------------------

    def due(self) -> RequestId | None:
        """The waiting request a bound puts first now (starved, or at its overtaking or
        stop bound, in the most urgent class waiting); None when the tree's order holds.
        With a ``share``, one at its overtaking or stop bound only among the tenants the
        share admits now: it takes its own tenant's turn, it does not jump the share
        (so ``max_overtakes`` or ``max_stops`` 0 is arrival order within the share's
        window, never across it).  ``OvertakeBound.due``'s cost (O(T) in C plus the
        requeued requests), plus ``TenantShare.window`` with a share."""
        best = self.tree.best()
        if best is None:
            return None
        starved = self._starved()
        if starved is not None or self.bound is None:
            return starved
        priority = self.tree.priority(best)
        if self.share is None:
            return self.bound.due(priority)
        return self.bound.due(priority, self.share.window(priority))

    def decide(self, offered: RequestId | None = None) -> Admission | None:
        """The answer for ``offered`` (default: the queue's own candidate, ``candidate``);
        None if nothing waits; CHTError if ``offered`` is not waiting.

        The gate is asked once per candidate: the answer is kept until the queue changes.
        A candidate a bound made due is admitted over the gate (``Admission.forced``).
        After a STOP every answer is STOP until ``new_step``.  O(1) when cached, else the
        gate's cost plus O(requeued requests).
        """
        if self._admission is not None and self._asked_for == offered:
            return self._admission
        if offered is not None and self.state(offered) is not QueueState.WAITING:
            raise CHTError(f"request {offered!r} is not waiting")
        if not self.tree.num_waiting:
            return None
        bounded = self.due()
        target = offered if offered is not None else self._chosen(bounded)
        self._admission = self._answer(target, forced=bounded is not None and target == bounded)
        self._asked_for = offered
        return self._admission

    def candidate(self) -> RequestId | None:
        """The request ``decide()`` would judge next, without asking the gate; None when
        nothing waits.  Within the most urgent class waiting: a starved request (one a
        pass), else the oldest at its overtaking or stop bound, else, while everything
        in flight fits (``_chosen``), the oldest waiting request if it arrived before the
        tree's best, else the tree's best."""
        if self._admission is not None and self._asked_for is None:
            return self._admission.request_id
        if not self.tree.num_waiting:
            return None
        return self._chosen(self.due())

    def promise(self, request_id: RequestId) -> RequestId:
        """The engine preempted running requests to make room for waiting ``request_id``
        on its ADD: it stays the candidate and its answer ADD (the gate not asked again,
        a STOP not applied) until it leaves the waiting set or the pass ends, so the
        requeued victims cannot turn that answer and waste their preemption.  Under a
        ``share`` the share decides who takes the freed seat (``_seat_taker``): where the
        victims' tenant fell below its seat share and the request's is not admitted
        now, the share's own pick is promised instead; the promised request is returned.
        O(1), ``_seat_taker`` under a share."""
        if self.state(request_id) is not QueueState.WAITING:
            raise CHTError(f"cannot promise request {request_id!r}: it is not waiting")
        self._promised = None
        self._changed()
        self._promised = self._seat_taker(request_id)
        return self._promised

    def _seat_taker(self, request_id: RequestId) -> RequestId:
        """Who takes the seats a preemption for ``request_id`` freed: it, unless under a
        ``share`` the preemption took a tenant below its seat share while its own tenant
        is not (no longer admitted in its class); then the share decides, the request
        ``_chosen`` picks now (the victims' tenant's, where it has one waiting there).
        O(1) without a share, else ``TenantShare.window`` and ``_chosen``."""
        share = self.share
        if share is None or share.eligible(self.tenant(request_id), self.priority(request_id)):
            return request_id
        return self._chosen(self.due())

    def new_step(self) -> None:
        """Start a scheduling pass: a STOP of the previous pass no longer holds."""
        self.gate.end_step()
        if self.share is not None:
            self.share.refresh(self.seats)
        self._closed = False
        self._forced = None
        self._promised = None
        self._admission = None

    def admit(self, request_id: RequestId) -> None:
        """Move a waiting request into the running set (``QueueBook.admit``)."""
        admission = self._admission
        super().admit(request_id)
        if admission is not None and admission.forced and admission.request_id == request_id:
            self._forced = request_id

    def hold(self, request_id: RequestId) -> None:
        """Take a waiting or running request out of the tree (``QueueBook.hold``)."""
        super().hold(request_id)
        if self._forced == request_id:
            self._forced = None  # a forced admission the engine did not run frees the slot

    def _waits(self, request_id: RequestId, waiting: bool, returning: bool = False) -> None:
        """``QueueBook._waits``; a request that stops waiting ends its ``promise``."""
        if not waiting and request_id == self._promised:
            self._promised = None
        super()._waits(request_id, waiting, returning)

    def _changed(self) -> None:
        """Any change may change the candidate; a STOP still holds for this pass."""
        self._admission = None

    # ---- internals ---------------------------------------------------------------------

    def _answer(self, request_id: RequestId, forced: bool) -> Admission:
        """The answer for waiting ``request_id``; the gate is shown what admitting it
        would do (``GateContext``) unless the answer is settled without it."""
        if request_id == self._promised:
            return Admission(request_id, Decision.ADD, forced=forced, context=None)
        if self._closed:
            return Admission(request_id, Decision.STOP, forced=False, context=None)
        if forced or self.gate.always_adds:
            return Admission(request_id, Decision.ADD, forced=forced, context=None)
        candidate = self.tree.candidate(request_id)
        request = self._requests[request_id]
        context = GateContext(
            batch_size=self.tree.num_running,
            chunk_loss=candidate.chunk_loss,
            sharing_waiters=candidate.sharing_waiters,
            num_waiting=self.tree.num_waiting,
            candidate_group=request.group,
            candidate_tokens=request.tokens,
            candidate_prefix_tokens=self.tree.held_chunks(request_id) * self.chunk_tokens,
            group_waiters=self.tree.group_waiters(request_id),
            free_seats=None if self.seats is None else max(self.seats - self.num_running, 0),
            stops_left=None if self.bound is None else self.bound.stops_left(request.priority),
        )
        decision = self.gate.decide(context)
        self._closed = decision is Decision.STOP
        if self._closed and self.bound is not None:
            self.bound.stopped()
        return Admission(request_id, decision, forced=False, context=context)

    def fits_all(self) -> bool:
        """Whether the engine could run every request in flight at once: running and
        waiting requests within its seats, the chunks they hold within its KV cache (a
        chunk held both running and waiting counted twice).  False where the adapter
        does not know both.  O(1)."""
        if self.seats is None or self.kv_tokens is None:
            return False
        return self.num_running + self.tree.num_waiting <= self.seats and \
            self.tree.chunks_held() * self.chunk_tokens <= self.kv_tokens

    def _chosen(self, due: RequestId | None) -> RequestId:
        """The candidate, while a request waits: the ``promise``d request; else the request
        a bound made ``due``; else, while the fairness bound is on (``bound``), the
        engine could run everything in flight (``fits_all``), lays its batch out in
        Feather's order (``BatchLayout.FEATHER``) and the gate does not STOP there
        (``Gate.stops_in_ordered_batches``: always-add, the model gate), the oldest
        waiting request of the most urgent class if it arrived before the tree's best
        (with ``shortest_when_all_fits``, the one with the fewest prompt tokens left to
        compute, ``ChunkedHashTree.fewest_uncached``); else the tree's best.  With a ``share``,
        "the tree's best" is the first, in ``rank_key``'s order (the least served tenant
        first among requests sharing as much), of the best of each tenant it admits now,
        and while everything fits the oldest of the least served tenant (choosing the
        tenant of the tree's best instead admitted one tenant after another); without
        ``prefix_order``, the head of the least served tenant's queue (``TenantFifo``).
        The gate still answers for it.  Why: docs/fairness.md.  O(requeued requests),
        plus ``_TenantBests.first`` with a share, O(log n) amortized while all fits."""
        if self._promised is not None:
            return self._promised
        if due is not None:
            return due
        best = self.tree.best()
        if self.fifo is not None:
            priority = self.tree.priority(best)
            return self.fifo.head(self.share.least_served(priority), priority)
        if self.share is not None:
            best = self._bests.first(self.tree, self.share, self.tree.priority(best))
        if self.bound is None or self.layout is not BatchLayout.FEATHER or \
                self.gate.stops_in_ordered_batches or not self.fits_all():
            return best
        if self.share is not None:  # everything fits: the least served tenant's oldest
            priority = self.tree.priority(best)
            tenant = self.share.least_served(priority)
            oldest = self.bound.oldest(priority, self.share.slot(tenant))
            return best if oldest is None else oldest
        if self.uncached_order:
            shortest = self.tree.fewest_uncached()
            return best if shortest is None else shortest
        oldest = self.bound.oldest(self.tree.priority(best))
        if oldest is None or not self.bound.arrived_before(oldest, best):
            return best
        return oldest

    def _starved(self) -> RequestId | None:
        """The oldest waiting request of the most urgent class waiting, if it has waited
        past the bound (one a pass).  With a share, the oldest of the tenants the share
        admits now: it takes its own tenant's turn (without the overtaking bound's
        bookkeeping, only the oldest overall, when its tenant's turn comes)."""
        guard = self.guard
        if guard is None or self._forced is not None:
            return None
        oldest = guard.first(self._is_waiting)
        if oldest is None or not guard.past(self.arrival_s(oldest)):
            return None
        if self.share is None:
            return oldest
        request = self._requests[oldest]
        window = self.share.window(request.priority)
        if self.bound is not None:
            oldest = self.bound.oldest(request.priority, tenants=window)
        elif not window[self.share.slot(request.tenant)]:
            return None
        return oldest if oldest is not None and guard.past(self.arrival_s(oldest)) else None


class _TenantBests:
    """Each tenant's best waiting request's place in the tree's order (``rank_key`` less
    the counter), by the share's slot, brought up to date from the tenants the tree
    ``touched``: so the first of the tenants in the share's window is found in O(T) in
    C, not by asking the tree for each tenant's best."""

    def __init__(self) -> None:
        self.depth = np.zeros(0, dtype=np.int64)
        """Minus the best's shared depth as ranked."""
        self.order = np.zeros(0, dtype=np.int64)
        """The best's arrival order in the tree."""

    def first(self, tree: ChunkedHashTree, share: TenantShare, priority: int) -> RequestId:
        """The first, in ``FeatherQueue.rank_key``'s order, of the best requests of the
        tenants ``share`` admits now in class ``priority`` (the most urgent waiting):
        the deepest, then the least served, then the oldest.  O(T) in C, plus O(log n)
        per tenant touched since the last call."""
        self._update(tree, share)
        slots = np.flatnonzero(share.window(priority))
        slots = slots[self.depth[slots] == self.depth[slots].min()]
        services = share.services()[slots]
        slots = slots[services == services.min()]
        slot = int(slots[np.argmin(self.order[slots])])
        best = tree.best_of(share.tenant_of(slot))
        assert best is not None
        return best

    def _update(self, tree: ChunkedHashTree, share: TenantShare) -> None:
        for tenant in tree.touched():
            slot = share.slot(tenant)
            self.depth, self.order = grown(self.depth, slot), grown(self.order, slot)
            best = tree.best_of(tenant)
            if best is not None:
                _, self.depth[slot], self.order[slot] = tree.rank_key(best)
