"""``FeatherRequestRouter``: Ray Serve's request router with ``FeatherRouter`` deciding.

Ray Serve builds one per deployment handle, in the ingress's process, on one event loop.
It only translates (a prompt's chunk keys once; Ray's ``ReplicaID`` the core's replica)
and keeps the core's exactly-once contract: routed when chosen, moved when Ray sends it
elsewhere, finished once when its result completes, withdrawn if Ray gives it up; a gone
replica is never chosen again.  With ``kv_events`` the core routes by a ``PreciseIndex``
fed by the replicas' KV events, else by the approximate index.  Needs strict
``max_ongoing_requests``.  Cost per request: the prompt's keys once plus O(keys)
bookkeeping; O(1) per completion.  In full: docs/replicas.md.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_put
from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from feather_sched.core import DEFAULT_CHUNK_TOKENS, SHARED, Namespace, keys_per_chunk
from feather_sched.routing.cache_index import PreciseIndex
from feather_sched.routing.feather import FeatherRouter

logger = logging.getLogger("ray.serve")  # Serve's logger: lines reach the replica logs

ROUTER_CLASS = f"{__name__}.FeatherRequestRouter"
"""The ``request_router_class`` path for ``RequestRouterConfig``."""
KV_NAMESPACE = "feather-kv-events"
"""Ray internal KV namespace of the replicas' event registrations (by full replica id)."""


def register_kv_events(replica: str, endpoint: str, replay_endpoint: str | None,
                       block_size: int, algorithm: str) -> dict[str, Any]:
    """Publish where a replica's engine sends its KV events and how it hashes blocks (seed:
    this process's ``PYTHONHASHSEED``, which the engine inherits; int hashes: vLLM's
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``); returns the registration."""
    registration = {
        "endpoint": endpoint, "replay_endpoint": replay_endpoint,
        "settings": {"block_size": block_size, "algorithm": algorithm,
                     "seed": os.environ.get("PYTHONHASHSEED"),
                     "int_hashes": os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES",
                                                  "1") != "0"}}
    _internal_kv_put(replica, json.dumps(registration), overwrite=True,
                     namespace=KV_NAMESPACE)
    return registration


_LIVE: weakref.WeakSet[FeatherRequestRouter] = weakref.WeakSet()


def router_states() -> list[dict[str, Any]]:
    """What every ``FeatherRequestRouter`` of this process routes by (``state``)."""
    return [router.state() for router in list(_LIVE)]


