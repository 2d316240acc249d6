"""The host mirror of Model Runner V2's block tables, and the lookup from a builder's block
table tensor, against vLLM 0.32's real classes on this CPU machine.

MRV2's ``BlockTables`` is built with device cpu; its UVA buffers want pinned memory, which
this machine lacks although vLLM's CPU platform reports UVA available, so vLLM's own
explicit-copy fallback (``NonUvaBuffer``) is selected by patching ``is_uva_available``.
In this process vLLM's Triton kernels cannot run (Triton has no CPU backend), so the
mirror is compared with vLLM's staged writes replayed onto a zero table, as its
``_apply_write_kernel`` applies them.  In a fresh process under TRITON_INTERPRET=1
(``test_against_vllms_kernels_in_the_triton_interpreter``) vLLM's own kernels run: its
``apply_staged_writes`` (the single-group and the fused multi-group writer) and its
``gather_block_tables``, and the mirror is compared with the device tables they wrote.
Not covered: a real GPU, and the model runners end to end (only the ``BlockTables`` calls
they make, in the order they make them).
"""

from __future__ import annotations

from importlib.util import find_spec
from types import SimpleNamespace

import numpy as np
import pytest
import torch

if find_spec("vllm") is None:
    pytest.skip("the vllm extra is not installed", allow_module_level=True)

from tests.helpers.triton_interpreter import (
    INTERPRETED,
    keep_vllm_triton_on,
    only_interpreted,
    run_interpreted,
)

if INTERPRETED:
    keep_vllm_triton_on()

from vllm.v1.worker.block_table import BlockTable
from vllm.v1.worker.gpu import buffer_utils
from vllm.v1.worker.gpu.block_table import BlockTables

from feather_sched.integrations.vllm import host_tables

MAX_REQS = 6
WIDTHS = (12, 5)
interpreted = only_interpreted("test_against_vllms_kernels_in_the_triton_interpreter")


@pytest.fixture
def make_tables(monkeypatch):
    monkeypatch.setattr(buffer_utils, "is_uva_available", lambda: False)
    host_tables.install()

    def make(groups: int) -> BlockTables:
        return BlockTables([16] * groups, max_num_reqs=MAX_REQS, max_num_batched_tokens=64,
                           max_num_blocks_per_group=list(WIDTHS[:groups]),
                           device=torch.device("cpu"))
    return make


def steps(groups: int) -> list[list[tuple]]:
    """The runner's calls, step by step: (slot, ids per group, overwrite), or "null" to
    toggle ``redirect_writes_to_null_block`` (elastic EP's warm-up)."""
    def ids(*per_group: list[int]) -> tuple[list[int], ...]:
        return per_group[:groups]
    return [
        [(3, ids([1, 2, 3, 4], [9]), True), (0, ids([1, 2, 5], [8, 7]), True)],  # new
        [(3, ids([6], [10]), False), (0, ids([], [11]), False)],  # appended blocks
        # slot 0 freed and reused by a shorter request (its old ids stay past its end); a
        # streaming re-add of slot 3's request into slot 5
        [(0, ids([20], []), True), (5, ids([1, 2, 3, 4, 6, 30], [9]), True)],
        ["null", (1, ids([40, 41], [42]), True), (5, ids([31], [43]), False), "null"],
        [(1, ids([44], [45]), False)],
    ]


def run_step(tables: BlockTables, step: list[tuple]) -> None:
    for call in step:
        if call == "null":
            tables.redirect_writes_to_null_block = not tables.redirect_writes_to_null_block
        else:
            slot, ids, overwrite = call
            tables.append_block_ids(slot, ids, overwrite=overwrite)


def replayed(tables: BlockTables, onto: list[np.ndarray]) -> None:
    """vLLM's staged writes, applied on the host as ``_apply_write_kernel`` applies them."""
    for staged, table in zip(tables.block_tables, onto, strict=True):
        contents, ends = staged._staged_write_contents, staged._staged_write_cu_lens
        for row, start, lo, hi in zip(staged._staged_write_indices,
                                      staged._staged_write_starts, [0, *ends[:-1]], ends,
                                      strict=True):
            table[row, start:start + hi - lo] = contents[lo:hi]
        staged.clear_staged_writes()


def mirror(tables: BlockTables) -> list[np.ndarray]:
    return getattr(tables, host_tables._MIRROR)


@pytest.mark.parametrize("groups", [1, 2])
def test_the_mirror_holds_what_vllm_staged(make_tables, groups):
    tables = make_tables(groups)
    expected = [np.zeros((MAX_REQS, w), dtype=np.int32) for w in WIDTHS[:groups]]
    for step in steps(groups):
        run_step(tables, step)
        replayed(tables, expected)
        for got, want in zip(mirror(tables), expected, strict=True):
            np.testing.assert_array_equal(got, want)
    assert mirror(tables)[0][1, :3].tolist() == [0, 0, 44]  # the null block, then real
    assert mirror(tables)[0][0, :4].tolist() == [20, 2, 5, 0]  # stale past its end


