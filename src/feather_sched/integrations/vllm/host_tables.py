"""The block tables of vLLM's model runners (0.32-0.34), on the host: a step's groups are
found without reading the device (a device-to-host copy would wait for the GPU's queue and
end async scheduling's overlap).

``lookup`` takes an attention builder's ``block_table_tensor`` and returns the host table
holding the same block ids and the row of it each batch row reads, or None where the
tensor is no table known here (the caller then turns its path off; it never reads the
device instead).  Model Runner V2 keeps its tables on the device only: ``install`` wraps
its ``BlockTables`` so every staged write also lands in a host mirror.  The V1 runner
keeps a host copy beside each device table: ``note_v1`` records a runner's tables.

Cost: one host write per staged device write (V2); O(1) per lookup.  What each runner
does, and the tables not covered: docs/vllm.md, "Block tables on the host".
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, NamedTuple

import numpy as np
import torch

_PATCHED = "_feather_host_tables"
_MIRROR = "_feather_mirror"
_GATHERED = "_feather_gathered"
_V2_TABLES: weakref.WeakSet[Any] = weakref.WeakSet()
_V1_TABLES: weakref.WeakSet[Any] = weakref.WeakSet()


class HostRows(NamedTuple):
    """Where a step's block ids are on the host."""

    table: np.ndarray
    """int32 ``[table rows, width]``: the runner's table (live; read it during the step)."""
    rows: np.ndarray
    """int ``[num_reqs]``: the row of ``table`` that each batch row reads."""


def install() -> None:
    """Mirror Model Runner V2's block tables in this process (idempotent).

    Cost per MRV2 ``append_block_ids``: one numpy write per KV-cache group of the ids vLLM
    staged.  Memory: per ``BlockTables``, one ``max_num_reqs x max_num_blocks`` int32 table
    per KV-cache group (4 bytes a block id: 16 MiB at 512 requests x 128K tokens in
    16-token blocks), allocated at its first write, its pages resident only as rows are
    written.
    """
    from vllm.v1.worker.gpu.block_table import BlockTables

    if getattr(BlockTables.__init__, _PATCHED, False):
        return
    _wrap(BlockTables, "__init__", lambda tables, *_, **__: _V2_TABLES.add(tables))
    _wrap(BlockTables, "append_block_ids", _mirror_append)
    _wrap(BlockTables, "gather_block_tables", _note_gather)
    _wrap(BlockTables, "get_dummy_block_tables",
          lambda tables, *_, **__: setattr(tables, _GATHERED, False))


def note_v1(tables: Any) -> None:
    """Record the V1 runner's ``BlockTable`` objects (its ``MultiGroupBlockTable``'s)."""
    _V1_TABLES.update(tables.block_tables)


def seen_any() -> bool:
    """Whether any runner's tables are known here (before a runner's first step, a dummy
    run's table is no sign of a table Feather cannot see)."""
    return bool(_V2_TABLES) or bool(_V1_TABLES)


def lookup(block_table: torch.Tensor, req_idx: np.ndarray | None,
           num_reqs: int) -> HostRows | None:
    """The host table holding ``block_table``'s block ids and each of its first
    ``num_reqs`` batch rows' row in it; None where ``block_table`` is a view of no table
    known here, or of MRV2's input tables when they do not hold a gather of the slot
    tables (a dummy run), or MRV2 passed no ``req_idx``.  Exact on every column vLLM
    copied for the row (its allocated blocks; later columns may be stale on both sides).
    Cost: a few ``data_ptr`` reads per table known; no device access."""
    for tables in _V2_TABLES:
        for group, source in enumerate(tables.input_block_tables):
            if _first_row(block_table, source) is not None:
                if req_idx is None or not getattr(tables, _GATHERED, False):
                    return None
                return HostRows(_mirror(tables)[group], np.asarray(req_idx[:num_reqs]))
    for table in _V1_TABLES:
        first = _first_row(block_table, table.block_table.gpu)
        if first is not None:
            return HostRows(table.block_table.np, np.arange(first, first + num_reqs))
    return None


def known(block_table: torch.Tensor) -> bool:
    """Whether ``block_table`` is a view of a table known here (``lookup`` then gives
    None only for a dummy run or a missing ``req_idx``).  Cost as ``lookup``'s."""
    return any(_first_row(block_table, source) is not None
               for tables in _V2_TABLES for source in tables.input_block_tables) or any(
        _first_row(block_table, table.block_table.gpu) is not None for table in _V1_TABLES)


def _wrap(cls: type, name: str, after: Any) -> None:
    """``cls.name`` calls vLLM's original, then ``after`` with the same arguments."""
    original = getattr(cls, name)

    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        after(self, *args, **kwargs)
        return result

    setattr(wrapper, _PATCHED, True)
    setattr(cls, name, wrapper)


def _mirror(tables: Any) -> list[np.ndarray]:
    """The host mirror of ``tables``' per-slot tables, allocated on first use."""
    mirror = getattr(tables, _MIRROR, None)
    if mirror is None:
        mirror = [np.zeros(tuple(t.gpu.shape), dtype=np.int32) for t in tables.block_tables]
        setattr(tables, _MIRROR, mirror)
    return mirror


def _mirror_append(tables: Any, req_index: int, new_block_ids: tuple[list[int], ...],
                   overwrite: bool) -> None:
    """What ``append_block_ids`` just staged, into the mirror: each group's ids end at the
    row's new block count (``num_blocks``), from 0 with ``overwrite``; zeros (the null
    block) under ``redirect_writes_to_null_block``."""
    for group, table in enumerate(_mirror(tables)):
        ids = new_block_ids[group]
        end = int(tables.num_blocks.np[group, req_index])
        table[req_index, end - len(ids):end] = 0 if tables.redirect_writes_to_null_block else ids


def _note_gather(tables: Any, idx_mapping: torch.Tensor, num_reqs_padded: int,
                 out: tuple[torch.Tensor, ...] | None = None, *_: Any, **__: Any) -> None:
    if out is None:  # into input_block_tables, the tensors lookup knows
        setattr(tables, _GATHERED, True)


def _first_row(view: torch.Tensor, table: torch.Tensor) -> int | None:
    """The row of ``table`` where ``view`` (rows of it, leading columns) starts, or None
    where ``view`` is not such a view of ``table``."""
    if (view.dim() != 2 or view.dtype != table.dtype or view.device != table.device
            or view.shape[1] > table.shape[1] or view.stride(-1) != 1
            or (view.shape[0] > 1 and view.stride(0) != table.stride(0))):
        return None
    row_bytes = table.stride(0) * table.element_size()
    offset = view.data_ptr() - table.data_ptr()
    if offset < 0 or offset % row_bytes or offset // row_bytes + view.shape[0] > table.shape[0]:
        return None
    return offset // row_bytes
