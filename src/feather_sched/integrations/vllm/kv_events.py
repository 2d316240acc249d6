"""vLLM's KV cache events, received over ZMQ and applied to the router's cache index.

vLLM's publisher (0.32-0.34: ``vllm.distributed.kv_events.ZmqEventPublisher``, enabled with
``--kv-events-config``) sends each scheduler step's events as one msgpack
``KVEventBatch`` on a PUB socket, framed ``(topic, 8-byte big-endian sequence number,
payload)``, and keeps the last ``buffer_steps`` batches for a ROUTER replay socket: a
request of ``("", start sequence number)`` is answered with every kept batch from there,
then an end marker (sequence number -1).  This module only translates: ``decode`` turns
a payload into ``cache_index`` events (those of the engine's own block pool: medium GPU,
or unspecified, and KV cache group 0), and ``KVEventSubscriber`` runs one thread that
subscribes to every replica's publisher, feeds each replica's batches through its
``cache_index.EventFeed`` (replaying gaps through the replica's replay socket) under
``lock``, and checks each replica's first ``BlockStored`` of a prompt's start against the
router's own hashes (``check``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Hashable

import msgspec
import zmq
from vllm.distributed.kv_events import AllBlocksCleared as VLLMAllBlocksCleared
from vllm.distributed.kv_events import BlockRemoved as VLLMBlockRemoved
from vllm.distributed.kv_events import BlockStored as VLLMBlockStored
from vllm.distributed.kv_events import KVEventBatch

from feather_sched.routing.cache_index import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CacheIndex,
    EventFeed,
    KVEvent,
)

logger = logging.getLogger(__name__)

Replica = Hashable
END_SEQ = -1
REPLAY_TIMEOUT_S = 2.0
"""How long a replay may take before what it did not cover is cleared."""
IDLE_REPLAY_S = 1.0
"""A publisher silent this long is asked what it kept since the last batch received (a
batch lost with none after it shows no gap)."""
_MEDIA = (None, "GPU")
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def decode(payload: bytes) -> list[KVEvent]:
    """One published batch as ``cache_index`` events (other tiers' and groups' dropped)."""
    events: list[KVEvent] = []
    for event in _decoder.decode(payload).events:
        if isinstance(event, VLLMAllBlocksCleared):
            events.append(AllBlocksCleared())
        elif event.medium not in _MEDIA or event.group_idx not in (None, 0):
            continue
        elif isinstance(event, VLLMBlockStored):
            plain = event.lora_name is None and not any(event.extra_keys or ())
            events.append(BlockStored(event.block_hashes, event.parent_block_hash,
                                      event.token_ids if plain else (), event.block_size))
        elif isinstance(event, VLLMBlockRemoved):
            events.append(BlockRemoved(event.block_hashes))
    return events


class _Source:
    """One replica's publisher: its sockets and feed, and whether its hashes were
    checked (or found to differ)."""

    def __init__(self, subscriber: KVEventSubscriber, replica: Replica, endpoint: str,
                 replay_endpoint: str | None, topic: str) -> None:
        context: zmq.Context = zmq.Context.instance()
        self.subscriber = subscriber
        self.replica = replica
        self.sub = context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.replay: zmq.Socket | None = None
        self.checked = self.mismatch = False
        self.heard = time.monotonic()
        """When a batch last came, or the publisher was last asked."""
        self.feed = EventFeed(subscriber.index, replica,
                              self.replayed if replay_endpoint else None, subscriber.lock)

    def replayed(self, start: int) -> list[tuple[int, list[KVEvent]]] | None:
        """The batches the publisher still keeps from ``start`` on (None: no answer in
        time, or this replica's hashes differ)."""
        if self.replay is None:
            self.replay = zmq.Context.instance().socket(zmq.DEALER)
            self.replay.setsockopt(zmq.LINGER, 0)
            self.replay.connect(self.replay_endpoint)
        self.replay.send_multipart((b"", start.to_bytes(8, "big")))
        batches: list[tuple[int, list[KVEvent]]] = []
        while self.replay.poll(int(REPLAY_TIMEOUT_S * 1000)):
            frames = self.replay.recv_multipart()
            seq = int.from_bytes(frames[-2], "big", signed=True)
            if seq == END_SEQ:
                return None if self.mismatch else batches
            events = decode(frames[-1])
            self.verify(events)
            batches.append((seq, events))
        self.replay.close(linger=0)  # a late answer must not mix with the next one
        self.replay = None
        return None

    def receive(self, seq: int, payload: bytes) -> None:
        self.heard = time.monotonic()
        events = decode(payload)
        self.verify(events)
        if not self.mismatch:
            self.feed.receive(seq, events)
        if self.mismatch:  # found while the feed replayed
            with self.subscriber.lock:
                self.subscriber.index.clear(self.replica)

    def verify(self, events: list[KVEvent]) -> None:
        """Check the first ``BlockStored`` of a prompt's start against the router's."""
        check = self.subscriber.check
        if self.checked or check is None:
            return
        for event in events:
            if isinstance(event, BlockStored) and event.parent is None and event.token_ids:
                self.checked = True
                why = check(event)
                if why is None:
                    self.subscriber.log.info("Feather router: %s's KV events agree with "
                                             "the router's block hashes", self.replica)
                else:
                    self.mismatch = True
                    if self.subscriber.on_mismatch is not None:
                        self.subscriber.on_mismatch(self.replica, why)
                return

    def close(self) -> None:
        self.sub.close(linger=0)
        if self.replay is not None:
            self.replay.close(linger=0)


class KVEventSubscriber:
    """Every replica's vLLM KV events into ``index``, from one background thread.

    ``add(replica, endpoint, replay_endpoint)`` subscribes (the replica is in the index at
    once; what its engine published before is replayed), ``remove`` unsubscribes and
    drops the replica from the index.  Index changes are made under ``lock``, which
    callers hold around every read of ``index``.  ``check(event)`` (the router's
    ``VLLMBlockHasher.check``) sees each replica's first ``BlockStored`` at a prompt's
    start that carries its tokens; a mismatch is reported to ``on_mismatch(replica,
    why)`` and that replica's events are no longer applied (its entries cleared).
    A publisher silent for ``IDLE_REPLAY_S`` is asked for what it kept since.  ``feeds``
    gives each replica's ``EventFeed`` (its counters).  Costs the router O(events) under
    the lock per batch.
    """

    def __init__(self, index: CacheIndex, lock: threading.Lock,
                 check: Callable[[BlockStored], str | None] | None = None,
                 on_mismatch: Callable[[Replica, str], None] | None = None,
                 log: logging.Logger = logger) -> None:
        self.log = log
        self.index = index
        self.lock = lock
        self.check = check
        self.on_mismatch = on_mismatch
        self.feeds: dict[Replica, EventFeed] = {}
        self._commands: queue.SimpleQueue[tuple[Replica, tuple[str, str | None, str] | None]]
        self._commands = queue.SimpleQueue()
        self._running = True
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="feather-kv-events")
        self._thread.start()

    def add(self, replica: Replica, endpoint: str, replay_endpoint: str | None = None,
            topic: str = "") -> None:
        with self.lock:
            self.index.add_replica(replica)
        self._commands.put((replica, (endpoint, replay_endpoint, topic)))

    def remove(self, replica: Replica) -> None:
        self._commands.put((replica, None))

    def close(self) -> None:
        """Stop the thread and close every socket."""
        self._running = False
        self._thread.join(timeout=5)

    def _run(self) -> None:
        poller = zmq.Poller()
        sources: dict[zmq.Socket, _Source] = {}
        try:
            while self._running:
                self._serve_commands(poller, sources)
                for socket, _ in poller.poll(50):
                    source = sources[socket]
                    while not source.mismatch:
                        try:
                            _, seq, payload = socket.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        source.receive(int.from_bytes(seq, "big", signed=True), payload)
                now = time.monotonic()
                for source in sources.values():
                    if source.replay_endpoint and not source.mismatch and \
                            now - source.heard > IDLE_REPLAY_S:
                        source.heard = now
                        source.feed.catch_up()
        except Exception:  # the router keeps routing by what the index holds so far
            self.log.exception("Feather router: the KV event subscriber stopped")
        finally:
            for source in sources.values():
                source.close()

    def _serve_commands(self, poller: zmq.Poller, sources: dict[zmq.Socket, _Source]
                        ) -> None:
        while True:
            try:
                replica, where = self._commands.get_nowait()
            except queue.Empty:
                return
            for socket, old in list(sources.items()):
                if old.replica == replica:
                    poller.unregister(socket)
                    del sources[socket]
                    old.close()
            if where is None:
                self.feeds.pop(replica, None)
                with self.lock:
                    self.index.drop(replica)
                continue
            source = _Source(self, replica, *where)
            sources[source.sub] = source
            poller.register(source.sub, zmq.POLLIN)
            self.feeds[replica] = source.feed
            if where[1]:
                source.feed.catch_up()  # what it published before the subscription