def kv_events_of(replica: str) -> dict[str, Any] | None:
    """A replica's registration (``register_kv_events``), or None."""
    found = _internal_kv_get(replica, namespace=KV_NAMESPACE)
    return None if found is None else json.loads(found)


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

    ``request_router_kwargs``: ``tokenizer`` (path or name, for text prompts),
    ``kv_events`` (route by the replicas' KV events) and ``FeatherRouter``'s options
    (``chunk_tokens``, ``balance_abs``, ``balance_rel``, ``max_idle_keys``,
    ``max_sessions``, ``seed``).  The core is built when the first replicas are known.
    """

    def initialize_state(self, tokenizer: str | None = None, kv_events: bool = False,
                         **options: Any) -> None:
        self._options = options
        self._kv_events = kv_events
        self.core: FeatherRouter | None = None
        self.subscriber: Any = None
        """The ``KVEventSubscriber`` of a precise index."""
        self.hasher: Any = None
        """The ``VLLMBlockHasher`` of a precise index."""
        self.lock = threading.Lock()
        """Held around every use of the core (the subscriber changes its index)."""
        self._tokenizer_name = tokenizer
        self._tokenizer: Any = None
        self._keys = itertools.count()
        self._reserved: dict[int, _Reservation] = {}  # by id(PendingRequest)
        self._by_call: dict[str, set[int]] = {}  # internal request id -> reservations
        self._mismatched: set[ReplicaID] = set()
        # Ray ships this class by value: the module's registry is found by importing it
        import feather_sched.integrations.ray.router as module

        module._LIVE.add(self)

    def state(self) -> dict[str, Any]:
        """The index it routes by and, per live replica (by full id): its load, and with
        the precise index the blocks it holds, its event feed's counters (``next_seq``,
        ``replayed``, ``clears``) and whether its hashes differ from the router's."""
        with self.lock:
            core = self.core
            if core is None:
                return {"index": None, "replicas": {}}
            cache = core.index.cache if isinstance(core.index, PreciseIndex) else None
            replicas = {}
            for replica in core.replicas:
                entry: dict[str, Any] = {"load": core.load(replica)}
                if cache is not None:
                    feed = self.subscriber.feeds.get(replica)
                    entry.update(
                        cached_blocks=cache.blocks(replica),
                        mismatch=replica in self._mismatched,
                        events=None if feed is None else {
                            "next_seq": feed.next_seq, "replayed": feed.replayed,
                            "clears": feed.clears})
                replicas[cast(ReplicaID, replica).to_full_id_str()] = entry
        return {"index": core.index.name, "replicas": replicas,
                "hashing": self.hasher.describe() if cache is not None else None}

    # ---- Ray's hooks ------------------------------------------------------------------

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        """The core's replica first, then the others (used only when it is full)."""
        if pending_request is None or self.core is None or not self.core.replicas:
            return [candidate_replicas]
        reservation = self._reserve(pending_request)
        with self.lock:
            chosen = self.core.replica_of(reservation.key)
        first = [r for r in candidate_replicas if r.replica_id == chosen]
        return [first, [r for r in candidate_replicas if r.replica_id != chosen]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        reservation = self._unreserve(id(pending_request))
        if reservation is None or self.core is None:
            return
        key = reservation.key
        with self.lock:
            if key not in self.core:
                return  # released already (its attempt completed first) or its replica died
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
        core = self.core
        assert core is not None  # choose_replicas routes only once replicas are known
        if reservation is None:
            reservation = _Reservation(request, next(self._keys), self._prompt_keys(request))
            self._reserved[handle] = reservation
            call = request.metadata.internal_request_id
            self._by_call.setdefault(call, set()).add(handle)
        with self.lock:
            if reservation.key not in core:
                core.route(reservation.key, reservation.chunk_keys,
                           request.metadata.session_id or None)
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
        with self.lock:
            if self.core is not None and key in self.core:  # not returned meanwhile
                self.core.finished(key)

    def _withdraw(self, key: int) -> None:
        """Release a reservation no replica accepted (no prefix served anywhere)."""
        with self.lock:
            if self.core is not None and key in self.core:
                self.core.withdraw(key)

    def _sync_replicas(self) -> None:
        if self.core is None:
            if not self._replicas_list:
                return
            self.core = self._build_core()
        live = self._replica_id_set
        for replica in self.core.replicas:
            if replica not in live:
                if self.subscriber is not None:
                    self.subscriber.remove(replica)
                with self.lock:
                    returned = self.core.remove_replica(replica)
                logger.info("Feather router: %s left with %d requests; Ray resends those "
                            "not yet accepted, callers the rest", replica, len(returned))
        known = set(self.core.replicas)
        for replica in self._replicas_list:
            if replica.replica_id not in known:
                with self.lock:
                    self.core.add_replica(replica.replica_id)
                if self.subscriber is not None:
                    self._subscribe(replica.replica_id)

    def _build_core(self) -> FeatherRouter:
        """The core over no replica yet: on a precise index hashing as the first replica
        with a registration does, else on the approximate index.  Says which."""
        registration = None
        if self._kv_events:
            registration = next(filter(None, (kv_events_of(r.replica_id.to_full_id_str())
                                              for r in self._replicas_list)), None)
            if registration is None:
                logger.warning("Feather router: no replica publishes KV events")
        if registration is None:
            logger.info("Feather router: routing by the approximate index (routing history)")
            return FeatherRouter(**self._options)
        from feather_sched.integrations.vllm.block_hash import VLLMBlockHasher
        from feather_sched.integrations.vllm.kv_events import KVEventSubscriber

        try:
            self.hasher = VLLMBlockHasher(**registration["settings"])
        except ValueError as error:  # e.g. XXH3 with a random seed: nobody can match it
            logger.error("Feather router: cannot hash blocks as the replicas do (%s); "
                         "routing by the approximate index (routing history)", error)
            return FeatherRouter(**self._options)
        chunk = self._options.get("chunk_tokens", DEFAULT_CHUNK_TOKENS)
        index = PreciseIndex(self.hasher, keys_per_chunk(self.hasher.block_size, chunk))
        self.subscriber = KVEventSubscriber(index.cache, self.lock, self.hasher.check,
                                            self._mismatch, logger)
        logger.info("Feather router: routing by the precise index (the replicas' vLLM KV "
                    "events; %s)", self.hasher.describe())
        return FeatherRouter(index=index, **self._options)

    def _subscribe(self, replica: ReplicaID) -> None:
        from feather_sched.integrations.vllm.block_hash import VLLMBlockHasher

        registration = kv_events_of(replica.to_full_id_str())
        if registration is None:
            logger.warning("Feather router: %s publishes no KV events: routed by routing "
                           "history alone", replica)
            return
        try:
            settings = VLLMBlockHasher(**registration["settings"]).describe()
        except ValueError as error:
            settings = {"error": str(error)}
        if settings != self.hasher.describe():
            self._mismatch(replica, f"it hashes blocks with {settings}, the router with "
                                    f"{self.hasher.describe()}")
        else:
            self.subscriber.add(replica, registration["endpoint"],
                                registration["replay_endpoint"])

    def _mismatch(self, replica: ReplicaID, why: str) -> None:
        self._mismatched.add(replica)
        logger.error("Feather router: %s: %s; it is routed by routing history alone (the "
                     "approximate index)", replica, why)

    def _prompt_keys(self, request: PendingRequest) -> Sequence[Any]:
        """The prompt's keys (the core's: chunk keys or block hashes) in the request's
        namespace (``namespace_of``); none (least loaded) when it has no usable prompt."""
        prompt = prompt_of(request)
        try:
            if isinstance(prompt, str):
                prompt = self._tokenize(prompt)
            if prompt is None:
                return ()
            assert self.core is not None
            tokens = np.asarray(prompt, dtype=np.int32)  # OverflowError beyond int32
            return self.core.keys(cast(Sequence[int], tokens), namespace_of(request))
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
            if isinstance(value, str) and field == "prompt" and value:
                return value
            if isinstance(value, list | tuple) and all(isinstance(t, int) for t in value):
                return list(value)
    return None


def namespace_of(request: PendingRequest) -> Namespace:
    """A call's isolation namespace (``core.isolation``): the ``namespace`` of the first
    argument carrying one (the ingress's ``forward.HttpCall``); the shared one without."""
    for arg in [*request.args, *request.kwargs.values()]:
        namespace = getattr(arg, "namespace", None)
        if isinstance(namespace, Namespace):
            return namespace
    return SHARED
