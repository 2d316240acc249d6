"""What it costs to find shared prefixes: the CHT against radix-tree LPM schedulers.

Every structure sees the same generated queue: ``waiting`` requests of ``prompt_len``
tokens from ``groups`` shared-prefix groups, and a running batch of one further request
from each of the first ``RUNNING_GROUPS`` groups (what the engine has cached).  Measured:

* ``insert_us_per_request`` - registering one prompt (CHT: chunk keys + add; radix trees:
  inserting the prompt's tokens, as an engine does when the request runs);
* ``decision_ms`` - one full scheduling decision over the whole queue (CHT: the best
  candidate and its gate context, then the gate; LPM and DFS-weight: ordering the queue);
* ``batch_ms`` - forming a batch of ``BATCH`` admissions (the CHT re-decides after every
  admission; LPM-style policies order once per step);
* ``bytes_per_request`` - memory the structure holds per waiting request.
"""

from __future__ import annotations

import gc
import hashlib
import statistics
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import numpy as np

from feather_sched.bench.cht.radix_baseline import TokenRadixTree, lpm_order
from feather_sched.core.cht import ChunkedHashTree, block_chunk_keys, token_chunk_keys
from feather_sched.gates.bandit import UCBBanditGate
from feather_sched.gates.base import GateContext
from feather_sched.workloads.spec import RequestSpec
from feather_sched.workloads.synthetic import shared_prefix_groups

RUNNING_GROUPS = 4
BATCH = 64
SUFFIX_TOKENS = 32
ENGINE_BLOCK_TOKENS = 16
"""vLLM's GPU default KV block size: the engine hashes one block per 16 tokens."""

STRUCTURES = ("cht-tokens", "cht-blocks", "radix-lpm", "sglang-lpm", "sglang-dfs-weight")


@dataclass(frozen=True)
class Scenario:
    waiting: int
    prompt_len: int
    groups: int


@dataclass(frozen=True)
class Result:
    structure: str
    waiting: int
    prompt_len: int
    groups: int
    insert_us_per_request: float
    decision_ms: float
    batch_ms: float
    bytes_per_request: float | None


