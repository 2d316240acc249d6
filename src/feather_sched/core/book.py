"""The queue's book: every request the queue knows, WAITING (in the tree's waiting set),
RUNNING (in its running set) or HELD (known, but neither: the engine took it out of the
waiting queue without running it), and the counts that follow each move: the Chunked
Hash Tree, the fairness bound's, the starvation guard's, the share's backlog and
``TenantFifo``.  ``FeatherQueue`` decides on top of it."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Sequence, Set
from enum import Enum

from feather_sched.core.cht import CHTError, ChunkedHashTree, ChunkKey, RequestState
from feather_sched.core.entries import EntryTable
from feather_sched.core.fairness import OvertakeBound
from feather_sched.core.prefix import group_of
from feather_sched.core.starvation import StarvationGuard
from feather_sched.core.tenants import DEFAULT_TENANT, TenantFifo, TenantShare

RequestId = Hashable


class QueueState(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    HELD = "held"


class QueueBook(EntryTable):
    """The requests and their moves (``add``, ``admit``, ``requeue``, ``hold``, ``run``,
    ``remove``), each told to the tree, the bound, the guard and the share.  Costs: ``add``
    linear in the request's keys; the other moves in its keys plus the waiting requests
    whose shared depth changes (``cht``)."""

    def __init__(self, *, max_overtakes: int | None, max_stops: int | None,
                 max_wait_s: float | None, chunk_tokens: int, min_rank_chunks: int,
                 clock: Callable[[], float], share: TenantShare | None,
                 prefix_order: bool, uncached_order: bool = False) -> None:
        self.max_overtakes = max_overtakes
        self.max_stops = max_stops
        self.max_wait_s = max_wait_s
        self.chunk_tokens = chunk_tokens
        """Tokens a chunk key stands for (what the gate is told in tokens)."""
        self.min_rank_chunks = min_rank_chunks
        """The tree's ``min_rank_chunks``: ``min_passing_tokens`` in whole chunks."""
        self.clock = clock
        self.share = share
        self.prefix_order = prefix_order
        self.uncached_order = uncached_order
        """The tree keeps the fewest-uncached order too (``ChunkedHashTree.fewest_uncached``)."""
        self._running_epoch = 0
        self.clear()

    def clear(self) -> None:
        """Forget every request (the tree, the bounds' and the guard's counts, the share's
        backlog; the counters stay).  O(1) plus freeing the old structures."""
        self._running_epoch += 1
        self.tree = ChunkedHashTree(self.min_rank_chunks, by_tenant=self.share is not None,
                                    chunk_tokens=self.chunk_tokens,
                                    uncached_order=self.uncached_order)
        if self.share is not None:
            self.share.clear_backlog()
        self.fifo = None if self.prefix_order else TenantFifo()
        self.bound = None
        if self.max_overtakes is not None or self.max_stops is not None:
            self.bound = OvertakeBound(self.max_overtakes, self.max_stops)
        EntryTable.__init__(self)
        self.guard = None if self.max_wait_s is None else \
            StarvationGuard(self.max_wait_s, self.clock)

    def __len__(self) -> int:
        """Waiting requests."""
        return self.tree.num_waiting

    @property
    def num_running(self) -> int:
        return self.tree.num_running

    @property
    def running_epoch(self) -> int:
        """A number that changes whenever the running set does (admit, run, requeue or
        hold of a running request, removal of one, ``clear``) and never returns to an
        earlier value: two equal readings bracket no change, even one that raised midway
        (it moves before the tree does).  O(1)."""
        return self._running_epoch

    def state(self, request_id: RequestId) -> QueueState:
        """WAITING, RUNNING or HELD; CHTError for an unknown request."""
        if request_id not in self._requests:
            raise CHTError(f"unknown request {request_id!r}")
        if request_id not in self.tree:
            return QueueState.HELD
        waiting = self.tree.state(request_id) is RequestState.WAITING
        return QueueState.WAITING if waiting else QueueState.RUNNING

    def waiting_ids(self) -> Iterator[RequestId]:
        """Waiting request ids in arrival order."""
        return self.tree.waiting_ids()

    def running_ids(self) -> Iterator[RequestId]:
        return self.tree.running_ids()

    def has_running_group(self) -> bool:
        """Whether a prefix group runs with two or more members.  O(1)."""
        return self.tree.has_running_group()

    def group_runners(self, request_id: RequestId) -> int:
        """Running requests of the request's prefix group, itself included if it runs.
        O(1)."""
        return self.tree.group_runners(request_id)

    def rank_key(self, request_id: RequestId) -> tuple[int, int, float, int]:
        """A waiting request's place in the queue's order: (priority class, minus its
        shared depth as the tree ranks it, its tenant's counter under fair share (else
        0), arrival order).  Sorting waiting requests by it lists them as the queue would
        offer them, bounds and the share's window aside: the tree's order
        (``ChunkedHashTree.rank_key``), the least served tenant first among requests
        sharing as much.  Without ``prefix_order``: (class, 0, the counter, its place in
        its tenant's queue).  CHTError for a request not waiting (the tree holds no held
        one).  O(1)."""
        priority, depth, order = self.tree.rank_key(request_id)
        share = self.share
        served = 0.0 if share is None else share.service(self._requests[request_id].tenant)
        if self.fifo is not None:
            return priority, 0, served, self.fifo.place(request_id)
        return priority, depth, served, order

    def runs_exactly(self, request_ids: Set[RequestId]) -> bool:
        """Whether the running set is exactly ``request_ids``.  O(len(request_ids))."""
        return self.tree.runs_exactly(request_ids)

    # ---- moves -------------------------------------------------------------------------

    def add(self, request_id: RequestId, keys: Sequence[ChunkKey],
            arrival_s: float | None = None, tokens: int | None = None,
            priority: int = 0, tenant: Hashable = DEFAULT_TENANT) -> None:
        """Enqueue a new request as waiting; ``arrival_s`` defaults to now, its prompt
        ``tokens`` to its chunks' worth, its ``priority`` class to 0."""
        if request_id in self._requests:
            raise CHTError(f"request {request_id!r} is already in the queue")
        length = len(keys) * self.chunk_tokens if tokens is None else tokens
        self.tree.add(request_id, keys, priority, tenant, length)
        arrival = self.clock() if arrival_s is None else arrival_s
        self._enter(request_id, list(keys), arrival, length, priority,
                    group_of(keys, request_id), tenant)
        self._waits(request_id, True)
        if self.bound is not None:
            number = 0 if self.share is None else self.share.slot(tenant)
            self.bound.arrive(request_id, arrival, priority, number)
        self._offer_to_guard(request_id)
        self._changed()

    def admit(self, request_id: RequestId) -> None:
        """Move a waiting request into the running set."""
        self._running_epoch += 1
        self.tree.admit(request_id)
        self._waits(request_id, False)
        self._runs(request_id, True)
        if self.bound is not None:
            self.bound.admit(request_id)
        self._changed()

    def requeue(self, request_id: RequestId) -> None:
        """Send a running or held request back to waiting; its arrival time stays."""
        state = self.state(request_id)
        if state is QueueState.RUNNING:
            self._running_epoch += 1
            self.tree.requeue(request_id)
            self._runs(request_id, False)
        elif state is QueueState.HELD:
            self._enter_tree(request_id)
        else:
            raise CHTError(f"cannot requeue request {request_id!r}: it is waiting")
        self._waits(request_id, True, returning=True)
        if self.bound is not None:
            self.bound.requeue(request_id)
        self._offer_to_guard(request_id)
        self._changed()

    def hold(self, request_id: RequestId) -> None:
        """Take a waiting or running request out of the tree, remembering it."""
        state = self.state(request_id)
        if state is QueueState.HELD:
            raise CHTError(f"request {request_id!r} is already held")
        self._leave_tree(request_id, state)
        if self.bound is not None:
            self.bound.hold(request_id, was_running=state is QueueState.RUNNING)
        self._changed()

    def run(self, request_id: RequestId) -> None:
        """Put a held request straight into the running set (the engine runs it)."""
        if self.state(request_id) is not QueueState.HELD:
            raise CHTError(f"cannot run request {request_id!r}: it is not held")
        self._running_epoch += 1
        self._enter_tree(request_id)
        self.tree.admit(request_id)
        self._runs(request_id, True)
        if self.bound is not None:
            self.bound.admit(request_id)
        self._changed()

    def remove(self, request_id: RequestId) -> None:
        """Forget a request in any state (finished, aborted, rejected)."""
        state = self.state(request_id)
        if state is not QueueState.HELD:
            self._leave_tree(request_id, state)
        if self.bound is not None:
            self.bound.forget(request_id)
        del self._requests[request_id]
        self._changed()

    # ---- internals ---------------------------------------------------------------------

    def _leave_tree(self, request_id: RequestId, state: QueueState) -> None:
        """A waiting or running request leaves the tree (held or removed); the share is
        told it stopped running or waiting."""
        self._running_epoch += state is QueueState.RUNNING
        self.tree.remove(request_id)
        if state is QueueState.RUNNING:
            self._runs(request_id, False)
        else:
            self._waits(request_id, False)

    def _is_waiting(self, request_id: RequestId) -> bool:
        return request_id in self._requests and self.state(request_id) is QueueState.WAITING

    def _offer_to_guard(self, request_id: RequestId) -> None:
        if self.guard is not None:
            self.guard.offer(request_id, self._requests[request_id].age_key)

    def _enter_tree(self, request_id: RequestId) -> None:
        request = self._requests[request_id]
        self.tree.add(request_id, request.keys, request.priority, request.tenant,
                      request.tokens)

    def _waits(self, request_id: RequestId, waiting: bool, returning: bool = False) -> None:
        """Tell the share a request started (or stopped) waiting, and ``fifo``: at its
        tenant's head if it is ``returning`` (preempted or skipped).  O(1), O(log n) with
        ``fifo``."""
        if self.share is not None:
            request = self._requests[request_id]
            (self.share.wait if waiting else self.share.unwait)(request.tenant,
                                                                request.priority)
            if self.fifo is None:
                return
            if waiting:
                self.fifo.enter(request_id, request.tenant, request.priority, returning)
            else:
                self.fifo.leave(request_id)

    def _runs(self, request_id: RequestId, running: bool) -> None:
        """Tell the share a request started (or stopped) running.  O(1)."""
        if self.share is not None:
            tenant = self._requests[request_id].tenant
            (self.share.run if running else self.share.unrun)(tenant)

    def _changed(self) -> None:
        """Any move may change what the queue decides (``FeatherQueue`` forgets its
        answer)."""
