"""Agent sessions in SGLang (0.5.23): ``core.session_pins`` over its ``RadixCache``.

A request entering the waiting queue goes to ``Sessions.arrived`` with its prompt's token
chunk keys (namespace: its tenant and ``extra_key``/``cache_salt`` boundary); a warm
continuing turn is named in ``warm``, class 0 of its SGLang class in
``SGLangRequests.priority`` (others class 1).  When SGLang releases a finished request's
KV row after caching it in the tree (``BasePrefixCache.on_release``, checkpointed), the
path to its last node is held where ``Sessions.turn_ended`` says: a tree lock on
``req.last_node`` (``inc_lock_ref`` up to the root), named by its KV pages.  A hold ends
with ``dec_lock_ref`` (evictable, still cached): at its next turn's admission or abort
while waiting (``Scheduler._release_aborted_request``), at its TTL (checked each round),
when a decode step lacks KV room (before SGLang retracts) or the adder lacks it for the
only request it could run or one waiting past ``max_wait_s``, on ``RadixCache.reset``,
Feather turning off.  Cost: O(a request's tokens) at arrival and end, O(holds) a round.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from typing import Any

from feather_sched.core.isolation import Namespace, token_keys
from feather_sched.core.session_pins import PinnedSessions
from feather_sched.integrations.sglang.stand_ins import prepare_sglang_import

prepare_sglang_import()  # before the first SGLang import (see stand_ins)

from sglang.srt.managers.schedule_batch import FINISH_ABORT, Req  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey  # noqa: E402

logger = logging.getLogger("sglang.feather_sched")

SESSION_ARG = "session"
"""``SamplingParams.custom_params`` key that names a request's session explicitly."""


def why_no_sessions(tree_cache: Any) -> str | None:
    """Why sessions cannot hold in this tree cache, or None: only SGLang's own
    ``RadixCache``, enabled (a subclass keeps KV elsewhere too: host tiers, SWA, mamba)."""
    if type(tree_cache) is not RadixCache:
        return f"the tree cache is {type(tree_cache).__name__}, not SGLang's RadixCache " \
               "(the radix cache is disabled or of another kind)"
    if tree_cache.disable:
        return "the radix cache is disabled"
    return None


class SGLangSessions(PinnedSessions[Any]):
    """Feather's sessions over one SGLang ``RadixCache`` (module docstring), a hold pinned
    by a tree lock.  ``namespace_of(req)``: the request's session namespace;
    ``chunk_tokens``: tokens a recognition key covers; ``pool_tokens``: SGLang's
    ``max_total_num_tokens``; ``guard(call, *args)``: how a call from inside SGLang's cache
    runs."""

    def __init__(self, tree_cache: RadixCache, pool_tokens: int, held_share: float,
                 namespace_of: Callable[[Req], Namespace], chunk_tokens: int,
                 clock: Callable[[], float], name: str,
                 guard: Callable[..., Any] = lambda call, *args: call(*args)) -> None:
        super().__init__(held_share, pool_tokens // tree_cache.page_size, clock, name)
        self.guard = guard
        """Runs each call from inside SGLang's cache (Feather's fault guard)."""
        self.tree_cache, self.page_size = tree_cache, tree_cache.page_size
        self.namespace_of, self.chunk_tokens = namespace_of, chunk_tokens
        self._wrap(tree_cache)

    def unpin(self, pin: Any) -> None:
        self.tree_cache.unlock(pin)

    def _wrap(self, tree_cache: RadixCache) -> None:
        """Hear the cache's releases and resets (its instance's methods, SGLang's own
        called first or after)."""
        release, reset = tree_cache.on_release, tree_cache.reset

        def on_release(req: Req, *, checkpointed: bool) -> None:
            release(req, checkpointed=checkpointed)
            self.guard(self.ended, req, checkpointed)

        def on_reset() -> None:
            self.guard(self.release_all)
            self.pins.clear()  # whatever the rule says, the old tree's locks go with it
            reset()

        tree_cache.on_release, tree_cache.reset = on_release, on_reset

    def unwrap(self) -> None:
        """SGLang's own cache methods again (Feather off)."""
        for name in ("on_release", "reset"):
            vars(self.tree_cache).pop(name, None)

    # ---- requests ---------------------------------------------------------------------

    def keys(self, tokens: Any) -> list:
        """Recognition keys of ``tokens``: chained chunk digests (the namespace is the
        rule's)."""
        return token_keys(tokens, self.chunk_tokens)

    def arrived(self, req: Req) -> None:
        """A request entered the waiting queue: a new one's session recognised, warm or
        not (a retracted one comes back: nothing)."""
        if self.sessions.session_of(req.rid) is not None:
            return
        params = req.sampling_params.custom_params
        explicit = params.get(SESSION_ARG) if isinstance(params, dict) else None
        self.recognise(req.rid, self.namespace_of(req), self.keys(req.origin_input_ids),
                       explicit,
                       lambda: 2 * self.cached_tokens(req) >= len(req.origin_input_ids))

    def cached_tokens(self, req: Req) -> int:
        """How many of the prompt's leading tokens SGLang's radix tree holds now."""
        key = RadixKey(req.origin_input_ids, req.extra_key, cache_salt=req.cache_salt)
        return self.tree_cache.match_prefix(MatchPrefixParams(key=key)).device_prefix_len

    def dropped(self, req: Req) -> None:
        """SGLang dropped ``req`` unrun (aborted or refused while waiting:
        ``PinnedSessions.left``)."""
        self.left(req.rid, self.keys(req.origin_input_ids))

    def ended(self, req: Req, checkpointed: bool) -> None:
        """SGLang released ``req``'s KV row (``checkpointed``: into the tree first); a
        finished turn's path is held if the rule says so.  A retracted request (not
        finished) is still its turn."""
        if not req.finished() or not self.ending(req.rid):
            return
        node = req.last_node if checkpointed else None
        pages = self.path_pages(node)
        reason = "abort" if isinstance(req.finished_reason, FINISH_ABORT) or \
            not checkpointed else str(req.finished_reason.to_json().get("type"))
        self.turn_ended(req.rid, self.keys(list(req.origin_input_ids) + list(req.output_ids)),
                        len(pages), len(pages) * self.page_size, reason, pages,
                        lambda: self.tree_cache.lock(node))

    def path_pages(self, node: Any) -> list[int]:
        """The KV pages of the tree's path from the root to ``node``, in order."""
        if node is None or node is self.tree_cache.root_node or node.parent is None:
            return []
        indices = self.tree_cache.path_device_indices(node)
        return (indices[:: self.page_size] // self.page_size).tolist()


def session_namespace(boundary: tuple[Hashable, ...], tenant: Hashable) -> Namespace:
    """Where a request's session lives: its engine boundary and its tenant, isolated
    tenants or not."""
    return Namespace(tuple(part for part in boundary if part is not None), tenant)
