"""Keep each prefix group contiguous in vLLM's V1 model runner's batch (a vLLM general plugin).

The decode-attention kernel walks the batch in order, so requests of one prefix group
placed back to back re-read their shared KV blocks while they are still in cache.
``FeatherScheduler`` keeps its running list ordered by prefix group; Model Runner V2 (the
GPU default) batches decodes in that order by itself, but the V1 runner (CPU, and GPU
modes V2 does not support) keeps a persistent batch that fills freed slots with whatever
request comes next, interleaving groups over time.  This module, registered as a
``vllm.general_plugins`` entry point (vLLM loads those in every process), wraps the V1
runner's ``_may_reorder_batch`` hook and gathers each group (rows sharing their first KV
block) where its first row stands, members in the scheduler's order
(``scheduler_output.num_scheduled_tokens``), moving no other row.  It acts only when the
engine runs ``FeatherScheduler`` with ``order_running`` on, and never under V2 (which
does not call the hook); requests stay in the decode/extend/prefill regions that
attention backends with a reorder threshold (e.g. FlashInfer, MLA) require.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from feather_sched.attention.groups import distinct

_PATCHED = "_feather_batch_order"


def register() -> None:
    """Entry point: wrap the GPU/CPU model runner's batch-reorder hook once per process."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner._may_reorder_batch
    if getattr(original, _PATCHED, False):
        return

    def _may_reorder_batch(self: Any, scheduler_output: Any) -> None:
        if _ordering_enabled(self):
            order_by_schedule(self.input_batch, scheduler_output, self.reorder_batch_threshold)
        original(self, scheduler_output)

    setattr(_may_reorder_batch, _PATCHED, True)
    GPUModelRunner._may_reorder_batch = _may_reorder_batch


def _ordering_enabled(runner: Any) -> bool:
    """Decided once per runner from the engine's own configuration, of which it reads only
    ``order_running``: a worker may run on a node without the scheduler's files, and the
    scheduler checks the rest."""
    enabled = getattr(runner, _PATCHED, None)
    if enabled is None:
        from feather_sched.core import FeatherConfig
        from feather_sched.integrations.vllm.scheduler import feather_mapping, is_feather_scheduler

        config = runner.vllm_config
        scheduler_cls = config.scheduler_config.get_scheduler_cls()
        enabled = is_feather_scheduler(scheduler_cls) and \
            FeatherConfig.option("order_running", feather_mapping(config))
        setattr(runner, _PATCHED, enabled)
    return enabled


def batch_regions(input_batch: Any, scheduler_output: Any, threshold: int | None) -> np.ndarray:
    """vLLM's reorder regions (0 decode, 1 short extend, 2 long extend, 3 prefill)."""
    num_reqs = input_batch.num_reqs
    if threshold is None:
        return np.zeros(num_reqs, dtype=np.int32)
    scheduled = np.array([scheduler_output.num_scheduled_tokens[r] for r in input_batch.req_ids])
    computed = input_batch.num_computed_tokens_cpu[:num_reqs]
    prompt = input_batch.num_prompt_tokens[:num_reqs]
    below = scheduled <= threshold
    regions = np.where(below & (computed < prompt), 1, 0)
    regions = np.where(~below, 2, regions)
    return np.where(computed == 0, 3, regions).astype(np.int32)


def order_by_schedule(input_batch: Any, scheduler_output: Any, threshold: int | None) -> int:
    """Make each prefix group contiguous with the fewest moves; returns the swaps made.

    A group is the rows whose first KV block is the same physical block (they share at
    least that much prefix).  Rows sort by (region, the slot of their group's first row,
    place in the scheduler's order): a group gathers at its first row, in the scheduler's
    order (which keeps subgroups together), and a row sharing nothing stays where it is.
    So a batch without sharing is never permuted (sorting it into the scheduler's order
    costs vLLM's CPU runner time: docs/results.md#batch-order), and an ordered one only as
    new members join.  O(rows log rows)
    plus a ``swap_states`` per move.
    """
    num_reqs = input_batch.num_reqs
    if num_reqs < 2:
        return 0
    first_blocks = input_batch.block_table[0].block_table.np[:num_reqs, 0]
    if distinct(first_blocks):
        return 0  # no row shares its first block: nothing to gather (vLLM's reorder follows)
    _, group = np.unique(first_blocks, return_inverse=True)
    anchor = np.full(group.max() + 1, num_reqs)
    np.minimum.at(anchor, group, np.arange(num_reqs))
    place = {rid: i for i, rid in enumerate(scheduler_output.num_scheduled_tokens)}
    scheduled = np.array([place[rid] for rid in input_batch.req_ids[:num_reqs]])
    regions = batch_regions(input_batch, scheduler_output, threshold)
    order = np.lexsort((scheduled, anchor[group], regions))
    return apply_order(input_batch, order.tolist())


def apply_order(input_batch: Any, order: list[int]) -> int:
    """Permute with ``swap_states`` so that slot i holds the request now at ``order[i]``."""
    position = list(range(len(order)))  # request (by old slot) -> its current slot
    occupant = list(range(len(order)))  # slot -> request (by old slot) now in it
    swaps = 0
    for target, request in enumerate(order):
        current = position[request]
        if current == target:
            continue
        input_batch.swap_states(current, target)
        displaced = occupant[target]
        occupant[target], occupant[current] = request, displaced
        position[request], position[displaced] = target, current
        swaps += 1
    return swaps
