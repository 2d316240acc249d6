"""Schedulers for the simulator: Feather and VTC (the real FeatherRuntime), SGLang's LPM,
DFS-weight, HRRN and routing-key, ``sim.fcfs`` (vLLM's own) and ``sim.vllm_knobs``.
Feather *is* the ``FeatherRuntime`` the vLLM and SGLang adapters use, reading simulated
requests through ``SimRequests`` (chunk keys from the pool's block keys, each request's
priority class from its spec) on the simulated clock; so is VTC (``fairness: vtc``).
The SGLang policies follow ``SchedulePolicy.calc_priority`` of SGLang 0.5.23, ignoring
priorities: once per pass they order the queue by cached prefix (LPM: longest first, FCFS
above 128 waiting, in-batch de-prioritisation of requests sharing 32+ tokens with one
already chosen; DFS-weight: depth-first over the cached-prefix tree, heaviest subtree
first; HRRN: ``HrrnPolicy``; routing-key: ``RoutingKeyPolicy``).  They match prefixes
against the pool's block keys, far cheaper than SGLang's token radix tree, so each
ordering pass is charged ``match_s`` per waiting request matched (default: SGLang's own
cost measured by ``feather cht-bench``, ``benchmarks/cht``).
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from collections.abc import Hashable, Sequence
from itertools import pairwise
from operator import attrgetter
from typing import Any

from feather_sched.core.cht import block_chunk_keys
from feather_sched.core.config import FeatherConfig
from feather_sched.core.contract import RuntimeContract
from feather_sched.core.prefix import keys_per_chunk
from feather_sched.core.runtime import FeatherRuntime
from feather_sched.costmodel.cost import CostModel
from feather_sched.gates.step_model import StepPrior
from feather_sched.scheduler_names import SIM_KINDS, SchedulerKind, SchedulerName, parse_scheduler
from feather_sched.sim.engine import Policy, SimEngine, SimRequest
from feather_sched.sim.fcfs import FcfsPolicy, PriorityPolicy
from feather_sched.sim.vllm_knobs import ActiveCapPolicy, CacheAwarePolicy

LPM_MAX_WAITING = 128
"""SGLang's WAITING_QUEUE_PREFIX_MATCH_MAX: above it LPM does no prefix matching."""
IN_BATCH_TOKENS = 32
"""SGLang's IN_BATCH_PREFIX_CACHING_{CHECK,DEPRIORITIZE}_THRESHOLD."""
SGLANG_MATCH_S = 18e-6
"""SGLang 0.5.23 calc_priority cost per waiting request, 1K-token prompts (18.3 ms for
1024 waiting in benchmarks/cht/results/5a05ba1/cht-bench.json)."""


class SimRequests:
    """``RequestView`` of simulated requests for ``FeatherRuntime``: keys per chunk."""

    def __init__(self, block_tokens: int, chunk_tokens: int, priorities: bool = True) -> None:
        """``priorities`` off: every request in class 0 (a scheduler that ignores them)."""
        self.blocks_per_chunk = keys_per_chunk(block_tokens, chunk_tokens)
        self.chunk_tokens = self.blocks_per_chunk * block_tokens
        """Tokens a chunk key stands for: ``chunk_tokens`` in whole blocks (at least one)."""
        self.priorities = priorities

    request_id = attrgetter("spec.request_id")
    """The request's id (an attrgetter: the runtime maps it over the running list)."""

    def chunk_keys(self, request: SimRequest) -> list:
        return block_chunk_keys(request.keys, self.blocks_per_chunk)

    def prompt_tokens(self, request: SimRequest) -> int:
        return request.prompt_len

    def arrival_s(self, request: SimRequest) -> float:
        return request.spec.arrival_s

    def priority(self, request: SimRequest) -> int:
        return request.spec.priority if self.priorities else 0

    def tenant(self, request: SimRequest) -> str:
        return request.spec.tenant


