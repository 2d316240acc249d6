"""Shared-prefix decode attention inside SGLang 0.5.23's CPU backends (``torch_native``,
and ``intel_amx`` where SGLang's CPU kernels are installed) and its GPU ``triton`` backend.

``register`` (the launcher calls it in every SGLang process) points those backend
factories at ``create_backend``, which builds SGLang's own backend unless
``shared_prefix_attention`` turns the path on for this server (``on``, or ``auto`` with
Feather's scheduler where the self-check, ``self_check``, measured it exact and faster).
Where on, the backend is a ``SharedPrefixDecode`` subclass: once per decode step it
groups the rows whose ``req_to_token`` rows start with the same KV slots, runs SGLang's
decode with those rows cut to one token, and replaces their outputs with the exact merge
of each group's prefix, attended once, and each row's suffix; other batches run SGLang's
code.  Where it cannot act, SGLang's path runs and the log says why, once per process.
On a GPU the check runs in its own process, agreed over the tensor-parallel ranks.
docs/sglang.md, "Shared-prefix attention".
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

from feather_sched.attention import cpu_kernel
from feather_sched.attention.selfcheck import (
    CPU_SOURCES,
    Verdict,
    cached_check,
    check,
    checked,
    kernel_digest,
    tp_vote,
)
from feather_sched.integrations.sglang.shared_decode import SharedPrefixDecode, announce
from feather_sched.integrations.sglang.stand_ins import prepare_sglang_import

prepare_sglang_import()  # before the first SGLang import (see stand_ins)

from sglang.srt.layers.attention.intel_amx_backend import IntelAMXAttnBackend  # noqa: E402
from sglang.srt.layers.attention.torch_native_backend import (  # noqa: E402
    TorchNativeAttnBackend,
)
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402

logger = logging.getLogger("sglang.feather_sched")
VERIFIED = ("torch_native", "triton")
"""The backends ``auto`` turns the path on for, where the self-check finds it exact and
faster (``torch_native`` checked against SGLang by the tests, ``triton`` on the server's
GPU); ``intel_amx`` only with ``on``."""


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
    device, versions and shapes.  On the CPU it runs here, on its small grid (a few
    seconds cold), or where the kernel has AMX tiles in a process of its own; on a GPU
    in a process of its own (``isolation.run_isolated``, from plain shapes: a device
    fault, a hang or a kill there leaves this server up and the verdict off with its
    reason), the selfcheck grid at the model's layers per step. Warm: one file read."""
    import sglang
    from sglang.srt.runtime_context import get_parallel

    from feather_sched import __version__
    from feather_sched.attention.isolation import Recipe, run_isolated
    from feather_sched.integrations.sglang.attention_check import (
        EXACTNESS_CELLS,
        GRID,
        TritonShapes,
        triton_recipe,
    )

    model, pool = runner.model_config, runner.token_to_kv_pool
    q_heads = model.get_num_attention_heads(get_parallel().tp_size)
    page_size = max(1, runner.page_size or 1)
    versions = (("torch", torch.__version__), ("sglang", sglang.__version__),
                ("feather-sched", __version__))
    if name in GPU_BACKENDS:
        shapes = TritonShapes(q_heads, pool.head_num, pool.head_dim,
                              str(pool.dtype).removeprefix("torch."), page_size,
                              pool.layer_num, runner.req_to_token_pool.size,
                              runner.req_to_token_pool.max_context_len,
                              str(torch.device(runner.device, runner.gpu_id)))
        return cached_check(triton_recipe(shapes, versions), run_isolated)
    options = {"name": name, "q_heads": q_heads, "kv_heads": pool.head_num,
               "head_dim": pool.head_dim, "dtype": str(pool.dtype).removeprefix("torch."),
               "page_size": page_size, "max_rows": runner.req_to_token_pool.size,
               "max_context": runner.req_to_token_pool.max_context_len,
               "versions": (*versions, ("kernel", kernel_digest(CPU_SOURCES)))}
    subject = cpu_check_subject(**options, threads=torch.get_num_threads())
    if cpu_kernel.tiles_need_isolation():
        recipe = Recipe(subject.shapes, f"{__name__}:cpu_check_subject",
                        {**options, "threads": torch.get_num_threads()},
                        run_kwargs={"grid": GRID, "exactness": EXACTNESS_CELLS, "reps": 3})
        return cached_check(recipe, run_isolated)
    return cached_check(subject, lambda s: check(s, GRID, EXACTNESS_CELLS, reps=3))


def cpu_check_subject(name: str, dtype: str, threads: int, **options: Any) -> Any:
    """The CPU self-check's subject for SGLang's backend ``name`` from plain values (in
    this process, or a child's from a recipe), on the server's threads."""
    from feather_sched.integrations.sglang.attention_check import SglangCpuSubject

    torch.set_num_threads(threads)
    return SglangCpuSubject(*BACKENDS[name], dtype=getattr(torch, dtype), **options)


def tp_agreed(verdict: Verdict | None) -> Verdict | None:
    """``selfcheck.tp_agreed`` over SGLang's tensor-parallel group (its host-side group;
    none before SGLang's model parallelism is set up): every rank takes one answer."""
    from sglang.srt.distributed import parallel_state

    return tp_vote(verdict, parallel_state)


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
    backend.by_size = () if min_tokens or verdict is None else verdict.by_size
    if name in BACKENDS:
        backend.use_tiles = cpu_kernel.tiles_proven(verdict)
    if verdict:
        notes = [f"the option groups from {tokens}"] * bool(min_tokens)
        if name in BACKENDS:
            notes.append(f"kernel in {cpu_kernel.path(backend.use_tiles)}")
        announce(verdict.line(*notes))
    else:
        kernel = "Triton kernels" if name in GPU_BACKENDS else \
            f"kernel in {cpu_kernel.path(backend.use_tiles)}"
        announce(f"on ({mode}; {name}, {runner.token_to_kv_pool.dtype}, page size "
                 f"{backend.page_size}, {kernel}, groups from {tokens} shared tokens)")
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
