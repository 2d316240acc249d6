"""Shared-prefix decode inside SGLang 0.5.23's Triton backend (``--attention-backend
triton``), the grouped rows by Feather's Triton kernels (``attention.gpu_decode``).

Per decode step (``init_forward_metadata``, a plain decode batch): the step's rows of
``req_to_token`` (through ``req_pool_indices``, up to the longest row) are copied to the
host once and grouped (``groups.find_token_groups``: identical leading slots, whole pages),
and the groups staged into ``GroupedDecode`` with pages as its blocks (``TritonStep``);
SGLang's metadata (``kv_indptr``/``kv_indices``, its KV splits) is built twice, for the
batch and for the batch with the grouped rows cut to one token.  Each layer then runs
SGLang's own decode kernel (``decode_attention_fwd``) over the cut metadata and
``TritonStep.attend`` overwrites the grouped rows: each group's prefix read once for all
its queries and each row's suffix, merged exactly (natural-log LSE, fp32 partials).  The
block table is the rows' ``req_to_token`` at every page's first slot, divided by the page
size; SGLang's K/V buffers ``[slots, kv_heads, head_dim]`` are read as ``[slots / page,
page, kv_heads, head_dim]``.

Cost per step, where the batch has rows sharing a first slot: one device-to-host copy of
rows x longest-row int32 (a sync), the host grouping (``find_token_groups``), one staging
copy and SGLang's metadata built a second time; per layer, three launches.  Where it cannot
act SGLang's code runs unchanged: decode CUDA graphs (the groups are host work per step,
which a replayed graph skips: ``--cuda-graph-backend-decode disabled`` keeps them), and the
layer features ``attention.SharedPrefixDecode`` names.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from feather_sched.attention.gpu_decode import DecodeLimits, GroupedDecode
from feather_sched.attention.groups import Groups, find_token_groups
from feather_sched.integrations.sglang.attention import SharedPrefixDecode, announce
from feather_sched.integrations.sglang.stand_ins import prepare_sglang_import

prepare_sglang_import()  # before the first SGLang import (see stand_ins)

from sglang.srt.layers.attention.triton_backend import TritonAttnBackend  # noqa: E402


@dataclass(frozen=True)
class TritonStep:
    """A decode step's groups over SGLang's pool, staged into a ``GroupedDecode``."""

    groups: Groups
    """Batch rows; ``shared`` in pages."""
    cut_lens: torch.Tensor
    """The batch's sequence lengths (CPU int64) with every grouped row cut to 1 token."""
    block_table: torch.Tensor
    """int32 ``[rows, pages]`` on the pool's device: each batch row's page ids."""
    page_size: int

    @classmethod
    def plan(cls, decode: GroupedDecode, req_to_token: torch.Tensor,
             req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, page_size: int,
             min_shared_tokens: int) -> TritonStep | None:
        """The step's groups staged into ``decode``, or None (nothing staged) where no rows
        share ``min_shared_tokens`` leading slots.  ``req_to_token`` and
        ``req_pool_indices`` on the pool's device, ``seq_lens`` CPU int (this step's token
        included).  O(rows x longest row) copied to the host, then ``find_token_groups``."""
        width = -(-int(seq_lens.max()) // page_size) * page_size
        slots = req_to_token[req_pool_indices, :width]
        host = slots.cpu()
        rows = torch.arange(len(seq_lens))
        groups = find_token_groups(host, rows, seq_lens, page_size, min_shared_tokens)
        if not len(groups):
            return None
        groups = Groups(groups.rows, groups.offsets, groups.shared // page_size)
        lens = seq_lens.numpy()
        decode.stage(groups, lens, np.arange(len(lens)), page_size)
        cut = seq_lens.clone()
        cut[torch.from_numpy(groups.rows)] = 1
        table = (slots[:, ::page_size] // page_size).to(torch.int32)
        return cls(groups, cut, table, page_size)

    def attend(self, decode: GroupedDecode, query: torch.Tensor, key_buffer: torch.Tensor,
               value_buffer: torch.Tensor, scale: float, output: torch.Tensor) -> None:
        """Overwrite the grouped rows of ``output`` (``[rows, q_heads, head_dim]``) with
        their attention over SGLang's K/V buffers ``[slots, kv_heads, head_dim]``; the
        other rows are left as SGLang's kernel wrote them."""
        pages = key_buffer.shape[0] // self.page_size
        heads, dim = key_buffer.shape[1:]
        decode.run(query, key_buffer.view(pages, self.page_size, heads, dim),
                   value_buffer.view(pages, self.page_size, heads, dim), self.block_table,
                   scale, output)


class SharedPrefixTritonBackend(SharedPrefixDecode, TritonAttnBackend):
    """SGLang's Triton backend with the shared-prefix decode (see the module docstring)."""

    def __init__(self, model_runner: Any, min_shared_tokens: int) -> None:
        super().__init__(model_runner, min_shared_tokens)
        device = torch.device(model_runner.device)
        sms = (torch.cuda.get_device_properties(device).multi_processor_count
               if device.type == "cuda" else 1)
        self.decode = GroupedDecode(DecodeLimits.for_device(
            sms, self.req_to_token_pool.size, self.num_head, self.num_kv_head,
            model_runner.model_config.head_dim), device)
        self.graphs = False
        self.cut_metadata: Any = None

    HEAD_SIZES = "powers of two from 16"

    @staticmethod
    def head_size_fits(head_dim: int) -> bool:
        return head_dim >= 16 and head_dim & (head_dim - 1) == 0

    def init_cuda_graph_state(self, *args: Any, **kwargs: Any) -> None:
        super().init_cuda_graph_state(*args, **kwargs)
        self.graphs = True
        announce("off under decode CUDA graphs (the groups are planned on the host each "
                 "step; --cuda-graph-backend-decode disabled keeps them)")

    def init_forward_metadata(self, forward_batch: Any) -> None:
        step = None if self.graphs else self.plan(forward_batch)
        if step is not None:
            cut = copy.copy(forward_batch)
            cut.seq_lens = step.cut_lens.to(forward_batch.seq_lens.device,
                                            forward_batch.seq_lens.dtype)
            cut.seq_lens_cpu, cut.seq_lens_sum = step.cut_lens, int(step.cut_lens.sum())
            TritonAttnBackend.init_forward_metadata(self, cut)
            self.cut_metadata = self.forward_metadata
        TritonAttnBackend.init_forward_metadata(self, forward_batch)
        self.step = (forward_batch, step)

    def plan_rows(self, forward_batch: Any, seq_lens: torch.Tensor) -> TritonStep | None:
        return TritonStep.plan(self.decode, self.req_to_token_pool.req_to_token,
                               forward_batch.req_pool_indices, seq_lens, self.page_size,
                               self.min_shared_tokens)

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any,
                       forward_batch: Any, save_kv_cache: bool = True,
                       **kwargs: Any) -> torch.Tensor:
        batch, step = self.step
        if step is None or batch is not forward_batch or kwargs.get("score_mod") is not None \
                or not self._acts(layer, q, kwargs.get("sinks")):
            return TritonAttnBackend.forward_decode(self, q, k, v, layer, forward_batch,
                                                    save_kv_cache, **kwargs)
        metadata, self.forward_metadata = self.forward_metadata, self.cut_metadata
        try:
            output = TritonAttnBackend.forward_decode(self, q, k, v, layer, forward_batch,
                                                      save_kv_cache, **kwargs)
        finally:
            self.forward_metadata = metadata
        heads, dim = layer.tp_q_head_num, layer.qk_head_dim
        step.attend(self.decode, q.reshape(-1, heads, dim),
                    self.token_to_kv_pool.get_key_buffer(layer.layer_id),
                    self.token_to_kv_pool.get_value_buffer(layer.layer_id), layer.scaling,
                    output.view(-1, heads, dim))
        return output
