"""The shared-prefix decode over an SGLang attention backend (``SharedPrefixDecode``),
which Feather's CPU backends (``attention``) and its Triton backend (``attention_triton``)
place before SGLang's own, and the one log line per process that says what it decided."""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch

from feather_sched.attention import cpu_kernel
from feather_sched.attention.announce import Announcer
from feather_sched.attention.eligibility import CPU_KERNEL, Kernel, LayerTraits, layer_problem
from feather_sched.attention.groups import BySize, plan_token_step
from feather_sched.integrations.sglang.stand_ins import prepare_sglang_import

prepare_sglang_import()  # before the first SGLang import (see stand_ins)

from sglang.srt.layers.radix_attention import AttentionType  # noqa: E402

announce = Announcer(logging.getLogger("sglang.feather_sched"))
"""Log a decision once per process (every layer decides the same)."""


class SharedPrefixDecode:
    """Over an SGLang backend whose ``forward_decode`` reads the step's rows from the
    ``ForwardBatch`` (``req_pool_indices``, ``seq_lens``) and writes this step's KV into
    ``token_to_kv_pool`` before attending: the grouped rows from their prefix and suffix
    parts.  The plan is made once per step (``init_forward_metadata``, O(rows x context /
    16) where rows share first slots, a few us where none do) and used only by the layers
    of that step's ``ForwardBatch``."""

    req_to_token_pool: Any
    token_to_kv_pool: Any

    def __init__(self, model_runner: Any, min_shared_tokens: int) -> None:
        super().__init__(model_runner)  # type: ignore[call-arg]
        self.min_shared_tokens = min_shared_tokens
        self.page_size = max(1, model_runner.page_size or 1)
        self.step: tuple[Any, Any] = (None, None)
        """The ``ForwardBatch`` planned for, and its plan (``plan``)."""
        self.use_tiles = False
        """Whether the kernel multiplies in AMX tiles (``cpu_kernel.tiles_proven``)."""
        self.by_size: BySize = ()
        """The verdict's break-even per group size (``groups.BySize``), where measured."""
        self.acts: dict[int, bool] = {}
        """Per layer id: whether the path can serve it (decided at its first grouped step)."""

    def init_forward_metadata(self, forward_batch: Any) -> None:
        super().init_forward_metadata(forward_batch)  # type: ignore[misc]
        self.step = (forward_batch, self.plan(forward_batch))

    def plan(self, forward_batch: Any) -> Any:
        """The step's groups (``plan_rows``'); None for anything but a plain decode batch,
        or where no row is long enough to hold a group's shortest prefix."""
        if not forward_batch.forward_mode.is_decode() or forward_batch.spec_info is not None \
                or forward_batch.encoder_lens is not None:
            return None
        seq_lens = forward_batch.seq_lens_cpu
        if seq_lens is None:
            seq_lens = forward_batch.seq_lens.cpu()
        if len(seq_lens) < 2 or int(seq_lens.max()) <= self.min_shared_tokens:
            return None
        return self.plan_rows(forward_batch, seq_lens)

    def plan_rows(self, forward_batch: Any, seq_lens: torch.Tensor) -> Any:
        """The groups of a plain decode batch with these CPU lengths: a ``StepPlan`` for
        the CPU kernel (a subclass plans for its own kernel), or None."""
        return plan_token_step(self.req_to_token_pool.req_to_token,
                               forward_batch.req_pool_indices.cpu(), seq_lens,
                               self.page_size, self.min_shared_tokens, self.by_size)

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any,
                       forward_batch: Any, save_kv_cache: bool = True,
                       **kwargs: Any) -> torch.Tensor:
        decode = super().forward_decode  # type: ignore[misc]
        batch, plan = self.step
        if plan is None or batch is not forward_batch or \
                not self._acts(layer, q, kwargs.get("sinks")):
            return decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        cut = copy.copy(forward_batch)
        cut.seq_lens = plan.seq_lens.to(forward_batch.seq_lens.dtype)
        output = decode(q, k, v, layer, cut, save_kv_cache, **kwargs)
        heads, dim = layer.tp_q_head_num, layer.qk_head_dim
        cache = (self.token_to_kv_pool.get_key_buffer(layer.layer_id),
                 self.token_to_kv_pool.get_value_buffer(layer.layer_id))
        cpu_kernel.attend_groups(plan, q.reshape(-1, heads, dim), cache, layer.scaling,
                                 output.view(-1, heads, dim), "nhd", self.use_tiles)
        return output

    def _acts(self, layer: Any, q: torch.Tensor, sinks: Any) -> bool:
        acts = self.acts.get(layer.layer_id)
        if acts is None:
            reason = self._layer_problem(layer, q, sinks)
            self.acts[layer.layer_id] = acts = reason is None
            if reason:
                announce(f"off for layers with {reason} (SGLang's kernel serves them)")
        return acts

    kernel: Kernel = CPU_KERNEL
    """The kernel that serves the grouped rows (``eligibility``)."""

    def _layer_problem(self, layer: Any, q: torch.Tensor, sinks: Any) -> str | None:
        """What in this layer (a ``RadixAttention``) the kernel does not compute
        (``eligibility``), or None."""
        keys = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        window = getattr(layer, "sliding_window_size", None)
        return layer_problem(LayerTraits(
            head_size=layer.qk_head_dim, cache_dtype=keys.dtype, query_dtype=q.dtype,
            decoder_self_attention=not layer.is_cross_attention
                and getattr(layer, "attn_type", AttentionType.DECODER) == AttentionType.DECODER,
            sliding_window=window is not None and window > -1,
            soft_cap=bool(getattr(layer, "logit_cap", 0)), sinks=sinks is not None,
            query_temperature=(getattr(layer, "xai_temperature_len", -1) or -1) > 0,
            v_head_size=layer.v_head_dim, kv_layout="nhd", pool_slots=len(keys),
            page_size=self.page_size), self.kernel)
