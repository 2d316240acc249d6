"""VTC for the simulator: fair share between tenants by a virtual token counter (Sheng et
al., OSDI'24), without prefix order; the baseline Feather's ``fairness: tenants`` is
measured against.

It drives the contract of ``feather_sched.core.runtime`` as the other baselines
(``sim.fcfs``).  The counters are ``core.tenants.TenantShare``'s at quantum 0: the
request admitted next is the oldest of the least-served tenant with one waiting, and, as
VTC charges, a prompt costs its tenant its whole length when admitted (a prefix-cache hit
included) and each generated token as it comes (``served``).  Priorities are ignored (a
workload's classes go to it stripped, as to FCFS).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from typing import TYPE_CHECKING

from feather_sched.core.tenants import TenantShare
from feather_sched.sim.fcfs import FcfsPolicy

if TYPE_CHECKING:
    from feather_sched.sim.engine import SimRequest


class VtcPolicy(FcfsPolicy):
    """VTC: per tenant a FIFO queue (a preempted request back at its head); the least
    served tenant's head next.  O(tenants waiting) a decision, O(1) the rest."""

    name = "vtc"
    counts_service = True

    def __init__(self) -> None:
        super().__init__()
        self.share = TenantShare(quantum=0, hit_weight=1)
        self._queues: dict[Hashable, deque[SimRequest]] = {}
        self._tenants: dict[Hashable, Hashable] = {}
        """Each request's tenant, from its first wait until it is discarded."""
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def enter_waiting(self, request: SimRequest) -> None:
        queue = self._queues.setdefault(request.spec.tenant, deque())
        if request.preemptions:
            queue.appendleft(request)
        else:
            queue.append(request)
        self._size += 1
        self._tenants[request.request_id] = request.spec.tenant
        self.share.wait(request.spec.tenant)

    def discard(self, request_id: Hashable) -> bool:
        return self._tenants.pop(request_id, None) is not None

    def admit(self, request: SimRequest) -> None:
        super().admit(request)
        self.share.unwait(request.spec.tenant)
        self.share.admitted(request.spec.tenant, request.prompt_len)

    def served(self, request_id: Hashable, computed_tokens: int,
               generated_tokens: int) -> None:
        """Generated tokens only: the prompt was charged whole at admission (hit weight
        1: computed tokens cost nothing more)."""
        self.share.charge(self._tenants[request_id], computed_tokens, generated_tokens)

    def _head(self) -> SimRequest:
        return self._queues[self.share.least_served()][0]

    def _pop(self) -> SimRequest:
        tenant = self.share.least_served()
        self._size -= 1
        return self._queues[tenant].popleft()
