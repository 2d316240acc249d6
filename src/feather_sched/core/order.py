"""``Order``: Feather's order of the engine's lists, the running list's and the waiting one's.

The running order (``order``) is also the preemption order, the end first: by priority
class (under fair share, then by tenant, the most served last), each prefix group
contiguous, groups by their oldest member's arrival, members by arrival, a member at
``max_preemptions`` first of its group (``spent``).  ``Mirror`` keeps the engine's running
list as Feather last reconciled or ordered it, kept in step by Feather's own calls, so a
pass over an unchanged list is O(running) in C.  The waiting order (``rank_waiting``) is
the queue's.  Reads the queue and the ``Record``; changes neither.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from operator import is_, itemgetter
from typing import Generic

from feather_sched.core.config import FeatherConfig
from feather_sched.core.prefix import gather_groups, group_of, order_by_group
from feather_sched.core.queue import FeatherQueue, QueueState
from feather_sched.core.record import Record
from feather_sched.core.view import R, RequestId, RequestView


@dataclass
class Mirror(Generic[R]):
    """The engine's running list as Feather last reconciled it, kept in step by Feather's
    own calls: an admission appends (as vLLM, SGLang and the simulator append to their
    lists), an exit removes.  While ``epoch`` is the queue's running epoch, the queue's
    running set is exactly ``ids``; an engine list holding the very objects of
    ``requests``, in order, needs no reconciling."""

    requests: list[R]
    ids: list[RequestId]
    epoch: int
    ordered: bool
    """Whether ``requests`` is in Feather's order (``Order.order``)."""


