"""Keep each prefix group contiguous in vLLM's V1 model runner's batch (vLLM 0.32, 0.33).

The decode-attention kernel walks the batch in order, so requests of one prefix group
placed back to back re-read their shared KV blocks while they are still in cache.  Model
Runner V2 batches decodes in the scheduler's order by itself; the V1 runner keeps a
persistent batch that fills freed slots with whatever request comes next.

``install`` (run by the plug-in ``plugins.register_batch_order`` when vLLM imports the V1
runner) wraps the runner's ``_may_reorder_batch`` hook.  For a runner whose engine did not
choose Feather the wrapper only calls vLLM's hook (decided once per runner).  For one that
did, it records the runner's block tables on the host (``host_tables.note_v1``) and, with
``order_running`` on, gathers each group where its first row stands, members in the
scheduler's order, moving no other row and keeping the decode/extend/prefill regions
that some attention backends require.  docs/vllm.md, "Batch order".
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from feather_sched.attention.groups import distinct
from feather_sched.integrations.vllm import host_tables
from feather_sched.integrations.vllm.choice import feather_scheduler, worker_option

_PATCHED = "_feather_batch_order"


def install(runner_module: ModuleType) -> None:
    """Wrap ``runner_module.GPUModelRunner._may_reorder_batch`` once per process."""
    runner_cls = runner_module.GPUModelRunner
    original = runner_cls._may_reorder_batch
    if getattr(original, _PATCHED, False):
        return

    def _may_reorder_batch(self: Any, scheduler_output: Any) -> None:
        feather = _feather_runner(self)
        if feather is not None:
            host_tables.note_v1(self.input_batch.block_table)
            if feather:
                order_by_schedule(self.input_batch, scheduler_output,
                                  self.reorder_batch_threshold)
        original(self, scheduler_output)

    setattr(_may_reorder_batch, _PATCHED, True)
    runner_cls._may_reorder_batch = _may_reorder_batch


def _feather_runner(runner: Any) -> bool | None:
    """None where the runner's engine did not choose Feather's scheduler, else whether it
    orders its batch (``order_running``); decided once per runner, reading only that
    option (a worker may run on a node without the scheduler's files, and the scheduler
    checks the rest; a bad value leaves the batch as vLLM orders it)."""
    if hasattr(runner, _PATCHED):
        return getattr(runner, _PATCHED)
    enabled = None
    if feather_scheduler(runner.vllm_config):
        try:
            enabled = bool(worker_option(runner.vllm_config, "order_running"))
        except ValueError:
            enabled = False
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
