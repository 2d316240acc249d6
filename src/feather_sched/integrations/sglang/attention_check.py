"""The self-check's subject on SGLang's CPU engine: SGLang's own decode (its ``torch_native``
backend) against Feather's shared-prefix path, on SGLang's own pools at the server's shapes.

``TokenBatch`` is one decode step of the grid (``attention.selfcheck.Cell``) on SGLang's
``MHATokenToKVPool`` and ``ReqToTokenPool``: random K and V in pages permuted over the pool
(page 0 left as SGLang's padding), each group's full prefix pages listed in all its rows'
``req_to_token`` rows (what SGLang's radix cache gives requests sharing a prefix; a prefix
ending mid-page has its tail in each row's own pages), each row's suffix of its own, rows at
shuffled pool indices.  The engine's kernel is SGLang's backend's ``forward_decode`` on the
whole ``ForwardBatch``; the path is Feather's subclass of it on the same batch (SGLang's
decode with the grouped rows cut, then ``cpu_kernel.attend_groups``), its groups planned
once per step as the server plans them (``plan_token_step``), outside the timed layer.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from feather_sched.attention import cpu_kernel
from feather_sched.attention.partials import reference_attention
from feather_sched.attention.selfcheck import Cell, Shapes, device_name, median_seconds
from feather_sched.integrations.sglang.stand_ins import prepare_sglang_import

prepare_sglang_import()  # before the first SGLang import (see stand_ins)

from sglang.srt.layers.radix_attention import RadixAttention  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import (  # noqa: E402
    ForwardBatch,
    ForwardMode,
)

REFERENCE_TOKENS = 1 << 15
"""Cells whose rows x context are at most this get a float64 reference (it is slow)."""
GRID = tuple(Cell(prefix, 2, 4) for prefix in (256, 512, 1024, 2048, 4096))
"""The timed cells on SGLang's CPU engine: small groups (``torch_native`` decodes row by row
in Python, so a larger batch only scales both sides), prefixes around the break-even."""
EXACTNESS_CELLS = (Cell(300, 3, 5, suffix=33), Cell(1024, 1, 2, suffix=1),
                   Cell(640, 2, 6, suffix=200))
"""As ``selfcheck.EXACTNESS_CELLS`` (a prefix ending mid-page, a one-token suffix, long
suffixes), in groups a small server holds."""


class TokenBatch:
    """One decode step of ``cell`` on SGLang's pools (see the module docstring)."""

    def __init__(self, subject: SglangCpuSubject, cell: Cell, seed: int) -> None:
        s = subject.shapes
        page, dtype = s.block_size, subject.dtype
        generator = torch.Generator().manual_seed(seed)
        g, m = cell.groups, cell.per_group
        self.cell = cell
        length = cell.prefix + cell.suffix + 1
        shared_pages = cell.prefix // page
        own_pages = -(-(length - shared_pages * page) // page)
        pages = g * shared_pages + g * m * own_pages
        self.pool = MHATokenToKVPool(size=(pages + 1) * page, page_size=page, dtype=dtype,
                                     head_num=s.kv_heads, head_dim=s.head_dim, layer_num=1,
                                     device="cpu", enable_memory_saver=False)
        keys, values = self.pool.k_buffer[0], self.pool.v_buffer[0]
        for buffer in (keys, values):
            buffer.copy_(torch.randn(buffer.shape, generator=generator).to(dtype))
        ids = (1 + torch.randperm(pages, generator=generator)).long()  # page 0: padding
        offsets = torch.arange(page)

        def slots(pages_of: torch.Tensor) -> torch.Tensor:
            return (pages_of[:, None] * page + offsets).flatten()

        prefixes = ids[:g * shared_pages].view(g, shared_pages)
        own = ids[g * shared_pages:].view(g * m, own_pages)
        self.rows = [torch.cat([slots(prefixes[r // m]), slots(own[r])])[:length]
                     for r in range(g * m)]
        self.req_to_token = ReqToTokenPool(size=g * m + 1, max_context_len=length,
                                           device="cpu", enable_memory_saver=False)
        pool_rows = 1 + torch.randperm(g * m, generator=generator)
        self.req_to_token.req_to_token[pool_rows] = torch.stack(self.rows).int()
        lens = torch.full((g * m,), length)
        self.batch = ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=g * m,
            input_ids=torch.zeros(g * m, dtype=torch.long), req_pool_indices=pool_rows,
            seq_lens=lens, out_cache_loc=torch.stack([r[-1] for r in self.rows]),
            seq_lens_sum=int(lens.sum()), seq_lens_cpu=lens.clone())
        self.layer = RadixAttention(num_heads=s.q_heads, head_dim=s.head_dim,
                                    scaling=s.head_dim ** -0.5, num_kv_heads=s.kv_heads,
                                    layer_id=0)
        self.query = torch.randn(g * m, s.q_heads * s.head_dim, generator=generator).to(dtype)
        runner = SimpleNamespace(device="cpu", req_to_token_pool=self.req_to_token,
                                 token_to_kv_pool=self.pool, page_size=page,
                                 use_mla_backend=False)
        self._engine = subject.engine_cls(runner)
        self._engine.init_forward_metadata(self.batch)
        self._shared = subject.shared_cls(runner, 1)
        self._shared.init_forward_metadata(self.batch)

    def _decode(self, backend: Any) -> torch.Tensor:
        out = backend.forward_decode(self.query, None, None, self.layer, self.batch,
                                     save_kv_cache=False)
        return out.view(len(self.rows), self.layer.tp_q_head_num, self.layer.qk_head_dim)

    # ---- selfcheck.Trial ----------------------------------------------------------------

    def engine(self) -> torch.Tensor:
        return self._decode(self._engine)

    def shared(self) -> torch.Tensor:
        return self._decode(self._shared)

    def reference(self) -> torch.Tensor | None:
        if len(self.rows) * len(self.rows[0]) > REFERENCE_TOKENS:
            return None
        heads, dim = self.layer.tp_q_head_num, self.layer.qk_head_dim
        keys, values = self.pool.k_buffer[0], self.pool.v_buffer[0]
        query = self.query.view(len(self.rows), heads, dim)
        return torch.stack([reference_attention(query[row], keys[slots], values[slots],
                                                self.layer.scaling)[0]
                            for row, slots in enumerate(self.rows)])


class SglangCpuSubject:
    """SGLang's CPU backend ``engine_cls`` and Feather's subclass of it, ``shared_cls``, at
    one server's shapes, for ``selfcheck.check``."""

    idle_cost = False
    """Where nothing groups the path is SGLang's decode alone (no plan, no launch)."""

    def __init__(self, engine_cls: type, shared_cls: type, q_heads: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype, page_size: int, max_rows: int,
                 max_context: int, versions: tuple[tuple[str, str], ...]) -> None:
        self.engine_cls, self.shared_cls, self.dtype = engine_cls, shared_cls, dtype
        self.shapes = Shapes(
            device=device_name("cpu"), q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
            dtype=str(dtype).removeprefix("torch."), block_size=page_size, layout="nhd",
            max_rows=max_rows, max_context=max_context,
            versions=(*versions, ("backend", engine_cls.__name__),
                      ("threads", str(torch.get_num_threads())),
                      ("kernel build", "avx512" if cpu_kernel.vectorized() else "portable")))

    def trial(self, cell: Cell, seed: int) -> TokenBatch:
        return TokenBatch(self, cell, seed)

    def seconds(self, run: Callable[[], object], reps: int) -> float:
        return median_seconds(run, reps)
