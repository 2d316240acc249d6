"""``FeatherRequestRouter``: Ray Serve's request router with ``FeatherRouter`` deciding.

Ray Serve (2.60) builds one router per deployment handle, in the caller's process (here the
OpenAI ingress of ``feather_sched.integrations.ray_serve_app``), and drives it from one event
loop: ``choose_replicas`` for each pending request (again after a backoff or a rejection),
``on_request_routed`` when a replica accepted it, ``update_replicas`` and
``on_replica_actor_died`` as replicas come and go.  This class only translates: a request's
prompt becomes chunk keys once, Ray's ``ReplicaID`` is the core's replica, and the core's
exactly-once contract is kept as follows.

* **Routed at the choice.**  ``choose_replicas`` routes the request in the core at once
  (a reservation), so a burst of one new group, chosen before any of it is accepted, still
  lands on one replica.  It ranks the core's replica first and the other replicas next:
  when the first is at ``max_ongoing_requests`` Ray sends the request to another one, and
  ``on_request_routed`` moves it there in the core.
* **Finished once.**  An accepted request finishes in the core when its ``ReplicaResult``
  completes (any way: done, failed, cancelled), through a callback on that very result.
  A reservation that is never accepted is withdrawn (``Router.withdraw``: its replica is
  not taken to cache its prefix) when Ray cancels its pending request,
  or when its send attempt completes without acceptance (rejected by a full replica,
  cancelled during the rejection round trip, failed); a retry routes it again.
* **Dead replicas.**  ``on_replica_actor_died`` and ``update_replicas`` keep the core's
  replicas equal to Ray's: a replica that leaves is ``remove_replica``'d (never chosen
  again; its requests leave the core, whose later completions are then ignored).  Requests
  Ray has not sent yet are routed again on the living replicas; requests that were
  running on it fail to their caller, which resends them (the ingress does, before any
  output reached its client).

Prompts: the first argument (or keyword value) of the call with ``prompt_token_ids`` (an
attribute or a key) or a ``prompt`` that is a list of token ids; a text ``prompt`` is
tokenized with ``tokenizer`` (loaded once, with ``transformers.AutoTokenizer``).  A call
with no prompt is routed with no keys, as a new prefix.  Cost per request:
``token_chunk_keys`` over its prompt once, plus ``FeatherRouter``'s O(keys) bookkeeping
(``benchmarks/replicas/router_overhead.py``); O(1) per completion.

Needs strict ``max_ongoing_requests`` (Serve's default outside Ray Client): without it
Ray calls no ``on_request_routed`` and reservations would only be released at completion.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from feather_sched.cht import token_chunk_keys
from feather_sched.router import FeatherRouter

logger = logging.getLogger("ray.serve")  # Serve's logger: lines reach the replica logs

ROUTER_CLASS = f"{__name__}.FeatherRequestRouter"
"""The ``request_router_class`` path for ``RequestRouterConfig``."""


@dataclass
class _Reservation:
    """A pending request routed in the core and not accepted yet."""

    request: PendingRequest  # held so that id(request) stays unique while reserved
    key: int
    chunk_keys: Sequence[Any]
    watched: Any = None  # the request's future we watch (Ray makes a new one per retry)
    sent_to: ReplicaID | None = None  # where that future sent it, once resolved


class FeatherRequestRouter(RequestRouter):
    """Routes a deployment's requests with ``FeatherRouter`` (see the module docstring).

    ``request_router_kwargs``: ``tokenizer`` (path or name, for text prompts) and
    ``FeatherRouter``'s options (``chunk_tokens``, ``balance_abs``, ``balance_rel``,
    ``max_idle_keys``, ``seed``).
    """

    def initialize_state(self, tokenizer: str | None = None, **options: Any) -> None:
        self.core = FeatherRouter(**options)
        self._tokenizer_name = tokenizer
        self._tokenizer: Any = None
        self._keys = itertools.count()
        self._reserved: dict[int, _Reservation] = {}  # by id(PendingRequest)
        self._by_call: dict[str, set[int]] = {}  # internal request id -> reservations

    # ---- Ray's hooks ------------------------------------------------------------------

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        """The core's replica first, then the others (used only when it is full)."""
        if pending_request is None or not self.core.replicas:
            return [candidate_replicas]
        reservation = self._reserve(pending_request)
        chosen = self.core.replica_of(reservation.key)
        first = [r for r in candidate_replicas if r.replica_id == chosen]
        return [first, [r for r in candidate_replicas if r.replica_id != chosen]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        reservation = self._unreserve(id(pending_request))
        if reservation is None or reservation.key not in self.core:
            return  # released already (its attempt completed first) or its replica died
        key = reservation.key
        if self.core.replica_of(key) != replica_id:
            if replica_id not in self._replica_id_set:
                self.core.withdraw(key)
                return
            self.core.move(key, replica_id)
        loop = self._event_loop
        result.add_done_callback(lambda _: loop.call_soon_threadsafe(self._finish, key))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """A send attempt ended; one that was never accepted releases its reservation
        unless Ray has already started routing the request again."""
        super().on_request_completed(replica_id, internal_request_id)
        for handle in list(self._by_call.get(internal_request_id, ())):
            reservation = self._reserved[handle]
            if (reservation.sent_to == replica_id
                    and reservation.watched is reservation.request.future):
                self._unreserve(handle)
                self._withdraw(reservation.key)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._sync_replicas()

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._sync_replicas()

    # ---- translation ------------------------------------------------------------------

    def _reserve(self, request: PendingRequest) -> _Reservation:
        """The request's reservation in the core, made on its first choice (or again when
        its replica died before accepting it); watches the future of this attempt."""
        handle = id(request)
        reservation = self._reserved.get(handle)
        if reservation is None:
            reservation = _Reservation(request, next(self._keys), self._chunk_keys(request))
            self._reserved[handle] = reservation
            call = request.metadata.internal_request_id
            self._by_call.setdefault(call, set()).add(handle)
        if reservation.key not in self.core:
            self.core.route(reservation.key, reservation.chunk_keys)
        if reservation.watched is not request.future:
            reservation.watched, reservation.sent_to = request.future, None
            request.future.add_done_callback(lambda f: self._attempt_resolved(handle, f))
        return reservation

    def _attempt_resolved(self, handle: int, future: Any) -> None:
        reservation = self._reserved.get(handle)
        if reservation is None or reservation.watched is not future:
            return
        if future.cancelled():  # abandoned before any send
            self._unreserve(handle)
            self._withdraw(reservation.key)
        elif future.exception() is None:
            reservation.sent_to = future.result().replica_id

    def _unreserve(self, handle: int) -> _Reservation | None:
        reservation = self._reserved.pop(handle, None)
        if reservation is not None:
            call = reservation.request.metadata.internal_request_id
            handles = self._by_call[call]
            handles.discard(handle)
            if not handles:
                del self._by_call[call]
        return reservation

    def _finish(self, key: int) -> None:
        if key in self.core:  # not returned by remove_replica meanwhile
            self.core.finished(key)

    def _withdraw(self, key: int) -> None:
        """Release a reservation no replica accepted (no prefix served anywhere)."""
        if key in self.core:
            self.core.withdraw(key)

    def _sync_replicas(self) -> None:
        live = self._replica_id_set
        for replica in self.core.replicas:
            if replica not in live:
                returned = self.core.remove_replica(replica)
                logger.info("Feather router: %s left with %d requests; Ray resends those "
                            "not yet accepted, callers the rest", replica, len(returned))
        known = set(self.core.replicas)
        for replica in self._replicas_list:
            if replica.replica_id not in known:
                self.core.add_replica(replica.replica_id)

    def _chunk_keys(self, request: PendingRequest) -> Sequence[Any]:
        """The prompt's chunk keys; none (least loaded) when it has no usable prompt."""
        prompt = prompt_of(request)
        try:
            if isinstance(prompt, str):
                prompt = self._tokenize(prompt)
            if prompt is None:
                return ()
            return token_chunk_keys(np.asarray(prompt, dtype=np.int32),
                                    self.core.chunk_tokens)
        except (ValueError, OverflowError, OSError) as error:
            logger.warning("Feather router: routing a request by load only: %s", error)
            return ()

    def _tokenize(self, text: str) -> list[int]:
        if self._tokenizer is None:
            if self._tokenizer_name is None:
                raise ValueError("a text prompt needs request_router_kwargs['tokenizer']")
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self._tokenizer_name)
        return self._tokenizer.encode(text)


def prompt_of(request: PendingRequest) -> list[int] | str | None:
    """A call's prompt: token ids (``prompt_token_ids``, or a ``prompt`` list), else its text
    ``prompt``, from the first argument or keyword value carrying one; None without."""
    for arg in [*request.args, *request.kwargs.values()]:
        for field in ("prompt_token_ids", "prompt"):
            value = arg.get(field) if isinstance(arg, dict) else getattr(arg, field, None)
            if isinstance(value, str) and field == "prompt":
                return value
            if isinstance(value, list | tuple) and all(isinstance(t, int) for t in value):
                return list(value)
    return None
