"""Shared-prefix decode whose launches can be captured in a CUDA graph (vLLM's FULL decode
graphs) and replayed for any step's groups.

A graph replays the launches it captured, so everything a step changes lives in device
buffers allocated once (``GroupedDecode``): ``stage`` turns a step's groups into them
(one host-to-device copy, outside any graph); ``run`` makes only launches fixed by the
engine's limits (``DecodeLimits``), every program past the step's live counts returning
at once.  ``run`` never reads device memory on the host, allocates nothing and branches
on nothing the step sets; nothing it launches compiles after ``warm_up``.

The work is ``triton_kernels``'s: one attend launch over the groups' prefixes (a large
group over several segments), one over each grouped row's suffix, each writing fp32
partials and LSE into one fixed workspace, then one merge into the output rows.
Engine-agnostic: torch and numpy here, Triton on the first launch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from feather_sched.attention import triton_kernels as tk
from feather_sched.attention.groups import MIN_ROWS, Groups

PROGRAMS_PER_SM = 4
"""Programs per SM a launch of ``DecodeLimits.for_device`` has (two waves at the two
resident programs per SM the attend kernel's registers allow)."""
WORKSPACE_BYTES = 128 << 20
"""Default budget of ``DecodeLimits.for_device`` for the partials workspace."""
_ALIGN = 4
"""int32 elements per 16 bytes: every index view and workspace slice starts on a multiple,
so no pointer's alignment (which Triton specialises on) depends on a step or a launch."""


@dataclass(frozen=True)
class DecodeLimits:
    """Sizes fixed for an engine's life; every launch grid and buffer follows from them.

    ``max_rows``: grouped rows per step at most (the engine's ``max_num_seqs``);
    ``prefix_splits``/``suffix_splits``: token splits of every prefix/suffix segment
    (flash-decoding's split-K, 1..``triton_kernels.MAX_SPLITS``): a range is cut into that
    many pieces of whole 64-token tiles (32 above head_dim 128), so a range shorter than
    the splits leaves pieces empty (LSE -inf, a program that stores zeros and stops).
    """

    max_rows: int
    q_heads: int
    kv_heads: int
    head_dim: int
    prefix_splits: int = 1
    suffix_splits: int = 1
    programs: int = 0
    """About how many programs each launch has (0: one per segment or row, the most a step
    can have): live segments and rows are strided over them, so a step with little or no
    work costs a launch of this many programs, not a wave per possible segment."""

    def __post_init__(self) -> None:
        if not 1 <= self.max_rows <= 65535 or min(self.q_heads, self.kv_heads) < 1:
            raise ValueError("max_rows 1..65535 (a CUDA grid dimension); heads positive")
        if self.q_heads % self.kv_heads or not tk.head_size_fits(self.head_dim):
            raise ValueError(f"{self.q_heads} query heads, {self.kv_heads} KV heads, head_dim "
                             f"{self.head_dim}: q_heads a multiple of kv_heads, head_dim a "
                             "power of two >= 16")
        if not all(1 <= s <= tk.MAX_SPLITS for s in (self.prefix_splits, self.suffix_splits)):
            raise ValueError(f"splits 1..{tk.MAX_SPLITS}")

    @classmethod
    def for_device(cls, num_sms: int, max_rows: int, q_heads: int, kv_heads: int,
                   head_dim: int, workspace_bytes: int = WORKSPACE_BYTES) -> DecodeLimits:
        """Limits with splits for a GPU of ``num_sms`` SMs: about two programs per SM from
        one prefix segment (one group of up to ``members_per_segment`` rows, the grid a
        prefix cannot otherwise fill) and from the suffixes of ``max_rows`` rows, at most
        ``MAX_SPLITS`` each; then fewer prefix splits, then fewer suffix splits, until the
        workspace fits ``workspace_bytes`` (one split each even where it does not).

        The workspace is fp32 partials (prefix_splits + suffix_splits) x max_rows x q_heads
        x head_dim x 4 bytes plus their LSE, (prefix_splits + suffix_splits) x max_rows x
        q_heads x 4 bytes (max_rows rounded up to a multiple of 4): ``workspace_bytes``."""
        base = cls(max_rows, q_heads, kv_heads, head_dim)
        target = 2 * num_sms
        prefix = min(tk.MAX_SPLITS, tk._cdiv(target, kv_heads * base.tiles[0]))
        suffix = min(tk.MAX_SPLITS, tk._cdiv(target, kv_heads * base.tiles[1] * max_rows))
        fits = max(2, workspace_bytes // (base.workspace_bytes // 2))  # base: 2 splits
        prefix = max(1, min(prefix, fits - suffix))
        suffix = max(1, min(suffix, fits - prefix))
        return cls(max_rows, q_heads, kv_heads, head_dim, prefix, suffix,
                   programs=PROGRAMS_PER_SM * num_sms)

    @property
    def gqa(self) -> int:
        return self.q_heads // self.kv_heads

    @property
    def members_per_segment(self) -> int:
        """K: grouped rows of one prefix segment, as many as one program tile holds (64
        query rows, 32 above head_dim 128, over ``gqa`` heads each), at least 1."""
        return max(1, tk._tile_limits(self.head_dim)[0] // self.gqa)

    @property
    def max_segments(self) -> int:
        """Prefix segments of a step at most: a group of s >= ``MIN_ROWS`` rows takes
        ceil(s / K) segments, so at most ``max_rows`` x max_s ceil(s / K) / s, whose largest
        value is at s = ``MIN_ROWS`` or K + 1."""
        k = self.members_per_segment
        return max(self.max_rows * -(-s // k) // s
                   for s in range(MIN_ROWS, max(MIN_ROWS, k + 1) + 1))

    @property
    def tiles(self) -> tuple[int, int]:
        """Program tiles per prefix segment and per suffix segment (1 unless gqa > 64)."""
        return self.tiling(self.members_per_segment)[1], self.tiling(1)[1]

    def tiling(self, members: int) -> tuple[int, int]:
        """(BLOCK_Q, tiles) of segments of ``members`` rows."""
        return tk.row_tiles(members, self.gqa, self.head_dim)

    @property
    def workspace_rows(self) -> int:
        """Rows of each split of the workspace: ``max_rows`` rounded up to ``_ALIGN``."""
        return _aligned(self.max_rows)

    @property
    def grids(self) -> tuple[int, int, int]:
        """The programs of the prefix and suffix launches' last grid dimension and of the
        merge: one per segment or row, or about ``programs`` per launch in all."""
        if not self.programs:
            return self.max_segments, self.max_rows, self.workspace_rows
        per_prefix = self.kv_heads * self.tiles[0] * self.prefix_splits
        per_suffix = self.kv_heads * self.tiles[1] * self.suffix_splits
        return (min(self.max_segments, -(-self.programs // per_prefix)),
                min(self.max_rows, -(-self.programs // per_suffix)),
                min(self.workspace_rows, self.programs))

    @property
    def workspace_bytes(self) -> int:
        """Bytes of the fp32 partials and LSE workspace."""
        splits = self.prefix_splits + self.suffix_splits
        return splits * self.workspace_rows * self.q_heads * (self.head_dim + 1) * 4


def _aligned(elements: int) -> int:
    return -(-elements // _ALIGN) * _ALIGN


def variants(limits: DecodeLimits, dtype: torch.dtype, block_size: int
             ) -> dict[str, dict[str, Any]]:
    """The constexprs of each launch ``run`` makes for this dtype and KV block size:
    ``prefix`` and ``suffix`` (``attend``: by member value, query through the grouped
    rows' tokens, live-count exit; they differ only in BLOCK_Q, so they share one compile
    where their tiles match) and ``merge``. With the engine's fixed strides these are the
    only compiles: at most three per dtype."""
    constants = {name: tk.attend_constants(dtype, limits.kv_heads, limits.gqa,
                                           limits.head_dim, block_size,
                                           limits.tiling(members)[0], query_rows=True,
                                           has_count=True)
                 for name, members in (("prefix", limits.members_per_segment), ("suffix", 1))}
    constants["merge"] = tk.merge_constants(limits.q_heads, limits.head_dim, has_rows=True,
                                            has_lse=False, has_count=True)
    return constants


class GroupedDecode:
    """Device buffers for one engine's grouped decode, allocated once, and the launches
    over them.

    ``stage`` writes a step's groups (host work, one copy), ``clear`` stages none, ``run``
    makes the step's launches, the same whatever was staged (so a graph captured once
    replays any step). Call ``stage``/``clear`` and ``run`` (or the replay) on one CUDA
    stream: the copy is ordered before the launches that read it, and after the launches
    of the step before.

    Memory: ``limits.workspace_bytes`` of fp32 workspace; a staged int32 index buffer of
    about (2 + K) x ``max_segments`` + 5 x ``max_rows`` elements, on the device and twice
    in pinned host memory (one staging buffer refilled while the other's copy may still be
    in flight); constants of ``max_segments`` + ``max_rows`` on the device.
    """

    def __init__(self, limits: DecodeLimits, device: torch.device | str) -> None:
        self.limits = limits
        self.device = torch.device(device)
        rows, segments, k = limits.max_rows, limits.max_segments, limits.members_per_segment
        sizes = {"row_count": 1, "segment_count": 1, "tokens": rows,
                 "prefix_rows": segments, "prefix_lengths": segments,
                 "prefix_members": segments * k, "suffix_rows": rows, "suffix_starts": rows,
                 "suffix_lengths": rows, "batch_rows": rows}
        self._spans, end = {}, 0
        for name, size in sizes.items():
            self._spans[name] = (end, size)
            end += _aligned(size)
        pinned = self.device.type == "cuda"
        self._index = torch.zeros(end, dtype=torch.int32, device=self.device)
        self._staging = [torch.zeros(end, dtype=torch.int32, pin_memory=pinned)
                         for _ in range(2)]
        self._host = [self._views(buffer.numpy()) for buffer in self._staging]
        self._copied = [torch.cuda.Event() for _ in range(2)] if pinned else None
        self._turn = 0
        device_views = self._views(self._index)
        self._counts = device_views["row_count"], device_views["segment_count"]
        self._tokens = device_views["tokens"]
        # Constant: prefixes start at token 0; suffix segment i is grouped row i.
        fixed = torch.zeros(_aligned(segments) + rows, dtype=torch.int32, device=self.device)
        fixed[_aligned(segments):] = torch.arange(rows, dtype=torch.int32)
        self._prefix = tk.TableSegments(device_views["prefix_rows"], fixed[:segments],
                                        device_views["prefix_lengths"],
                                        device_views["prefix_members"].view(segments, k))
        self._suffix = tk.TableSegments(device_views["suffix_rows"], device_views["suffix_starts"],
                                        device_views["suffix_lengths"],
                                        fixed[_aligned(segments):, None])
        splits = limits.prefix_splits + limits.suffix_splits
        shape = (splits, limits.workspace_rows, limits.q_heads)
        self._parts = torch.empty(*shape, limits.head_dim, dtype=torch.float32,
                                  device=self.device)
        self._lse = torch.empty(shape, dtype=torch.float32, device=self.device)
        self._split_parts = self._parts.split([limits.prefix_splits, limits.suffix_splits])
        self._split_lse = self._lse.split([limits.prefix_splits, limits.suffix_splits])
        self._checked: tuple[Any, ...] | None = None
        self._cut_rows = (device_views["batch_rows"],
                          torch.arange(rows, dtype=torch.int32, device=self.device))
        self.device_bytes = sum(t.nbytes for t in (self._index, fixed, self._parts, self._lse,
                                                   self._cut_rows[1]))
        """Device memory the buffers hold (the workspace, the index and its constants)."""
        self.host_bytes = sum(t.nbytes for t in self._staging)
        """Host memory the buffers hold (the two staging buffers, pinned on a GPU)."""

    def _views(self, flat: Any) -> dict[str, Any]:
        """Each part of a flat index buffer (a tensor or its numpy view)."""
        return {name: flat[start:start + size] for name, (start, size) in self._spans.items()}

    def stage(self, groups: Groups, seq_lens: np.ndarray, query_starts: np.ndarray,
              block_size: int, table_rows: np.ndarray | None = None) -> None:
        """Make the next ``run`` (or replay) compute ``groups``: the batch's grouped rows
        over their shared prefixes and their own suffixes.

        ``seq_lens`` (tokens including this step's) and ``query_starts`` (first query token)
        per batch row, as ``find_groups`` saw them; ``table_rows``: each batch row's row of
        the block table ``run`` reads (default: the batch row itself; SGLang's
        ``req_to_token`` is indexed by pool row). Raises ValueError, staging nothing, if
        the step has more grouped rows or prefix segments than the limits. Host work
        O(grouped rows), then one non-blocking copy of the whole index buffer."""
        limits, k = self.limits, self.limits.members_per_segment
        rows, sizes = groups.rows, groups.sizes()
        per_group = -(-sizes // k)
        count = int(per_group.sum())
        if len(rows) > limits.max_rows or count > limits.max_segments:
            raise ValueError(f"{len(rows)} grouped rows in {count} prefix segments: the "
                             f"limits are {limits.max_rows} and {limits.max_segments}")
        host, n = self._next_staging(), len(rows)
        host["row_count"][0], host["segment_count"][0] = n, count
        host["tokens"][:n] = np.asarray(query_starts)[rows]
        group = np.repeat(np.arange(len(groups)), per_group)
        nth = np.arange(count) - np.repeat(np.cumsum(per_group) - per_group, per_group)
        first = groups.offsets[:-1][group] + nth * k
        members = first[:, None] + np.arange(k)
        members[members >= groups.offsets[1:][group][:, None]] = -1
        tables = rows if table_rows is None else np.asarray(table_rows)[rows]
        host["prefix_rows"][:count] = tables[groups.offsets[:-1]][group]
        host["prefix_lengths"][:count] = groups.shared[group] * block_size
        host["prefix_members"][:count * k] = members.ravel()
        starts = groups.row_shared() * block_size
        host["suffix_rows"][:n] = tables
        host["suffix_starts"][:n] = starts
        host["suffix_lengths"][:n] = np.asarray(seq_lens)[rows] - starts
        host["batch_rows"][:n] = rows
        self._upload(self._index.numel())

    def clear(self) -> None:
        """Stage no work: a following ``run`` or replay writes nothing. Copies 32 bytes."""
        host = self._next_staging()
        host["row_count"][0] = host["segment_count"][0] = 0
        self._upload(self._spans["tokens"][0])

    def _next_staging(self) -> dict[str, np.ndarray]:
        """The parts of the staging buffer to fill, once its last copy has finished (long
        since, but the host may run a step ahead of the device)."""
        if self._copied is not None:
            self._copied[self._turn].synchronize()
        return self._host[self._turn]

    def _upload(self, elements: int) -> None:
        """Copy the first ``elements`` of the filled staging buffer to the device."""
        self._index[:elements].copy_(self._staging[self._turn][:elements], non_blocking=True)
        if self._copied is not None:
            self._copied[self._turn].record()
        self._turn ^= 1

    def cut_seq_lens(self, seq_lens: Tensor, out: Tensor) -> Tensor:
        """``out[:n]`` = the engine's ``seq_lens`` (int32 ``[n]``, on the device) with every
        staged grouped row cut to 1 token (the engine's kernel then spends next to nothing
        on rows whose outputs ``run`` replaces), returned; ``out`` int32 with more than
        ``max(n, max_rows)`` elements, its last one scratch. Device work only (a copy and an
        index fill): no host read, the same launches whatever was staged, so a graph that
        reads ``out`` sees each step's cut."""
        staged, position = self._cut_rows
        target = torch.where(position < self._counts[0], staged, out.shape[0] - 1).long()
        out[:seq_lens.shape[0]].copy_(seq_lens)
        return out.index_fill_(0, target, 1)[:seq_lens.shape[0]]

    def run(self, query: Tensor, key_cache: Tensor, value_cache: Tensor, block_table: Tensor,
            scale: float, output: Tensor) -> None:
        """Overwrite the staged grouped rows of ``output`` with their attention over
        ``block_table``: each prefix segment attended once for its rows, each row's suffix,
        merged exactly by LSE in fp32 and cast once; every other row is left as it is.

        query and output ``[tokens, q_heads, head_dim]`` (any strides; the staged tokens
        must be rows of them), caches of query's dtype (bf16, fp16 or fp32) ``[blocks,
        block_size, kv_heads, head_dim]`` (any strides), block_table int32 ``[rows, cols]``
        holding the staged rows. The layout is checked when it changes (the first call,
        or another dtype or strides); each call after: three launches, no host read, no
        allocation. Capturable in a CUDA graph.

        Cost: prefix programs (KV heads x splits x ``max_segments``) and suffix programs (KV
        heads x splits x ``max_rows``) past the live counts load one int and return;
        live ones read their segment's K and V once (the prefix once per K rows), and write
        BLOCK_Q x head_dim fp32 per split; the merge reads each row's live parts."""
        layout = (query.dtype, query.stride(), key_cache.shape[1:], key_cache.stride(),
                  value_cache.stride(), block_table.stride(), output.stride())
        if layout != self._checked:
            self._check(query, key_cache, value_cache, block_table, output)
            self._checked = layout
        rows, (prefix, suffix, merge) = self._tokens, self.limits.grids
        for segments, parts, lse, count, programs in zip(
                (self._prefix, self._suffix), self._split_parts, self._split_lse,
                self._counts[::-1], (prefix, suffix), strict=True):
            tk._launch_attend(query, key_cache, value_cache, block_table, segments, scale,
                              parts, lse, query_rows=rows, count=count, programs=programs)
        tk._launch_merge(self._parts, self._lse, output, None, rows, self._counts[0], merge)

    def _check(self, query: Tensor, key_cache: Tensor, value_cache: Tensor,
               block_table: Tensor, output: Tensor) -> None:
        limits = self.limits
        expected = (limits.q_heads, limits.head_dim)
        if (tuple(query.shape[1:]) != expected or tuple(output.shape[1:]) != expected
                or key_cache.shape[2:] != (limits.kv_heads, limits.head_dim)):
            raise ValueError(f"query {tuple(query.shape)}, output {tuple(output.shape)}, "
                             f"caches {tuple(key_cache.shape)}: not the limits' heads "
                             f"{limits.q_heads}/{limits.kv_heads}, head_dim {limits.head_dim}")
        if any(t.device != self.device for t in (query, key_cache, value_cache, block_table,
                                                  output)):
            raise ValueError(f"tensors must be on {self.device}")
        tk._check(query, key_cache, value_cache, block_table, self._prefix,
                  self._split_parts[0], self._split_lse[0])

    def warm_up(self, query: Tensor, key_cache: Tensor, value_cache: Tensor,
                block_table: Tensor, output: Tensor) -> None:
        """Compile what ``run`` launches for these tensors' dtype and layout (``variants``:
        the prefix and suffix attends, the merge), by running with no work staged: the
        engine's own tensors or any of their dtype, shapes past the first dimension and
        strides. Leaves the decode cleared; writes nothing. Call before serving (before
        capture), once per dtype."""
        self.clear()
        self.run(query, key_cache, value_cache, block_table, 1.0, output)
