"""The self-check's subjects on SGLang: SGLang's own decode (its ``torch_native`` backend on
the CPU engine, its ``triton`` backend on a GPU) against Feather's shared-prefix path, on
SGLang's own pools at the server's shapes.

``TokenBatch`` is one decode step of the grid (``attention.selfcheck.Cell``) on SGLang's
``MHATokenToKVPool`` and ``ReqToTokenPool``: random K and V in pages permuted over the pool
(page 0 left as SGLang's padding), each group's prefix pages in all its rows'
``req_to_token`` rows (as SGLang's radix cache gives them), each row's suffix of its own,
rows at shuffled pool indices.  The engine's kernel is SGLang's backend's
``forward_decode`` on the whole ``ForwardBatch``; the path is Feather's subclass of it on
the same batch, its groups planned once per step as the server plans them.  On the CPU a
trial times one layer, the plan made outside (microseconds); on a GPU
(``SglangTritonSubject``) a whole step, SGLang's metadata and the path's plan then every
layer, so the per-step cost is weighed against the per-layer gain.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from feather_sched.attention import cpu_kernel
from feather_sched.attention.check_memory import planned_limits
from feather_sched.attention.gpu_check import graph_timer, random_source, sync_seconds
from feather_sched.attention.isolation import Recipe
from feather_sched.attention.partials import reference_attention
from feather_sched.attention.selfcheck import (
    GPU_SOURCES,
    Cell,
    Shapes,
    device_facts,
    device_name,
    kernel_digest,
    median_seconds,
)
from feather_sched.integrations.sglang.stand_ins import prepare_sglang_import

prepare_sglang_import()  # before the first SGLang import (see stand_ins)

from sglang.srt.layers.radix_attention import RadixAttention  # noqa: E402
from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator  # noqa: E402
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
        page, dtype, device = s.block_size, subject.dtype, subject.device
        generator = torch.Generator().manual_seed(seed)
        g, m = cell.groups, cell.per_group
        self.cell = cell
        length = cell.length
        shared_pages = cell.prefix // page
        own_pages = -(-(length - shared_pages * page) // page)
        pages = g * shared_pages + g * m * own_pages
        self.pool = MHATokenToKVPool(size=(pages + 1) * page, page_size=page, dtype=dtype,
                                     head_num=s.kv_heads, head_dim=s.head_dim, layer_num=1,
                                     device=device, enable_memory_saver=False)
        source = random_source(device, seed)  # drawn where kept, in its dtype
        for buffer in (self.pool.k_buffer[0], self.pool.v_buffer[0]):
            buffer.normal_(generator=source)
        ids = (1 + torch.randperm(pages, generator=generator)).long()  # page 0: padding
        offsets = torch.arange(page)

        def slots(pages_of: torch.Tensor) -> torch.Tensor:
            return (pages_of[:, None] * page + offsets).flatten()

        prefixes = ids[:g * shared_pages].view(g, shared_pages)
        own = ids[g * shared_pages:].view(g * m, own_pages)
        self.rows = [torch.cat([slots(prefixes[r // m]), slots(own[r])])[:length]
                     for r in range(g * m)]
        self.req_to_token = ReqToTokenPool(size=g * m + 1, max_context_len=length,
                                           device=device, enable_memory_saver=False)
        pool_rows = 1 + torch.randperm(g * m, generator=generator)
        self.req_to_token.req_to_token[pool_rows.to(device)] = \
            torch.stack(self.rows).int().to(device)
        lens = torch.full((g * m,), length)
        self.batch = ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=g * m,
            input_ids=torch.zeros(g * m, dtype=torch.long, device=device),
            req_pool_indices=pool_rows.to(device), seq_lens=lens.to(device),
            out_cache_loc=torch.stack([r[-1] for r in self.rows]).to(device),
            seq_lens_sum=int(lens.sum()), seq_lens_cpu=lens.clone())
        self.layer = RadixAttention(num_heads=s.q_heads, head_dim=s.head_dim,
                                    scaling=s.head_dim ** -0.5, num_kv_heads=s.kv_heads,
                                    layer_id=0)
        self.query = torch.randn(g * m, s.q_heads * s.head_dim, generator=generator).to(
            device=device, dtype=dtype)
        runner = subject.runner(self.pool, self.req_to_token)
        self.layers = subject.step_layers
        self._engine = subject.engine_cls(runner)
        self._shared = subject.shared_cls(runner, 1)
        if not self.layers:
            self._engine.init_forward_metadata(self.batch)
            self._shared.init_forward_metadata(self.batch)

    def backend(self, name: str) -> Any:
        """The backend a ``selfcheck.Trial`` method named ``name`` runs."""
        return self._engine if name == "engine" else self._shared

    def prepare(self, backend: Any) -> None:
        """The step's host part: SGLang's metadata (and the path's plan, a sync)."""
        backend.init_forward_metadata(self.batch)

    def run_layers(self, backend: Any) -> torch.Tensor:
        """The step's layers (what SGLang's decode graphs replay)."""
        for _ in range(max(1, self.layers)):
            out = backend.forward_decode(self.query, None, None, self.layer, self.batch,
                                         save_kv_cache=False)
        return out.view(len(self.rows), self.layer.tp_q_head_num, self.layer.qk_head_dim)

    def _decode(self, backend: Any) -> torch.Tensor:
        if self.layers:
            self.prepare(backend)
        return self.run_layers(backend)

    # ---- selfcheck.Trial ----------------------------------------------------------------

    def engine(self) -> torch.Tensor:
        return self._decode(self._engine)

    def shared(self) -> torch.Tensor:
        return self._decode(self._shared)

    def reference(self) -> torch.Tensor | None:
        if not self.cell.referenced(REFERENCE_TOKENS):
            return None
        heads, dim = self.layer.tp_q_head_num, self.layer.qk_head_dim
        keys, values = self.pool.k_buffer[0].cpu(), self.pool.v_buffer[0].cpu()
        query = self.query.view(len(self.rows), heads, dim).cpu()
        return torch.stack([reference_attention(query[row], keys[slots], values[slots],
                                                self.layer.scaling)[0]
                            for row, slots in enumerate(self.rows)])


class SglangCpuSubject:
    """SGLang's CPU backend ``engine_cls`` and Feather's subclass of it, ``shared_cls``, at
    one server's shapes, for ``selfcheck.check``."""

    idle_cost = False
    """Where nothing groups the path is SGLang's decode alone (no plan, no launch)."""
    device = "cpu"
    step_layers = 0
    """Layers a trial times with the step's metadata and plan (0: one layer, planned
    outside the timing)."""

    def __init__(self, engine_cls: type, shared_cls: type, q_heads: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype, page_size: int, max_rows: int,
                 max_context: int, versions: tuple[tuple[str, str], ...]) -> None:
        self.engine_cls, self.shared_cls, self.dtype = engine_cls, shared_cls, dtype
        self.shapes = Shapes(
            device=device_name(self.device), q_heads=q_heads, kv_heads=kv_heads,
            head_dim=head_dim, dtype=str(dtype).removeprefix("torch."), block_size=page_size,
            layout="nhd", max_rows=max_rows, max_context=max_context,
            versions=(*versions, ("backend", engine_cls.__name__), *self.build()))

    def build(self) -> tuple[tuple[str, str], ...]:
        """What else the verdict depends on: the threads and the CPU kernel's build."""
        return (("threads", str(torch.get_num_threads())),
                ("kernel build", cpu_kernel.isa()))

    def runner(self, pool: Any, req_to_token: Any) -> Any:
        """A model runner as SGLang's backend reads it, over a trial's pools."""
        return SimpleNamespace(device="cpu", req_to_token_pool=req_to_token,
                               token_to_kv_pool=pool, page_size=self.shapes.block_size,
                               use_mla_backend=False)

    def trial(self, cell: Cell, seed: int) -> TokenBatch:
        return TokenBatch(self, cell, seed)

    def seconds(self, run: Callable[[], object], reps: int) -> float:
        return median_seconds(run, reps)


class SglangTritonSubject(SglangCpuSubject):
    """SGLang's Triton backend and Feather's subclass of it on a GPU, over trial pools the
    size of each cell, a trial timing a whole step of the model's ``layers`` (see the
    module docstring); built from plain shapes (``triton_subject``, in the check's own
    process: no live model runner), timed as CUDA graph replays on a GPU (SGLang replays
    its decode steps as graphs), by the wall clock elsewhere (the interpreter)."""

    idle_cost = True
    """Where nothing groups the path still copies the first slots (a sync) and, in a
    decode graph, makes its launches with no work."""

    def __init__(self, engine_cls: type, shared_cls: type, runner: Any, shapes: TritonShapes,
                 versions: tuple[tuple[str, str], ...]) -> None:
        self.device, self.step_layers, self._runner = shapes.device, shapes.layers, runner
        super().__init__(engine_cls, shared_cls, shapes.q_heads, shapes.kv_heads,
                         shapes.head_dim, getattr(torch, shapes.dtype), shapes.page_size,
                         shapes.max_rows, shapes.max_context, versions)
        self._timer = graph_timer(self.device)
        self._wall = sync_seconds(self.device)

    def build(self) -> tuple[tuple[str, str], ...]:
        return (("layers per step", str(self.step_layers)),)

    def runner(self, pool: Any, req_to_token: Any) -> Any:
        """The stand-in model runner with a trial's pools (and SGLang's id translator over
        them)."""
        runner = copy.copy(self._runner)
        runner.token_to_kv_pool, runner.req_to_token_pool = pool, req_to_token
        runner.kv_index_translator = KVIndexTranslator(
            req_to_token=req_to_token.req_to_token,
            token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
            token_to_kv_pool=pool, page_size=self.shapes.block_size, device=self.device)
        return runner

    def seconds(self, run: Callable[[], object], reps: int) -> float:
        """A step as SGLang runs it: on a GPU its host part eagerly (wall time, the
        device drained: the plan syncs, so it cannot be captured) and then its layers
        as a CUDA graph replay (``timing.GraphTimer``, as SGLang's decode graphs); else
        the whole step by the wall clock."""
        if self._timer is None:
            return self._wall(run, reps)
        trial = run.__self__  # type: ignore[attr-defined]
        backend = trial.backend(run.__name__)
        host = self._wall(lambda: trial.prepare(backend), reps)
        return host + self._timer.seconds(lambda: trial.run_layers(backend), reps)


@dataclass(frozen=True)
class TritonShapes:
    """A server's attention shapes on one rank, as plain values a child process unpickles
    without importing SGLang (``triton_recipe``)."""

    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    page_size: int
    layers: int
    max_rows: int
    max_context: int
    device: str


def triton_versions(shapes: TritonShapes, versions: tuple[tuple[str, str], ...]
                    ) -> tuple[tuple[str, str], ...]:
    """What a Triton verdict depends on beyond its shapes: ``versions`` (torch, SGLang,
    Feather), Feather's GPU kernels, Triton's version, the SM count and driver."""
    return (*versions, ("kernel", kernel_digest(GPU_SOURCES)), *device_facts(shapes.device))


def triton_recipe(shapes: TritonShapes, versions: tuple[tuple[str, str], ...]) -> Recipe:
    """The server's check as its own process builds it (``isolation.run_isolated``:
    ``triton_subject`` at ``shapes``), kept for the shapes that subject has."""
    versions = triton_versions(shapes, versions)
    kept = triton_subject_shapes(shapes, versions)
    return Recipe(kept, f"{__name__}:isolated_subject",
                  {"shapes": shapes, "versions": versions},
                  run="feather_sched.attention.gpu_check:check_measuring_memory",
                  limits=planned_limits(kept, cuda=shapes.device.startswith("cuda")))


def triton_subject_shapes(shapes: TritonShapes, versions: tuple[tuple[str, str], ...]
                          ) -> Shapes:
    """The ``selfcheck.Shapes`` ``triton_subject`` has for these shapes (the verdict's
    key), without building it."""
    return Shapes(device=device_name(shapes.device), q_heads=shapes.q_heads,
                  kv_heads=shapes.kv_heads, head_dim=shapes.head_dim, dtype=shapes.dtype,
                  block_size=shapes.page_size, layout="nhd", max_rows=shapes.max_rows,
                  max_context=shapes.max_context,
                  versions=(*versions, ("backend", "TritonAttnBackend"),
                            ("layers per step", str(shapes.layers))))


def isolated_subject(shapes: TritonShapes, versions: tuple[tuple[str, str], ...]
                     ) -> SglangTritonSubject:
    """``triton_subject`` in the check's own process, where no SGLang server has set up
    SGLang's runtime context: one rank's, on ``shapes.device``, set first (for good: the
    process only checks)."""
    from sglang.srt.runtime_context import get_context, get_parallel

    get_context().override_server_args(device=torch.device(shapes.device).type).install()
    get_parallel().override_permanently(attn_dcp_rank=0, attn_dcp_size=1, attn_tp_size=1,
                                        tp_size=1)
    return triton_subject(shapes, versions)


def triton_subject(shapes: TritonShapes, versions: tuple[tuple[str, str], ...]
                   ) -> SglangTritonSubject:
    """The check's subject from plain shapes (no live model runner): SGLang's
    ``ModelConfig`` of the project's tiny Llama with these heads, a model runner stand-in
    with what SGLang's Triton backend reads, and the subject over SGLang's
    ``TritonAttnBackend`` and Feather's subclass of it."""
    from feather_sched.integrations.sglang.attention_triton import (
        SharedPrefixTritonBackend,
        TritonAttnBackend,
    )

    return SglangTritonSubject(TritonAttnBackend, SharedPrefixTritonBackend,
                               runner_stand_in(shapes), shapes, versions)


def runner_stand_in(shapes: TritonShapes) -> SimpleNamespace:
    """A model runner as SGLang's Triton backend reads it when made (its pools are each
    trial's, ``SglangTritonSubject.runner``)."""
    import json

    from sglang.srt.configs.model_config import ModelConfig

    from feather_sched.models import TINY_LLAMA

    model = ModelConfig(str(TINY_LLAMA), context_length=shapes.max_context,
                        model_override_args=json.dumps({
                            "num_attention_heads": shapes.q_heads,
                            "num_key_value_heads": shapes.kv_heads,
                            "head_dim": shapes.head_dim,
                            "hidden_size": shapes.q_heads * shapes.head_dim,
                            "num_hidden_layers": shapes.layers,
                            "max_position_embeddings": shapes.max_context}))
    device = torch.device(shapes.device)
    return SimpleNamespace(
        device=device.type, gpu_id=device.index or 0, page_size=shapes.page_size,
        model_config=model, token_to_kv_pool_allocator=SimpleNamespace(),
        sliding_window_size=None, kv_cache_dtype=getattr(torch, shapes.dtype),
        is_draft_worker=False, use_mla_backend=False,
        spec_algorithm=SimpleNamespace(is_dspark=lambda: False),
        decode_num_tokens_per_req=lambda: 1)
