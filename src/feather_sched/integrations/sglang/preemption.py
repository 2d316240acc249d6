"""Urgent preemption in SGLang (0.5.23): its budget arithmetic and release mechanics, replayed.

SGLang preempts for a more urgent request only where every seat is taken; Feather's
adder also preempts for one ``add_one_req`` refuses for KV room.  Either way the victims
are the core's (``urgent_victims``: the fewest in Feather's order that make room),
asked of this module's ``Room``, then all released at once by ``preempt``, SGLang's own
mechanics, and ``add_one_req`` tried once more.

``Room`` replays the adder's arithmetic from a snapshot taken before any release: what
``add_one_req`` asks for the request against ``rem_total_tokens``, and what each victim
gives back.  Cost: O(running) to build, O(victims' prefix nodes) per set asked.
``PRIVATE`` lists the private members of SGLang's ``PrefillAdder`` read here; ``usable``
checks them once per adder class (a release without one: urgent preemption off, one
warning).  The arithmetic in full: docs/sglang.md, "Urgent preemption's arithmetic".
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence

from feather_sched import core
from feather_sched.core import engine_members
from feather_sched.integrations.sglang.stand_ins import prepare_sglang_import

prepare_sglang_import()  # before the first SGLang import (see stand_ins)

from sglang.srt.managers.schedule_batch import Req  # noqa: E402
from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS, PrefillAdder  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache  # noqa: E402

logger = logging.getLogger("sglang.feather_sched")

PRIVATE = ("_get_running_request_total_token_offset", "_request_slot_reserve_for_req",
           "_mamba_gap_budget_for_req", "_mamba_slot_cost")
"""The members of SGLang's ``PrefillAdder`` (methods, and one attribute its constructor
sets) that this module reads and SGLang keeps private."""

_USABLE: dict[type, bool] = {}
"""Per adder class, whether ``PRIVATE`` was all there (checked on its first adder)."""


def usable(adder: PrefillAdder) -> bool:
    """Whether this SGLang has every member of ``PRIVATE`` (checked on the first adder of
    its class; one warning where it has not)."""
    kind = type(adder)
    if kind not in _USABLE:
        _USABLE[kind] = engine_members(adder, PRIVATE, "Feather's urgent preemption", logger)
    return _USABLE[kind]


class Room(core.Room[Req]):
    """SGLang's ``core.Room``: whether releasing a set of running requests lets ``req``
    into the adder's round (module docstring); ``seat``: every seat is taken."""

    def __init__(self, adder: PrefillAdder, req: Req, seat: bool) -> None:
        self.adder = adder
        self.seat = seat
        self.slots = has_mamba_slots(adder, req)
        self.short = _tokens_asked(adder, req) - adder.rem_total_tokens
        """Tokens the request is short of: a set of victims must give back more."""
        cache = adder.tree_cache
        self.tree = cache if isinstance(cache, RadixCache) and not cache.disable and \
            not cache.supports_mamba() else None
        """The radix cache whose unlocked nodes become evictable (None: count none)."""

    def made_by(self, victims: Sequence[Req]) -> bool:
        """Whether ``req`` gets a seat and its tokens once ``victims`` are released."""
        if not self.slots or (self.seat and not victims):
            return False
        offset = self.adder._get_running_request_total_token_offset
        given = sum(offset(v) + v.kv.kv_allocated_len - v.kv.cache_protected_len
                    for v in victims)
        return self.short < given + self._unlocked(victims)

    def _unlocked(self, victims: Sequence[Req]) -> int:
        """Tokens of the radix cache's nodes that only ``victims`` lock (``lock_ref``):
        evictable once they are released."""
        if self.tree is None:
            return 0
        root, held = self.tree.root_node, Counter[int]()
        nodes = {}
        for victim in victims:
            node = victim.lock.node if victim.lock is not None else root
            while node is not root and node is not None:
                held[id(node)] += 1
                nodes[id(node)] = node
                node = node.parent
        return sum(len(node.key) for key, node in nodes.items() if node.lock_ref <= held[key])


def _tokens_asked(adder: PrefillAdder, req: Req) -> int:
    """The tokens ``add_one_req`` asks of the budget for ``req``: its uncached input, its
    output reserve, the page overhead and the Mamba state and request-slot reserves."""
    max_new = min(max(req.sampling_params.max_new_tokens - len(req.output_ids), 0),
                  CLIP_MAX_NEW_TOKENS)
    return (len(req.full_untruncated_fill_ids) - req.prefix_len + max_new
            + adder.per_req_token_overhead
            + adder._mamba_gap_budget_for_req(req, include_host_hit=True)
            + adder._request_slot_reserve_for_req(req))


def has_mamba_slots(adder: PrefillAdder, req: Req) -> bool:
    """Whether ``req`` has the Mamba state slots of a hybrid model that SGLang's
    ``add_one_req`` asks for (not on its ignore-EOS path without a radix cache, which
    asks none): the adder counted them when built (``rem_mamba_slots``) and no release
    gives any back to it this round, so preempting for a request short of them frees
    nothing it can use."""
    if adder.rem_mamba_slots is None or (req.sampling_params.ignore_eos and
                                         getattr(adder.tree_cache, "disable", True)):
        return True
    reserve = adder._mamba_gap_budget_for_req(req, include_host_hit=True)
    return reserve // adder._mamba_slot_cost <= adder.rem_mamba_slots


def preempt(adder: PrefillAdder, victims: Sequence[Req]) -> None:
    """Release ``victims``, running requests, as SGLang's ``preempt_to_schedule`` releases
    its own: each one's output reserve given back to the budget, its KV released (its
    prefix to the radix cache) by ``ScheduleBatch.release_req``, all out of the running
    batch by one ``filter_batch``, into ``preempt_list``, which SGLang's round puts back
    in the waiting queue."""
    batch, chosen = adder.running_batch, {id(victim) for victim in victims}
    keep, released = [], 0
    for i, running in enumerate(batch.reqs):
        if id(running) in chosen:
            adder.memory_budget.total_offset -= \
                adder._get_running_request_total_token_offset(running)
            released += 1
            batch.release_req(i, len(batch.reqs) - released)
        else:
            keep.append(i)
    batch.filter_batch(keep_indices=keep)
    adder.preempt_list.extend(victims)
    adder.req_states = None  # add_one_req_ignore_eos's picture of the running batch
