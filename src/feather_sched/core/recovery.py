"""``Recovery``: Feather's picture emptied after a fault, and rebuilt from the engine's.

A fault may leave the queue half-updated, where a call could raise again; ``drop`` (the
``FaultGuard``'s ``reset``) empties the picture, which answers every call an adapter makes
until the rebuild, so a fault counts once.  ``resync`` rebuilds it from the engine's own
queues, each request keeping its arrival and preemption counts (``Record.unsettled``).
The tenants' counters and the gate keep what they had throughout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Generic

from feather_sched.core.ledger import PassLedger
from feather_sched.core.order import Order
from feather_sched.core.queue import FeatherQueue, QueueState
from feather_sched.core.record import Record, Tracked
from feather_sched.core.view import R, RequestView


class Recovery(Generic[R]):
    """Empties (``drop``) and rebuilds (``resync``) the picture of one runtime: its
    queue, ``Record``, ``Order`` and ``PassLedger``; ``count_states`` brings the stats'
    waiting and running counts up to date."""

    def __init__(self, view: RequestView[R], clock: Callable[[], float], queue: FeatherQueue,
                 record: Record[R], order: Order[R], ledger: PassLedger,
                 count_states: Callable[[], object]) -> None:
        self.view, self.clock, self.queue = view, clock, queue
        self.record, self.order, self.ledger = record, order, ledger
        self.count_states = count_states

    def resync(self, running: Sequence[R], waiting: Iterable[R],
               held: Iterable[R] = ()) -> list[Tracked[R]]:
        """The queue cleared and refilled with ``running``, ``waiting`` and ``held``, in
        arrival order (``FeatherRuntime.resync``); returns the requests Feather knew that
        are in none, to be counted out.  A fault midway leaves the picture empty
        (``drop``) and propagates.  O(their keys + n log n)."""
        view, record = self.view, self.record
        known = {**record.unsettled, **record.tracked}
        record.tracked, record.unsettled = {}, known
        now = self.clock()

        def arrival(request: R) -> float:
            old = known.get(view.request_id(request))
            if old is not None and old.prompt_tokens == view.prompt_tokens(request):
                return old.arrival_s
            given = view.arrival_s(request)
            return now if given is None else given

        try:
            self.clear()
            entries = [(state, arrival(request), request)
                       for state, requests in ((QueueState.RUNNING, running),
                                               (QueueState.WAITING, waiting),
                                               (QueueState.HELD, held))
                       for request in requests]
            entries.sort(key=lambda entry: (entry[0] is not QueueState.RUNNING, entry[1]))
            for state, arrival_s, request in entries:
                old = known.get(view.request_id(request))
                request_id = record.track(request, arrival_s, old)
                if state is QueueState.RUNNING:
                    self.queue.admit(request_id)
                elif state is QueueState.HELD:
                    self.queue.hold(request_id)
        except Exception:
            self.drop()  # those it did not see again count out when a rebuild completes
            raise
        record.unsettled = {}
        self.count_states()
        return [old for r, old in known.items() if r not in record.tracked]

    def drop(self) -> None:
        """Empty the picture after a fault (``FeatherRuntime.drop``).  O(tracked)."""
        self.record.unsettle()
        self.clear()
        self.count_states()

    def clear(self) -> None:
        """The queue, this pass's answers and the running list's mirror, forgotten."""
        self.ledger.taken.clear()
        self.order.clear()
        self.queue.clear()