class _SGLangPolicy(FcfsPolicy):
    """SGLang's waiting list: FCFS, reordered once per step by cached prefix."""

    name = "sglang"

    def __init__(self, engine: SimEngine, match_s: float = SGLANG_MATCH_S) -> None:
        super().__init__()
        self.engine = engine
        self.match_s = match_s
        self.charged_s = 0.0
        """Modelled CPU seconds of SGLang's matching (the engine adds them to the clock)."""

    def begin_pass(self, running: Sequence[SimRequest]) -> list[SimRequest]:
        self.charged_s = 0.0
        if len(self._queue) > 1:
            order = self._order(self.engine.pool)
            if order is not None:
                self._queue = deque(order)
        return list(running)

    def _order(self, pool: Any) -> list[SimRequest] | None:
        raise NotImplementedError

    def _matched(self, pool: Any) -> list[tuple[SimRequest, int]]:
        """Cached prefix blocks of every waiting request, at SGLang's cost in all.

        The engine already charges this method's own wall time; the model adds the rest
        of what SGLang's token radix tree takes for the same queue.
        """
        started = time.perf_counter()
        matched = [(r, len(pool.match(r.keys))) for r in self._queue]
        spent = time.perf_counter() - started
        self.charged_s += max(0.0, self.match_s * len(self._queue) - spent)
        return matched