def test_install_is_idempotent(make_tables):
    wrapped = BlockTables.append_block_ids
    host_tables.install()
    assert BlockTables.append_block_ids is wrapped
    assert not hasattr(wrapped.__wrapped__, host_tables._PATCHED)  # vLLM's own beneath


def test_lookup_finds_the_v1_runners_host_copy(make_tables):
    table = BlockTable(16, MAX_REQS, 8, 64, pin_memory=False, device=torch.device("cpu"),
                       cp_kv_cache_interleave_size=1)
    assert host_tables.lookup(table.get_device_tensor(4), None, 3) is None  # not noted yet
    host_tables.note_v1(SimpleNamespace(block_tables=[table]))  # a runner's tables
    found = host_tables.lookup(table.get_device_tensor(4), None, 3)
    assert found.table is table.block_table.np and found.rows.tolist() == [0, 1, 2]
    found = host_tables.lookup(table.block_table.gpu[2:5], None, 2)
    assert found.rows.tolist() == [2, 3]


# vLLM's own kernels, in Triton's interpreter ----------------------------------------------


def test_against_vllms_kernels_in_the_triton_interpreter():
    if INTERPRETED:
        pytest.skip("this is that process")
    if find_spec("triton") is None:
        pytest.skip("needs Triton")
    result = run_interpreted(*(f"{__file__}::{name}" for name in (
        "test_the_mirror_equals_vllms_device_tables",
        "test_lookup_maps_the_input_tables_to_the_mirror_through_req_idx",
        "test_an_unknown_tensor_gives_none")))
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "4 passed" in result.stdout, result.stdout[-2000:]


@interpreted
@pytest.mark.parametrize("groups", [1, 2])
def test_the_mirror_equals_vllms_device_tables(make_tables, groups):
    """Step by step as the runner does: its writes, ``apply_staged_writes``, the gather;
    then the mirror equals each per-slot device table, and each batch row's allocated
    blocks in the input table are the mirror's at the row ``lookup`` gives."""
    tables = make_tables(groups)
    req_idx = np.array([5, 0, 3, 1])
    for step in steps(groups):
        run_step(tables, step)
        tables.apply_staged_writes()
        for got, device in zip(mirror(tables), tables.block_tables, strict=True):
            np.testing.assert_array_equal(got, device.gpu.numpy())
        tables.gather_block_tables(torch.from_numpy(req_idx), len(req_idx) + 1)
        for group, device in enumerate(tables.input_block_tables):
            found = host_tables.lookup(device[:len(req_idx) + 1], req_idx, len(req_idx))
            assert found.table is mirror(tables)[group]
            for row, slot in enumerate(found.rows):
                n = tables.num_blocks.np[group, slot]
                np.testing.assert_array_equal(found.table[slot, :n], device[row, :n].numpy())


@interpreted
def test_lookup_maps_the_input_tables_to_the_mirror_through_req_idx(make_tables):
    tables = make_tables(2)
    for step in steps(2):
        run_step(tables, step)
    req_idx = np.array([5, 0, 3])
    view = tables.input_block_tables[1][:4]  # padded to 4 rows, as vLLM hands it over
    assert host_tables.lookup(view, req_idx, 3) is None  # no gather yet
    tables.gather_block_tables(torch.from_numpy(req_idx), 4)
    found = host_tables.lookup(view, req_idx, 3)
    assert found.table is mirror(tables)[1] and found.rows.tolist() == [5, 0, 3]
    micro = host_tables.lookup(tables.input_block_tables[0][2:4], req_idx[2:], 1)
    assert micro.table is mirror(tables)[0] and micro.rows.tolist() == [3]  # a microbatch
    assert host_tables.lookup(view, None, 3) is None
    tables.get_dummy_block_tables(3)  # a dummy run zeroes the rows the builder reads
    assert host_tables.lookup(view, req_idx, 3) is None


@interpreted
def test_an_unknown_tensor_gives_none(make_tables):
    tables = make_tables(1)
    tables.gather_block_tables(torch.zeros(1, dtype=torch.int64), 1)
    source = tables.input_block_tables[0]
    for tensor in (source.clone(), source[:, 1:], source.t(), source.to(torch.int64),
                   torch.zeros(2, 3, dtype=torch.int32)):
        assert host_tables.lookup(tensor, np.zeros(1, dtype=np.intp), 1) is None
