"""Shared-prefix decode attention inside SGLang 0.5.23's CPU backends (``torch_native``,
and ``intel_amx`` where SGLang's CPU kernels are installed).

``register`` (called by the launcher, ``integrations.sglang.launch``, in every SGLang
process) points SGLang's ``torch_native`` and ``intel_amx`` backend factories
(``attention_registry.ATTENTION_BACKENDS``) at ``create_backend``, which builds SGLang's own
backend unless Feather's option ``shared_prefix_attention`` turns the path on for this
server: ``on``, or ``auto`` (the default) with Feather's scheduler (``--schedule-policy
feather``) on ``torch_native``, the backend the tests verify, where the self-check run when
the backend is made (``self_check``: SGLang's decode against the path on SGLang's pools at
the server's shapes, ``attention_check``) measured the path exact and faster, from the
measured break-even.  Where on, the backend is a
subclass (``SharedPrefixDecode``) that, once per decode step, finds the rows whose
``req_to_token`` rows start with the same KV slots (``attention.groups.plan_token_step``),
runs SGLang's own decode with those rows cut to one token, and replaces their outputs with
the exact merge of each group's prefix, attended once for all its queries, and each row's
suffix (``attention.cpu_kernel``, "nhd" layout: SGLang's token-major pool).  Extend,
prefill, mixed and speculative batches run SGLang's code unchanged.

Where it cannot act, SGLang's path runs and the log says why, once per process: the option,
the self-check's verdict (with its figures) or its failure, the device, an MLA model, a
pool that is not SGLang's token-major ``MHATokenToKVPool``, CPU graphs
(``--enable-torch-compile``), no C++ compiler, or a layer with cross attention, sliding
windows, soft-capping, sinks, an fp8 cache or unequal K and V head sizes.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

from feather_sched.attention import cpu_kernel
from feather_sched.attention.groups import StepPlan, plan_token_step
from feather_sched.attention.selfcheck import (
    CPU_SOURCES,
    Verdict,
    agreed,
    cached_check,
    check,
    checked,
    kernel_digest,
)
from feather_sched.integrations.sglang.stand_ins import prepare_sglang_import

prepare_sglang_import()  # before the first SGLang import (see stand_ins)

from sglang.srt.layers.attention.intel_amx_backend import IntelAMXAttnBackend  # noqa: E402
from sglang.srt.layers.attention.torch_native_backend import (  # noqa: E402
    TorchNativeAttnBackend,
)
from sglang.srt.layers.radix_attention import AttentionType  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402

logger = logging.getLogger("sglang.feather_sched")
_announced: set[str] = set()
VERIFIED = ("torch_native", "triton")
"""The backends ``auto`` turns the path on for, where the self-check finds it exact and
faster (``torch_native`` checked against SGLang by the tests, ``triton`` on the server's
GPU); ``intel_amx`` only with ``on``."""


def announce(message: str) -> None:
    """Log ``message`` once per process (every layer decides the same)."""
    if message not in _announced:
        _announced.add(message)
        logger.info("Feather shared-prefix attention: %s", message)


def attention_options(environ: Mapping[str, str]) -> tuple[str, int | None]:
    """This server's ``shared_prefix_attention`` (``auto``, ``on`` or ``off``) and
    ``shared_prefix_min_tokens``: Feather's options as its SGLang scheduler reads them
    (``FEATHER_SGLANG_OPTIONS``, ``FEATHER_*``), so a server with SGLang's own policy takes
    them from ``FEATHER_SHARED_PREFIX_ATTENTION=on`` and the like."""
    from feather_sched.integrations.sglang.scheduler import feather_options

    options = feather_options(environ)
    return options.shared_prefix_attention, options.shared_prefix_min_tokens


def decide(name: str, runner: Any, mode: str, feather: bool) -> str | None:
    """Why option ``mode`` leaves SGLang's backend ``name`` alone for this model runner,
    or None when the path acts (``feather``: Feather's scheduler drives the server)."""
    from sglang.srt.runtime_context import get_flags

    if mode == "off":
        return "off (option shared_prefix_attention)"
    if mode == "auto" and not feather:
        return "off (auto, and the scheduler is not Feather's)"
    if mode == "auto" and name not in VERIFIED:
        return f"off (auto: not verified on the {name} backend; 'on' turns it on)"
    pool, gpu = runner.token_to_kv_pool, name in GPU_BACKENDS
    problems: list[tuple[str, Callable[[], bool]]] = [
        (f"device {runner.device} (the {name} path runs on CUDA devices)",
         lambda: gpu and runner.device != "cuda"),
        (f"device {runner.device} (the kernel reads host memory)",
         lambda: not gpu and runner.device != "cpu"),
        ("an MLA model", lambda: runner.use_mla_backend),
        (f"a {type(pool).__name__} KV pool (the kernel reads MHATokenToKVPool's)",
         lambda: type(pool) is not MHATokenToKVPool),
        (f"the {getattr(pool, 'kv_cache_layout', None)!r} pool layout (it reads 'nhd')",
         lambda: getattr(pool, "kv_cache_layout", "nhd") != "nhd"),
        ("CPU graphs (--enable-torch-compile replays decode without Python)",
         lambda: not gpu and get_flags().capture.enable_torch_compile),
        *(_gpu_problems(runner) if gpu else []),
    ]
    problem = next((text for text, present in problems if present()), None)
    if problem:
        return f"off for {problem}"
    if gpu:
        return None
    try:
        cpu_kernel.vectorized()
    except cpu_kernel.KernelUnavailable as error:
        return f"off: {error}"
    return None


def _gpu_problems(runner: Any) -> list[tuple[str, Callable[[], bool]]]:
    """What keeps the Triton path off on a CUDA runner (``attention_triton``'s docstring)."""
    from sglang.srt.environ import envs
    from sglang.srt.runtime_context import get_exec, get_parallel

    return [
        ("SGLang's metadata glue graph (SGLANG_ENABLE_METADATA_GLUE_GRAPH replays the "
         "per-step metadata's device work without the host work that finds the groups)",
         lambda: envs.SGLANG_ENABLE_METADATA_GLUE_GRAPH.get()),
        ("two-batch overlap (--enable-two-batch-overlap)",
         lambda: get_exec().overlap.enable_two_batch_overlap),
        ("decode context parallelism", lambda: get_parallel().attn_dcp_size > 1),
        ("translated KV ids (a unified or fused draft pool)",
         lambda: getattr(runner.kv_index_translator, "is_translating", False)),
    ]


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

    def plan_rows(self, forward_batch: Any, seq_lens: torch.Tensor) -> StepPlan | None:
        """The groups of a plain decode batch with these CPU lengths, for the CPU kernel."""
        return plan_token_step(self.req_to_token_pool.req_to_token,
                               forward_batch.req_pool_indices.cpu(), seq_lens,
                               self.page_size, self.min_shared_tokens)

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
                                 output.view(-1, heads, dim), "nhd")
        return output

    def _acts(self, layer: Any, q: torch.Tensor, sinks: Any) -> bool:
        acts = self.acts.get(layer.layer_id)
        if acts is None:
            reason = self._layer_problem(layer, q, sinks)
            self.acts[layer.layer_id] = acts = reason is None
            if reason:
                announce(f"off for layers with {reason} (SGLang's kernel serves them)")
        return acts

    HEAD_SIZES = "multiples of 16"

    @staticmethod
    def head_size_fits(head_dim: int) -> bool:
        return head_dim % 16 == 0

    def _layer_problem(self, layer: Any, q: torch.Tensor, sinks: Any) -> str | None:
        keys = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        window = getattr(layer, "sliding_window_size", None)
        features = {
            "cross or non-decoder attention": layer.is_cross_attention
                or getattr(layer, "attn_type", AttentionType.DECODER) != AttentionType.DECODER,
            "a sliding window": window is not None and window > -1,
            "soft-capping": bool(getattr(layer, "logit_cap", 0)),
            "attention sinks": sinks is not None,
            "unequal K and V head sizes": layer.qk_head_dim != layer.v_head_dim,
            f"a {keys.dtype} KV cache": keys.dtype not in cpu_kernel.DTYPE_CODES,
            "a query dtype unlike the cache's": q.dtype != keys.dtype,
            f"head size {layer.qk_head_dim} (the kernel takes {self.HEAD_SIZES})":
                not self.head_size_fits(layer.qk_head_dim),
            f"a pool of {len(keys)} slots, not whole pages": len(keys) % self.page_size != 0,
        }
        return next((name for name, present in features.items() if present), None)


