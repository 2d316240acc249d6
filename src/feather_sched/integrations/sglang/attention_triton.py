"""Shared-prefix decode inside SGLang 0.5.23's Triton backend (``--attention-backend
triton``), eager and under SGLang's decode CUDA graphs, the grouped rows by Feather's
Triton kernels (``attention.gpu_decode``).

SGLang's pool is read in place (``paged``: ``req_to_token[:, ::page]`` is the block
table): nothing is copied or allocated per step and no address changes, as a CUDA graph
needs.  Per decode step ``TritonStep.plan`` groups the rows and stages the groups; each
layer runs SGLang's decode over the batch with the grouped rows cut to one token, then
``GroupedDecode.run`` overwrites the grouped rows, merged exactly.

Cost: per step one or two syncs and the host grouping; per layer three launches (in the
graph where captured); ``GroupedDecode``'s workspace.  Where it cannot act SGLang's code
runs unchanged.  How it reads the pool, plans, and lives under graphs: docs/sglang.md,
"Inside SGLang's Triton backend".
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from feather_sched.attention.eligibility import TRITON_KERNEL
from feather_sched.attention.gpu_decode import DecodeLimits, GroupedDecode
from feather_sched.attention.groups import BySize, Groups, find_token_groups
from feather_sched.integrations.sglang.shared_decode import SharedPrefixDecode, announce
from feather_sched.integrations.sglang.stand_ins import prepare_sglang_import

prepare_sglang_import()  # before the first SGLang import (see stand_ins)

from sglang.srt.layers.attention.triton_backend import TritonAttnBackend  # noqa: E402

GRAPHED = "graphed"
"""``SharedPrefixDecode.step``'s plan for a batch being captured: its layers read what each
replay staged."""


def paged(buffer: torch.Tensor, page: int) -> torch.Tensor:
    """SGLang's K or V buffer ``[slots, kv_heads, head_dim]`` as ``[slots - page + 1, page,
    kv_heads, head_dim]``: block ``s`` is the ``page`` slots from slot ``s`` (overlapping
    windows, a view), so a page's first slot is its block id."""
    slots, heads, dim = buffer.shape
    step = buffer.stride()
    return buffer.as_strided((slots - page + 1, page, heads, dim),
                             (step[0], step[0], step[1], step[2]))