class Order(Generic[R]):
    """Feather's running and waiting orders over one queue (module docstring)."""

    def __init__(self, config: FeatherConfig, view: RequestView[R], queue: FeatherQueue,
                 record: Record[R], clock: Callable[[], float]) -> None:
        self.config, self.view, self.queue, self.record, self.clock = \
            config, view, queue, record, clock
        self.mirror: Mirror[R] | None = None
        """The engine's running list as last reconciled (``Mirror``)."""
        self.places: dict[Hashable, int] | None = None
        """Under fair share with ``order_running``, each tenant's place in the running
        order as the pass began (``TenantShare.ranking``: the most served last)."""
        self.spent: set[RequestId] = set()
        """Requests preempted ``max_preemptions`` times: last of their group to go
        (``_spent_first``)."""

    # ---- the running order --------------------------------------------------------------

    def for_pass(self, running: Sequence[R], ids: list[RequestId]) -> list[R]:
        """``running`` (reconciled, its ids ``ids``) as a pass begins: in ``order``'s order
        with ``order_running`` (the mirror's list as is while it is ordered and the
        tenants' places held), else as given."""
        mirror = self.mirror
        if not self.config.order_running or self.config.is_vtc:
            return list(running)
        share = self.queue.share
        places = None if share is None else share.ranking()
        if mirror.ordered and places == self.places:
            return list(running)
        self.places = places
        ranked = self._ranking(running, ids, gathered=False)
        mirror.requests = list(map(running.__getitem__, ranked))
        mirror.ids = list(map(ids.__getitem__, ranked))
        mirror.ordered = True
        return list(mirror.requests)

    def order(self, running: Sequence[R], *, gathered: bool = False) -> list[R]:
        """``running`` in Feather's order (``FeatherRuntime.order``), with each prefix
        group gathered where its first member stands where ``gathered``
        (``FeatherRuntime.batch_order``).  O(n log n)."""
        ids = list(map(self.view.request_id, running))
        return list(map(running.__getitem__, self._ranking(running, ids, gathered=gathered)))

    def _ranking(self, running: Sequence[R], ids: list[RequestId], *,
                 gathered: bool) -> Sequence[int]:
        """The indices of ``running`` in ``order``'s order: sorted by ``_order_keys``,
        each group contiguous within its block (its class, and tenant under fair share),
        and with ``gathered`` each group gathered across blocks."""
        if self.config.is_vtc:
            return range(len(running))
        queue = self.queue
        keys = self._order_keys(running, ids)
        if not self.config.order_running or (
                not queue.has_running_group() and len(running) == queue.num_running):
            return sorted(range(len(running)), key=keys.__getitem__)
        try:
            groups = queue.groups(ids)
        except KeyError:
            groups = [self.group(request) for request in running]
        block = itemgetter(0) if self.places is None else itemgetter(0, 1)
        blocks = list(map(block, keys))
        one_block = len(set(blocks)) == 1
        runs = groups if one_block else list(zip(blocks, groups, strict=True))
        ranked = self._spent_first(order_by_group(range(len(running)), runs, keys), ids, runs)
        if gathered and not one_block:
            ranked = gather_groups(ranked, [groups[i] for i in ranked])
        return ranked

    def _order_keys(self, running: Sequence[R], ids: list[RequestId]) -> list[tuple]:
        """What ``order`` sorts ``running`` (whose ids are ``ids``) by: the ``age_key``s,
        under fair share with each tenant's place (``places``) after the class.  O(n),
        in C without fair share."""
        queue = self.queue
        try:
            ages = queue.age_keys(ids)
        except KeyError:  # a request the queue never saw
            ages = [self.age_key(request) for request in running]
        if self.places is None:
            return ages
        tenants = [queue.tenant(i) if i in queue else self.record.tenant_of(r)
                   for i, r in zip(ids, running, strict=True)]
        return list(map(self._placed, ages, tenants))

    def _order_key(self, request_id: RequestId) -> tuple:
        """``_order_keys`` of one request the queue knows.  O(1)."""
        queue = self.queue
        age = queue.age_key(request_id)
        return age if self.places is None else self._placed(age, queue.tenant(request_id))

    def _placed(self, age: tuple, tenant: Hashable) -> tuple:
        """``age`` (an ``age_key``) with the tenant's place in ``places`` after the class
        (a tenant the ranking did not see last).  O(1)."""
        places = self.places
        return (age[0], places.get(tenant, len(places)), *age[1:])

    def _spent_first(self, ranked: list[int], ids: list[RequestId],
                     groups: Sequence[Hashable]) -> list[int]:
        """``ranked`` (indices into ``ids``, each group contiguous) with, inside each
        group, its members at ``max_preemptions`` moved to the front, so that the
        group's other members are preempted before them.  O(n log n); ``ranked`` as is
        while none is at the bound."""
        spent = self.spent
        if not spent or not any(ids[i] in spent for i in ranked):
            return ranked
        where: dict[Hashable, int] = {}
        for place, i in enumerate(ranked):
            where.setdefault(groups[i], place)
        return sorted(ranked, key=lambda i: (where[groups[i]], ids[i] not in spent))

    def age_key(self, request: R) -> tuple[int, float, float]:
        """(priority class, arrival time, order of entry into the queue); a request the
        queue never saw counts as arriving now, after all the others of its class. O(1)."""
        try:
            return self.queue.age_key(self.view.request_id(request))
        except KeyError:
            pass
        arrival = self.view.arrival_s(request)
        return (self.view.priority(request), self.clock() if arrival is None else arrival,
                float("inf"))

    def group(self, request: R) -> Hashable:
        """The request's prefix group (``prefix.group_of`` over its chunk keys)."""
        request_id = self.view.request_id(request)
        if request_id in self.record.tracked:
            return self.queue.group(request_id)
        return group_of(self.view.chunk_keys(request), request_id)

    def group_size(self, request: R, request_id: RequestId) -> int:
        """The running requests of ``request``'s prefix group, counting it once whether
        or not it runs.  O(running)."""
        group, queue = self.group(request), self.queue
        return 1 + sum(1 for r in queue.running_ids()
                       if r != request_id and queue.group(r) == group)

    def spend(self, request_id: RequestId) -> None:
        """The request reached ``max_preemptions``: it goes last of its group from now on."""
        self.spent.add(request_id)
        if self.mirror is not None:
            self.mirror.ordered = False  # its group's order changes (``_spent_first``)

    # ---- the mirror ---------------------------------------------------------------------

    def current(self) -> Mirror[R] | None:
        """The mirror, if the queue's running set has not changed behind it."""
        mirror = self.mirror
        return mirror if mirror is not None and \
            mirror.epoch == self.queue.running_epoch else None

    def unchanged(self, running: Sequence[R]) -> list[RequestId] | None:
        """The mirror's ids where ``running`` is the current mirror's very list (nothing to
        reconcile), else None.  O(running), in C."""
        mirror = self.current()
        if mirror is not None and len(running) == len(mirror.requests) and \
                all(map(is_, running, mirror.requests)):
            return mirror.ids
        return None

    def reconciled(self, running: Sequence[R], ids: list[RequestId]) -> None:
        """The queue's running set was made ``running``'s (whose ids are ``ids``)."""
        self.mirror = Mirror(list(running), ids, self.queue.running_epoch, ordered=False)

    def appends(self, mirror: Mirror[R], request: R, request_id: RequestId) -> None:
        """The engine appends an admitted request to its running list (``mirror``, the
        current one before the admission).  Feather's order still holds if it runs alone
        in its prefix group and is no older than the list's last: a new group that ranks
        last. O(1)."""
        queue = self.queue
        mirror.ordered = mirror.ordered and queue.group_runners(request_id) <= 1 and (
            not mirror.ids or self._order_key(mirror.ids[-1]) <= self._order_key(request_id))
        mirror.requests.append(request)
        mirror.ids.append(request_id)
        mirror.epoch = queue.running_epoch

    def remove(self, request_id: RequestId) -> None:
        """Take a leaving request out of the queue, and of the mirror, which stays
        current."""
        mirror = self.current()
        in_mirror = mirror is not None and self._drops(mirror, request_id)
        self.queue.remove(request_id)
        if in_mirror:
            mirror.epoch = self.queue.running_epoch

    def _drops(self, mirror: Mirror[R], request_id: RequestId) -> bool:
        """Take a request that is leaving (before the queue forgets it) out of the
        mirror; False if it is not there (not running).  Feather's order still holds
        unless it was the oldest of a group that runs on (the group ranked by its age).
        O(running), in C."""
        if self.queue.state(request_id) is not QueueState.RUNNING:
            return False
        ids = mirror.ids
        try:
            at = ids.index(request_id)  # the mirror's ids are the running set
        except ValueError:  # never expected: the next pass reconciles in full
            self.mirror = None
            return False
        if self.spent:  # a group's members may stand out of age order (``_spent_first``)
            mirror.ordered = False
        elif mirror.ordered and at + 1 < len(ids):
            key = self._run_key
            mirror.ordered = key(ids[at]) != key(ids[at + 1]) or \
                (at > 0 and key(ids[at - 1]) == key(ids[at]))
        del mirror.requests[at], ids[at]
        return True

    def _run_key(self, request_id: RequestId) -> tuple:
        """What ``order`` keeps contiguous: the class (and tenant, under fair share) and
        the prefix group. O(1)."""
        queue = self.queue
        if self.places is None:
            return queue.priority(request_id), queue.group(request_id)
        return *self._order_key(request_id)[:2], queue.group(request_id)

    def clear(self) -> None:
        """The queue was cleared: the mirror and the tenants' places are forgotten."""
        self.mirror = None
        self.places = None

    # ---- the waiting order --------------------------------------------------------------

    def rank_waiting(self, waiting: Sequence[R]) -> list[R]:
        """``waiting`` in the order Feather would admit it (``FeatherRuntime.
        rank_waiting``): the candidate, the requests the queue holds waiting by
        ``FeatherQueue.rank_key`` (under fair share, those of tenants the share admits
        now first), then the rest as given.  O(n log n), plus ``TenantShare.
        eligible_tenants`` once per class under fair share."""
        first = self.queue.candidate()
        queue, view, share = self.queue, self.view, self.queue.share
        admitted: dict[int, set[Hashable]] = {}

        def held_back(request_id: RequestId) -> bool:
            if share is None:
                return False
            priority = queue.priority(request_id)
            if priority not in admitted:
                admitted[priority] = set(share.eligible_tenants(priority))
            return queue.tenant(request_id) not in admitted[priority]

        def rank(request: R) -> tuple:
            request_id = view.request_id(request)
            if request_id == first:
                return (0,)
            if request_id in queue and queue.state(request_id) is QueueState.WAITING:
                key = queue.rank_key(request_id)
                return (1, key[0], held_back(request_id), *key[1:])
            return (2,)

        return sorted(waiting, key=rank)

    def passes_due(self, request: R) -> bool:
        """Whether running ``request`` by a path that bypasses the queue would pass the
        waiting request a bound made due (``FeatherRuntime.passes_due``).  O(requeued
        requests)."""
        due = self.queue.due()
        if due is None or self.view.request_id(request) == due:
            return False
        arrival = self.view.arrival_s(request)
        if arrival is None:
            arrival = self.age_key(request)[1]
        return (self.view.priority(request), arrival) > \
            (self.queue.priority(due), self.queue.arrival_s(due))