class SharedPrefixTorchNativeBackend(SharedPrefixDecode, TorchNativeAttnBackend):
    """SGLang's ``torch_native`` backend with the shared-prefix decode."""


class SharedPrefixIntelAMXBackend(SharedPrefixDecode, IntelAMXAttnBackend):
    """SGLang's ``intel_amx`` backend (its ``sgl_kernel`` CPU ops) with the shared-prefix
    decode; its decode kernel writes this step's KV itself, before attending."""


BACKENDS: dict[str, tuple[type, type]] = {
    "torch_native": (TorchNativeAttnBackend, SharedPrefixTorchNativeBackend),
    "intel_amx": (IntelAMXAttnBackend, SharedPrefixIntelAMXBackend),
}
"""SGLang's CPU backends by name -> (SGLang's backend, Feather's subclass)."""
GPU_BACKENDS = ("triton",)
"""SGLang's GPU backends with the path (``attention_triton``), imported when one is made."""
UNSUPPORTED = {
    "fa3": "its decode is FlashAttention-3's fused paged kernel, with no split of rows the "
           "path could take over here",
    "flashinfer": "its decode wrapper plans the batch's pages itself (SGLang leaves "
                  "FlashInfer's cascade wrapper unused)",
}
"""SGLang's GPU backends without the path, and why (logged when one is made)."""


def backend_classes(name: str) -> tuple[type, type]:
    """(SGLang's backend, Feather's subclass) for SGLang's name."""
    if name in GPU_BACKENDS:
        from feather_sched.integrations.sglang.attention_triton import (
            SharedPrefixTritonBackend,
            TritonAttnBackend,
        )

        return TritonAttnBackend, SharedPrefixTritonBackend
    return BACKENDS[name]


