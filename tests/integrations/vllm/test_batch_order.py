"""Batch ordering by prefix group: the permutation, and its effect in the real engine."""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import ClassVar

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from feather_sched.integrations.vllm.batch_order import apply_order, order_by_schedule


class ListBatch:
    def __init__(self, items: list[int]) -> None:
        self.items = list(items)

    def swap_states(self, i: int, j: int) -> None:
        self.items[i], self.items[j] = self.items[j], self.items[i]


@given(st.permutations(list(range(12))))
def test_apply_order_realises_any_permutation(order: list[int]) -> None:
    batch = ListBatch([f"req{i}" for i in range(12)])
    swaps = apply_order(batch, order)
    assert batch.items == [f"req{i}" for i in order]
    assert swaps <= 11


def test_apply_order_makes_no_swap_when_sorted() -> None:
    assert apply_order(ListBatch([1, 2, 3]), [0, 1, 2]) == 0


class RowsBatch:
    """The parts of vLLM's InputBatch the ordering reads: request ids and first KV blocks
    per slot, swapped together."""

    def __init__(self, rows: list[tuple[str, int]]) -> None:
        self.req_ids = [rid for rid, _ in rows]
        self.first = np.array([[block] for _, block in rows])
        self.block_table = [SimpleNamespace(block_table=SimpleNamespace(np=self.first))]
        self.num_reqs = len(rows)

    def swap_states(self, i: int, j: int) -> None:
        self.req_ids[i], self.req_ids[j] = self.req_ids[j], self.req_ids[i]
        self.first[[i, j]] = self.first[[j, i]]


def scheduled(*request_ids: str) -> SimpleNamespace:
    return SimpleNamespace(num_scheduled_tokens=dict.fromkeys(request_ids, 1))


def test_rows_sharing_nothing_are_never_moved() -> None:
    batch = RowsBatch([("c", 30), ("a", 10), ("b", 20)])
    assert order_by_schedule(batch, scheduled("a", "b", "c"), None) == 0
    assert batch.req_ids == ["c", "a", "b"]


def test_a_group_gathers_at_its_first_row_in_the_schedulers_order() -> None:
    batch = RowsBatch([("x", 9), ("g2", 5), ("y", 8), ("g1", 5), ("z", 7), ("g3", 5)])
    order_by_schedule(batch, scheduled("g1", "g2", "g3", "x", "y", "z"), None)
    assert batch.req_ids == ["x", "g1", "g2", "g3", "y", "z"]
    assert order_by_schedule(batch, scheduled("g1", "g2", "g3", "x", "y", "z"), None) == 0


os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
pytest.importorskip("vllm", reason="the vllm extra is not installed")

from tests.integrations.vllm.test_engine import (  # noqa: E402
    RecordingScheduler,
    group_prompts,
    make_llm,
    run_to_completion,
)


def runner_of(llm):
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


class OrderWatcher(RecordingScheduler):
    """Snapshots the worker's batch order (first KV block per slot) after every step."""

    runner = None
    orders: ClassVar[list[list[int]]] = []

    def update_from_output(self, scheduler_output, model_runner_output):
        batch = OrderWatcher.runner.input_batch
        blocks = batch.block_table[0].block_table.np[: batch.num_reqs, 0].tolist()
        OrderWatcher.orders.append(blocks)
        return super().update_from_output(scheduler_output, model_runner_output)


def group_runs(order: list[int]) -> int:
    """How many runs of equal first blocks: one per group when ordered."""
    return sum(1 for i, block in enumerate(order) if i == 0 or block != order[i - 1])


@pytest.mark.parametrize("ordered", [True, False])
def test_running_batch_is_kept_ordered_by_group(ordered: bool) -> None:
    llm = make_llm(OrderWatcher, {"gate": "always", "order_running": ordered})
    OrderWatcher.runner, OrderWatcher.orders = runner_of(llm), []
    pairs = group_prompts(groups=3, per_group=4, seed=5)
    # Every other request stops early; vLLM moves the batch's tail into the freed slots,
    # which interleaves the groups that remain.
    lengths = [3 if i % 2 else 16 for i in range(len(pairs))]
    run_to_completion(llm, [p for _, p in pairs], max_tokens=lengths)
    last = OrderWatcher.orders[-2]
    assert len(last) == lengths.count(16)
    groups, runs = len(set(last)), group_runs(last)
    if ordered:
        assert runs == groups
    else:
        assert runs > groups


@pytest.mark.parametrize("ordered", [True, False])
def test_a_worker_reads_only_whether_to_order(tmp_path, ordered: bool) -> None:
    """A worker on another node than the scheduler: the scheduler's files and their
    directory exist only on the scheduler's node.  The worker plugin decides from
    ``order_running`` alone; the scheduler still checks its files where it runs."""
    from vllm.engine.arg_utils import EngineArgs

    from feather_sched.core.config import FILE_OPTIONS, FeatherConfigError
    from feather_sched.integrations.vllm.batch_order import _feather_runner
    from feather_sched.integrations.vllm.scheduler import FeatherScheduler, feather_options
    from feather_sched.models import TINY_LLAMA

    head_node_only = tmp_path / "head-node-only"
    feather = {"gate": "bandit", "order_running": ordered,
               **{option: str(head_node_only / f"{option}.out") for option in FILE_OPTIONS}}
    config = EngineArgs(model=str(TINY_LLAMA), skip_tokenizer_init=True, load_format="dummy",
                        max_model_len=2048, scheduler_cls=FeatherScheduler,
                        additional_config={"feather": feather}).create_engine_config()
    assert _feather_runner(SimpleNamespace(vllm_config=config)) is ordered
    with pytest.raises(FeatherConfigError, match=f"directory {head_node_only} does not exist"):
        feather_options(config)