@dataclass(frozen=True)
class Queue:
    """One scenario's prompts: numpy arrays, token lists sharing their prefix objects."""

    scenario: Scenario
    waiting: list[RequestSpec]
    running: list[RequestSpec]

    @classmethod
    def generate(cls, scenario: Scenario, seed: int = 0) -> Queue:
        per_group = -(-(scenario.waiting + RUNNING_GROUPS) // scenario.groups)
        workload = shared_prefix_groups(
            groups=scenario.groups,
            prompts_per_group=per_group,
            prefix_len=scenario.prompt_len - SUFFIX_TOKENS,
            suffix_len=SUFFIX_TOKENS,
            output_len=1,
            order="shuffled",
            seed=seed,
        )
        running, waiting, seen = [], [], set()
        for spec in workload.requests:
            if spec.group < RUNNING_GROUPS and spec.group not in seen:
                seen.add(spec.group)
                running.append(spec)
            else:
                waiting.append(spec)
        return cls(scenario, waiting[: scenario.waiting], running)

    def token_lists(self, specs: list[RequestSpec]) -> list[list[int]]:
        """Prompts as Python lists (what SGLang stores), prefixes shared between requests."""
        prefixes: dict[int, list[int]] = {}
        lists = []
        for spec in specs:
            prefix = prefixes.get(spec.group)
            if prefix is None:
                prefix = prefixes[spec.group] = spec.prompt[: spec.shared_len].tolist()
            lists.append(prefix + spec.prompt[spec.shared_len :].tolist())
        return lists


def engine_block_hashes(prompt: np.ndarray) -> list[bytes]:
    """Chained SHA-256 per full KV block, as vLLM computes them before scheduling."""
    hashes, parent = [], b""
    data = prompt.astype(np.int32).tobytes()
    stride = ENGINE_BLOCK_TOKENS * 4
    for end in range(stride, len(data) + 1, stride):
        parent = hashlib.sha256(parent + data[end - stride : end]).digest()
        hashes.append(parent)
    return hashes


def _timed(action: Callable[[], object]) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def _median_time(action: Callable[[], object], repeats: int) -> float:
    return statistics.median(_timed(action) for _ in range(repeats))


def _held_bytes(build: Callable[[], object]) -> tuple[object, float]:
    """Build a structure and return it with the bytes it still holds."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    built = build()
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return built, float(held)


class ChtRunner:
    """The CHT fed chunk keys from tokens or from engine block hashes."""

    def __init__(self, keys_of: Callable[[RequestSpec], list], name: str) -> None:
        self.keys_of = keys_of
        self.name = name
        self.gate = UCBBanditGate(seed=0)

    def run(self, queue: Queue, repeats: int) -> Result:
        inputs = [(spec.request_id, spec) for spec in queue.waiting]
        tree = ChunkedHashTree()
        insert_s = _timed(lambda: [tree.add(rid, self.keys_of(spec)) for rid, spec in inputs])
        _, held = _held_bytes(lambda: self._filled(inputs))
        for spec in queue.running:
            tree.add(spec.request_id, self.keys_of(spec))
            tree.admit(spec.request_id)
        decision_s = _median_time(lambda: self._decide(tree), max(repeats, 100))
        batch_s = _median_time(lambda: self._form_batch(tree), repeats)
        return Result(
            self.name, *_cells(queue.scenario), insert_us_per_request=insert_s * 1e6 / len(inputs),
            decision_ms=decision_s * 1e3, batch_ms=batch_s * 1e3,
            bytes_per_request=held / len(inputs),
        )

    def _filled(self, inputs: list[tuple[str, RequestSpec]]) -> ChunkedHashTree:
        tree = ChunkedHashTree()
        for rid, spec in inputs:
            tree.add(rid, self.keys_of(spec))
        return tree

    def _decide(self, tree: ChunkedHashTree) -> None:
        candidate = tree.candidate()
        self.gate.decide(GateContext(tree.num_running, candidate.chunk_loss,
                                     candidate.sharing_waiters, tree.num_waiting))

    def _form_batch(self, tree: ChunkedHashTree) -> None:
        admitted = []
        for _ in range(min(BATCH, tree.num_waiting)):
            self._decide(tree)
            request_id = tree.best()
            tree.admit(request_id)
            admitted.append(request_id)
        for request_id in admitted:
            tree.requeue(request_id)


def _cells(scenario: Scenario) -> tuple[int, int, int]:
    return scenario.waiting, scenario.prompt_len, scenario.groups


def run_radix_lpm(queue: Queue, repeats: int) -> Result:
    """Our token-level radix tree with SGLang's LPM ordering."""
    running = queue.token_lists(queue.running)
    waiting = queue.token_lists(queue.waiting)
    cache = TokenRadixTree()
    insert_s = _timed(lambda: [cache.insert(tokens) for tokens in running])
    _, held = _held_bytes(lambda: _radix_of(waiting))
    decision_s = _median_time(lambda: lpm_order(cache, waiting), repeats)
    return Result("radix-lpm", *_cells(queue.scenario),
                  insert_us_per_request=insert_s * 1e6 / len(running),
                  decision_ms=decision_s * 1e3, batch_ms=decision_s * 1e3,
                  bytes_per_request=held / len(waiting))


def _radix_of(prompts: list[list[int]]) -> TokenRadixTree:
    tree = TokenRadixTree()
    for tokens in prompts:
        tree.insert(tokens)
    return tree


def run_sglang(policy: str, queue: Queue, repeats: int) -> Result:
    """SGLang's own RadixCache and SchedulePolicy, 128-request LPM cutoff lifted."""
    from feather_sched.bench.cht.sglang_policy import time_sglang_policy

    timing = time_sglang_policy(
        policy,
        [spec.prompt for spec in queue.waiting],
        [spec.prompt for spec in queue.running],
        repeats=repeats,
    )
    return Result(f"sglang-{policy}", *_cells(queue.scenario),
                  insert_us_per_request=timing.insert_us_per_request,
                  decision_ms=timing.decision_ms, batch_ms=timing.decision_ms,
                  bytes_per_request=None)


def runners(chunk_tokens: int, blocks_per_chunk: int) -> dict[str, Callable[[Queue, int], Result]]:
    """Each structure's measurement, by name."""

    def cht_blocks(queue: Queue, repeats: int) -> Result:
        # The engine hashed its blocks before scheduling: not the scheduler's cost.
        hashes = {s.request_id: engine_block_hashes(s.prompt)
                  for s in [*queue.waiting, *queue.running]}
        runner = ChtRunner(
            lambda s: block_chunk_keys(hashes[s.request_id], blocks_per_chunk), "cht-blocks")
        return runner.run(queue, repeats)

    def cht_tokens(queue: Queue, repeats: int) -> Result:
        runner = ChtRunner(lambda s: token_chunk_keys(s.prompt, chunk_tokens), "cht-tokens")
        return runner.run(queue, repeats)

    return {
        "cht-tokens": cht_tokens,
        "cht-blocks": cht_blocks,
        "radix-lpm": run_radix_lpm,
        "sglang-lpm": lambda q, r: run_sglang("lpm", q, r),
        "sglang-dfs-weight": lambda q, r: run_sglang("dfs-weight", q, r),
    }


def run_bench(
    scenarios: list[Scenario],
    structures: list[str],
    *,
    chunk_tokens: int,
    blocks_per_chunk: int,
    repeats: int,
    seed: int = 0,
) -> Iterator[Result]:
    """Measure each structure on each scenario's queue, yielding results as they come."""
    table = runners(chunk_tokens, blocks_per_chunk)
    unknown = sorted(set(structures) - set(table))
    if unknown:
        raise ValueError(f"unknown structures {unknown}; choose from {', '.join(STRUCTURES)}")
    for scenario in scenarios:
        queue = Queue.generate(scenario, seed)
        for name in structures:
            yield table[name](queue, repeats)
        del queue
        gc.collect()


def result_rows(results: list[Result]) -> list[dict]:
    return [asdict(result) for result in results]