def self_check(name: str, runner: Any) -> Verdict:
    """``auto``'s verdict for this server's shapes (``attention.selfcheck``: SGLang's
    backend ``name`` against the path on SGLang's pools, ``attention_check``), cached per
    device, versions and shapes.  Cold: a few seconds on the CPU's small grid, on a GPU the
    selfcheck grid at the model's layers per step; warm: one file read."""
    import sglang
    from sglang.srt.runtime_context import get_parallel

    from feather_sched import __version__
    from feather_sched.integrations.sglang.attention_check import (
        EXACTNESS_CELLS,
        GRID,
        SglangCpuSubject,
        SglangTritonSubject,
    )

    model, pool = runner.model_config, runner.token_to_kv_pool
    q_heads = model.get_num_attention_heads(get_parallel().tp_size)
    versions = (("torch", torch.__version__), ("sglang", sglang.__version__),
                ("feather-sched", __version__))
    if name in GPU_BACKENDS:
        return cached_check(SglangTritonSubject(*backend_classes(name), runner, q_heads,
                                                pool.layer_num, versions))
    subject = SglangCpuSubject(
        *BACKENDS[name], q_heads=q_heads, kv_heads=pool.head_num, head_dim=pool.head_dim,
        dtype=pool.dtype, page_size=max(1, runner.page_size or 1),
        max_rows=runner.req_to_token_pool.size,
        max_context=runner.req_to_token_pool.max_context_len,
        versions=(*versions, ("kernel", kernel_digest(CPU_SOURCES))))
    return cached_check(subject, lambda s: check(s, GRID, EXACTNESS_CELLS, reps=3))


def tp_agreed(verdict: Verdict | None) -> Verdict | None:
    """``selfcheck.agreed`` over SGLang's tensor-parallel group (its host-side group;
    none before SGLang's model parallelism is set up): every rank takes one answer."""
    from sglang.srt.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return verdict
    return agreed(verdict, parallel_state.get_tp_group().cpu_group)


def create_backend(name: str, runner: Any, environ: Mapping[str, str] | None = None) -> Any:
    """SGLang's backend ``name`` for ``runner``, with the shared-prefix decode where this
    server's options turn it on (``decide``; under ``auto``, where the self-check measured
    it exact and faster, from its break-even); the verdict logged once.  A self-check that
    fails leaves the path off, with its reason, and the server up."""
    from feather_sched.integrations.sglang.scheduler import feather_enabled

    environ = os.environ if environ is None else environ
    engine, shared = backend_classes(name)
    mode, min_tokens = attention_options(environ)
    reason = decide(name, runner, mode, feather_enabled(environ))
    verdict = None
    if reason is None and mode == "auto":
        verdict, reason = checked(lambda: self_check(name, runner), tp_agreed)
    if reason:
        announce(reason)
        return engine(runner)
    tokens = min_tokens or (verdict and verdict.min_shared_tokens) or \
        cpu_kernel.MIN_SHARED_TOKENS_BY_LAYOUT["nhd"]
    backend = shared(runner, tokens)
    if verdict:
        announce(verdict.line(*[f"the option groups from {tokens}"] * bool(min_tokens)))
    else:
        kernel = "Triton" if name in GPU_BACKENDS else \
            "AVX-512" if cpu_kernel.vectorized() else "portable"
        announce(f"on ({mode}; {name}, {runner.token_to_kv_pool.dtype}, page size "
                 f"{backend.page_size}, {kernel} kernels, groups from {tokens} shared "
                 "tokens)")
    return backend


def _factory(name: str) -> Callable[[Any], Any]:
    def create(runner: Any) -> Any:
        return create_backend(name, runner)

    create.__name__ = f"create_feather_{name}_backend"
    return create


def _unsupported(name: str, sglangs: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def create(runner: Any) -> Any:
        mode = attention_options(os.environ)[0]
        announce("off (option shared_prefix_attention)" if mode == "off" else
                 f"off for the {name} backend: {UNSUPPORTED[name]}; it runs in "
                 f"{', '.join([*BACKENDS, *GPU_BACKENDS])}")
        return create.sglangs(runner)  # type: ignore[attr-defined]

    create.__name__ = f"create_feather_{name}_backend"
    create.sglangs = sglangs  # type: ignore[attr-defined]
    return create


def register() -> None:
    """Point SGLang's ``torch_native``, ``intel_amx`` and ``triton`` factories at
    ``create_backend``, and its ``fa3`` and ``flashinfer`` ones at SGLang's own with the
    reason logged (idempotent; in each process, before its model runner builds the
    backend)."""
    from sglang.srt.layers.attention.attention_registry import (
        ATTENTION_BACKENDS,
        register_attention_backend,
    )

    for name in [*BACKENDS, *GPU_BACKENDS]:
        register_attention_backend(name)(_factory(name))
    for name in UNSUPPORTED:
        sglangs = ATTENTION_BACKENDS.get(name)
        if sglangs is not None:
            register_attention_backend(name)(_unsupported(name,
                                                          getattr(sglangs, "sglangs", sglangs)))