@dataclass(frozen=True)
class TritonStep:
    """A decode step's groups over SGLang's pool, staged into a ``GroupedDecode``."""

    groups: Groups
    """Batch rows; ``shared`` in pages."""
    cut_lens: torch.Tensor
    """The batch's sequence lengths (CPU int64) with every grouped row cut to 1 token."""

    @classmethod
    def plan(cls, decode: GroupedDecode, req_to_token: torch.Tensor,
             req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, page_size: int,
             min_shared_tokens: int, by_size: BySize = ()) -> TritonStep | None:
        """The step's groups staged into ``decode`` (block table rows: the pool rows), or
        None (nothing staged) where no rows share ``min_shared_tokens`` leading slots (and
        what ``by_size`` asks of their size).
        ``req_to_token`` and ``req_pool_indices`` on the pool's device, ``seq_lens`` CPU
        int (this step's token included).  Where two rows are longer than
        ``min_shared_tokens`` (a graph's padding rows are not), one device-to-host copy of
        two ints per row; where two of those start in one slot, one more of rows x longest
        row int32, then ``find_token_groups``."""
        long = seq_lens.numpy() > min_shared_tokens
        if np.count_nonzero(long) < 2:
            return None
        pool_rows, first_slots = torch.stack([req_pool_indices.to(req_to_token.dtype),
                                              req_to_token[req_pool_indices, 0]]).cpu().numpy()
        candidates = first_slots[long]
        if len(np.unique(candidates)) == len(candidates):
            return None
        width = -(-int(seq_lens.max()) // page_size) * page_size
        host = req_to_token[req_pool_indices, :width].cpu()
        rows = torch.arange(len(seq_lens))
        groups = find_token_groups(host, rows, seq_lens, page_size, min_shared_tokens,
                                   by_size)
        if not len(groups):
            return None
        groups = Groups(groups.rows, groups.offsets, groups.shared // page_size)
        lens = seq_lens.numpy()
        decode.stage(groups, lens, np.arange(len(lens)), page_size, pool_rows)
        cut = seq_lens.clone()
        cut[torch.from_numpy(groups.rows)] = 1
        return cls(groups, cut)

    def cut(self, forward_batch: Any) -> Any:
        """A shallow copy of ``forward_batch`` with the grouped rows cut to one token."""
        cut = copy.copy(forward_batch)
        cut.seq_lens = self.cut_lens.to(forward_batch.seq_lens.device,
                                        forward_batch.seq_lens.dtype)
        cut.seq_lens_cpu, cut.seq_lens_sum = self.cut_lens, int(self.cut_lens.sum())
        return cut


class SharedPrefixTritonBackend(SharedPrefixDecode, TritonAttnBackend):
    """SGLang's Triton backend with the shared-prefix decode (see the module docstring)."""

    forward_metadata: Any
    """``TritonAttnBackend``'s metadata of the step, swapped for the cut batch's."""

    def __init__(self, model_runner: Any, min_shared_tokens: int) -> None:
        super().__init__(model_runner, min_shared_tokens)
        device = torch.device(model_runner.device)
        sms = (torch.cuda.get_device_properties(device).multi_processor_count
               if device.type == "cuda" else 1)
        self.decode = GroupedDecode(DecodeLimits.for_device(
            sms, self.req_to_token_pool.size, self.num_head, self.num_kv_head,
            model_runner.model_config.head_dim), device)
        self.block_table = self.req_to_token[:, ::self.page_size]
        self.cut_metadata: Any = None
        self.graph_acts = True
        """Whether every layer captured in a decode graph took the path."""
        if device.type == "cuda":
            self._warm_up()

    kernel = TRITON_KERNEL

    def _warm_up(self) -> None:
        """Compile the three launches for the pool's dtype and layout, before serving and
        before any graph capture."""
        pool = self.token_to_kv_pool
        keys = pool.get_key_buffer(pool.start_layer)
        values = pool.get_value_buffer(pool.start_layer)
        query = keys.new_empty((1, self.num_head, keys.shape[-1]))
        self.decode.warm_up(query, paged(keys, self.page_size), paged(values, self.page_size),
                            self.block_table, torch.empty_like(query))

    def plan_rows(self, forward_batch: Any, seq_lens: torch.Tensor) -> TritonStep | None:
        return TritonStep.plan(self.decode, self.req_to_token, forward_batch.req_pool_indices,
                               seq_lens, self.page_size, self.min_shared_tokens,
                               self.by_size)

    def init_forward_metadata(self, forward_batch: Any) -> None:
        step = self.plan(forward_batch)
        if step is not None:
            TritonAttnBackend.init_forward_metadata(self, step.cut(forward_batch))
            cut = self.forward_metadata  # its kv_indptr is SGLang's one buffer: kept apart
            self.cut_metadata = dataclasses.replace(cut, kv_indptr=cut.kv_indptr.clone())
        TritonAttnBackend.init_forward_metadata(self, forward_batch)
        self.step = (forward_batch, step)

    def init_forward_metadata_out_graph(self, forward_batch: Any,
                                        in_capture: bool = False) -> None:
        step = None if in_capture or not self.graph_acts else self.plan(forward_batch)
        if step is None:
            self.decode.clear()
        super().init_forward_metadata_out_graph(
            forward_batch if step is None else step.cut(forward_batch), in_capture)
        if in_capture:
            self.step = (forward_batch, GRAPHED)

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any,
                       forward_batch: Any, save_kv_cache: bool = True,
                       **kwargs: Any) -> torch.Tensor:
        batch, step = self.step
        planned = step is not None and batch is forward_batch
        if not planned or kwargs.get("score_mod") is not None or \
                not self._acts(layer, q, kwargs.get("sinks")):
            if planned and step is GRAPHED and self.graph_acts:
                self.graph_acts = False
                announce(f"off under decode CUDA graphs: layer {layer.layer_id} cannot "
                         "take the path, and one graph serves every layer")
            return TritonAttnBackend.forward_decode(self, q, k, v, layer, forward_batch,
                                                    save_kv_cache, **kwargs)
        metadata = self.forward_metadata
        if step is not GRAPHED:
            self.forward_metadata = self.cut_metadata
        try:
            output = TritonAttnBackend.forward_decode(self, q, k, v, layer, forward_batch,
                                                      save_kv_cache, **kwargs)
        finally:
            self.forward_metadata = metadata
        heads, dim = layer.tp_q_head_num, layer.qk_head_dim
        pool, page = self.token_to_kv_pool, self.page_size
        self.decode.run(q.reshape(-1, heads, dim),
                        paged(pool.get_key_buffer(layer.layer_id), page),
                        paged(pool.get_value_buffer(layer.layer_id), page), self.block_table,
                        layer.scaling, output.view(-1, heads, dim))
        return output