def deprioritized(pool: Any, matched: list[tuple[SimRequest, int]]) -> set[str]:
    """SGLang's in-batch prefix caching (``_compute_prefix_matches``): of the waiting
    requests with at most 32 cached tokens, each one sharing its first 32 tokens with an
    earlier such request is pushed back (its request id in the set)."""
    check_blocks = max(1, IN_BATCH_TOKENS // pool.block_tokens)
    claimed: set[Hashable] = set()
    pushed_back = set()
    for request, blocks in matched:
        if blocks * pool.block_tokens <= IN_BATCH_TOKENS and len(request.keys) >= check_blocks:
            prefix = request.keys[check_blocks - 1]
            if prefix in claimed:
                pushed_back.add(request.request_id)
            claimed.add(prefix)
    return pushed_back


class LpmPolicy(_SGLangPolicy):
    """SGLang ``lpm``: longest cached prefix first, in-batch duplicates pushed back."""

    name = "sglang-lpm"

    def _order(self, pool: Any) -> list[SimRequest] | None:
        if len(self._queue) > LPM_MAX_WAITING:
            return None
        matched = self._matched(pool)
        pushed_back = deprioritized(pool, matched)
        keyed = [(request.request_id in pushed_back, -blocks, index, request)
                 for index, (request, blocks) in enumerate(matched)]
        return [request for *_, request in sorted(keyed, key=lambda k: k[:3])]


class HrrnPolicy(_SGLangPolicy):
    """SGLang ``hrrn`` (``_sort_by_hrrn``): highest response ratio next with token-based
    aging, the ratio's growth ``waited prefill tokens / uncached prompt tokens`` (prefill
    tokens run since the request first entered the queue); in-batch duplicates last, a
    fully cached request first, ties by request id; FCFS above 128 waiting, as LPM."""

    name = "sglang-hrrn"

    def __init__(self, engine: SimEngine, match_s: float = SGLANG_MATCH_S) -> None:
        super().__init__(engine, match_s)
        self.processed_tokens = 0
        """SGLang's ``processed_tokens_counter``: prefill tokens of every step so far."""
        self._entered: dict[str, int] = {}
        """Each request's ``arrival_processed_tokens`` (set once, on its first entry)."""

    def enter_waiting(self, request: SimRequest) -> None:
        self._entered.setdefault(request.request_id, self.processed_tokens)
        super().enter_waiting(request)

    def discard(self, request_id: Hashable) -> bool:
        self._entered.pop(str(request_id), None)
        return False

    def end_pass(self, step: Hashable, running: Sequence[SimRequest]) -> None:
        self.processed_tokens += sum(
            r.scheduled_tokens for r in running
            if r.step == step and (r.scheduled_tokens > 1 or r.num_output_tokens == 0))

    def _order(self, pool: Any) -> list[SimRequest] | None:
        if len(self._queue) > LPM_MAX_WAITING:
            return None
        matched = self._matched(pool)
        pushed_back = deprioritized(pool, matched)

        def key(item: tuple[SimRequest, int]) -> tuple[float, str]:
            request, blocks = item
            rid = request.request_id
            uncached = request.prompt_len - blocks * pool.block_tokens
            if rid in pushed_back:
                return math.inf, rid
            if uncached <= 0:
                return -math.inf, rid
            return -(self.processed_tokens - self._entered[rid]) / uncached, rid

        return [request for request, _ in sorted(matched, key=key)]


class RoutingKeyPolicy(FcfsPolicy):
    """SGLang ``routing-key`` (``_sort_by_routing_key``): once a step, waiting requests
    whose routing key the running batch holds go first, most-held key first, then the
    others by key (none first), stable.  The key is the request's prefix group, as a
    client that names its conversation or document would send it (``x-smg-routing-key``);
    a request that shares nothing sends none.  Cache-agnostic: no prefix matching."""

    name = "sglang-routing-key"

    def begin_pass(self, running: Sequence[SimRequest]) -> list[SimRequest]:
        counts = Counter(key for r in running if (key := routing_key(r)))
        if counts and len(self._queue) > 1:
            def rank(request: SimRequest) -> tuple[int, int, str]:
                own = routing_key(request)
                if own and own in counts:
                    return 0, -counts[own], own
                return 1, 0, own or ""

            self._queue = deque(sorted(self._queue, key=rank))
        return list(running)


def routing_key(request: SimRequest) -> str | None:
    """A request's routing key: its workload's prefix group, none where it shares nothing."""
    return str(request.spec.group) if request.spec.group >= 0 else None


class DfsWeightPolicy(_SGLangPolicy):
    """SGLang ``dfs-weight``: depth-first over cached prefixes, heaviest subtree first."""

    name = "sglang-dfs-weight"

    def _order(self, pool: Any) -> list[SimRequest] | None:
        children: dict[Hashable, list[Hashable]] = {}
        weight: dict[Hashable, int] = {}
        at_node: dict[Hashable, list[SimRequest]] = {}
        for request, blocks in self._matched(pool):
            path: list[Hashable] = [None, *request.keys[:blocks]]
            at_node.setdefault(path[-1], []).append(request)
            for parent, node in pairwise(path):
                if node not in weight:
                    children.setdefault(parent, []).append(node)
            for node in path:
                weight[node] = weight.get(node, 0) + 1
        # SGLang's get_dfs_priority: children by descending weight, then the node's own
        # requests (post-order), iteratively so long prefixes cannot overflow the stack.
        order: list[SimRequest] = []
        stack: list[tuple[Hashable, bool]] = [(None, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                order += at_node.get(node, [])
                continue
            stack.append((node, True))
            ranked = sorted(children.get(node, []), key=lambda n: weight[n])
            stack += [(child, False) for child in ranked]
        return order


def _peer_policy(parsed: SchedulerName, engine: SimEngine) -> Any:
    """The policy of a peer's name added after LPM and DFS-weight; None for the others."""
    if parsed.kind is SchedulerKind.SGLANG_HRRN:
        return HrrnPolicy(engine)
    if parsed.kind is SchedulerKind.SGLANG_ROUTING_KEY:
        return RoutingKeyPolicy()
    if parsed.kind is SchedulerKind.VLLM_CACHE_AWARE:
        return CacheAwarePolicy(engine, int(parsed.knob("window")), parsed.knob("threshold"))
    if parsed.kind is SchedulerKind.VLLM_ACTIVE_CAP:
        return ActiveCapPolicy(int(parsed.knob("cap")))
    return None


def make_policy(name: str, feather_options: dict[str, Any], engine: SimEngine) -> Policy:
    """The simulated scheduler of a name (``schedulers.SIM_KINDS``) for ``engine``."""
    parsed = parse_scheduler(name, SIM_KINDS)
    if parsed.kind is SchedulerKind.FCFS:
        return FcfsPolicy()
    if parsed.kind is SchedulerKind.PRIORITY:
        return PriorityPolicy()
    if parsed.kind is SchedulerKind.SGLANG_LPM:
        return LpmPolicy(engine)
    if parsed.kind is SchedulerKind.SGLANG_DFS_WEIGHT:
        return DfsWeightPolicy(engine)
    peer = _peer_policy(parsed, engine)
    if peer is not None:
        return peer
    options = parsed.feather_options(feather_options)
    if parsed.gate == "model" and isinstance(engine.cost_model, CostModel):
        # The profile of the simulated GPU is the prior a user would give for theirs.
        gate_options = dict(options.get("gate_options") or {})
        gate_options.setdefault("prior", StepPrior.of(engine.cost_model))
        options["gate_options"] = gate_options
    config = FeatherConfig.from_sources(options, environ={})
    view = SimRequests(engine.config.block_tokens, config.chunk_tokens,
                       priorities=parsed.kind is SchedulerKind.FEATHER)
    runtime: RuntimeContract[SimRequest] = FeatherRuntime(
        config, view, clock=engine.clock, name=name, seats=engine.config.max_num_seqs,
        kv_tokens=engine.config.num_blocks * engine.config.block_tokens,
        chunk_tokens=view.chunk_tokens)
    return runtime
