"""The GPU self-check's subject as a child process builds it: the engine's check
(``engine_check``), its recipe (``gpu_recipe``: plain values a fresh process unpickles
without vLLM) and the subject the recipe makes there (``gpu_subject``: vLLM's backend and
Feather's builder at the engine's shapes, under the engine's attention configuration).

It depends on ``attention_check`` (the subject's measurement) and on Feather's backends
(through ``backends``, as vLLM's registry reaches them); neither depends on it but the
builders, which call ``engine_check``.
"""

from __future__ import annotations

import dataclasses
import enum
from types import SimpleNamespace
from typing import Any

import torch

from feather_sched.attention import selfcheck
from feather_sched.attention.check_memory import planned_limits
from feather_sched.attention.isolation import Recipe, run_isolated
from feather_sched.attention.selfcheck import Verdict
from feather_sched.integrations.vllm import backends
from feather_sched.integrations.vllm.attention_check import (
    Geometry,
    GpuSubject,
    gpu_shapes,
    resolved_layout,
)

BACKEND_CLASSES = {"FLASH_ATTN": "SharedPrefixFlashBackend",
                   "TRITON_ATTN": "SharedPrefixTritonBackend"}
"""vLLM's backend names the check runs, and Feather's class of each in ``backends``."""


def engine_check(builder: Any, vllm_config: Any, kv_cache_spec: Any,
                 layer_names: list[str]) -> Verdict:
    """``auto``'s verdict for this engine: kept per device, versions and shapes; measured
    on a GPU in a child process (``isolation.run_isolated``: a device fault, a hang or a
    kill there leaves the worker up, the verdict off with its reason), elsewhere (CPU
    tensors in Triton's interpreter) in this process, on ``builder``'s own decode."""
    if builder.device.type == "cuda":
        return selfcheck.cached_check(gpu_recipe(builder, vllm_config, kv_cache_spec),
                                      run_isolated)
    return selfcheck.cached_check(GpuSubject(builder, vllm_config, kv_cache_spec,
                                             layer_names))


def gpu_recipe(builder: Any, vllm_config: Any, kv_cache_spec: Any) -> Recipe:
    """The engine's check as a child process builds it (``isolation``): ``gpu_subject``
    at this engine's shapes, backend, KV layout and device, under its attention and
    compilation settings (``engine_settings``), kept for ``gpu_shapes``, limited by its
    memory plan."""
    backend = "FLASH_ATTN" if builder.name == "FlashAttention" else "TRITON_ATTN"
    shapes = gpu_shapes(builder, vllm_config, kv_cache_spec)
    return Recipe(shapes, f"{__name__}:recipe_subject",
                  {"backend": backend,
                   "geometry": (builder.num_heads_q, kv_cache_spec.num_kv_heads,
                                kv_cache_spec.head_size),
                   "dtype": str(kv_cache_spec.dtype).removeprefix("torch."),
                   "block": kv_cache_spec.block_size,
                   "max_rows": vllm_config.scheduler_config.max_num_seqs,
                   "max_model_len": vllm_config.model_config.max_model_len,
                   "device": str(builder.device),
                   "kv_layout": resolved_layout(vllm_config),
                   **engine_settings(vllm_config),
                   "expected_flash": dict(shapes.versions).get("flash-attn")},
                  run="feather_sched.attention.gpu_check:check_measuring_memory",
                  limits=planned_limits(shapes, cuda=builder.device.type == "cuda"))


SETTINGS_CHOSEN_BY_THE_CHECK = frozenset({"backend", "backend_per_kind"})
"""Attention settings the check sets itself (it runs vLLM's backend it was asked for)."""
COMPILATION_SETTINGS = ("cudagraph_mode", "max_cudagraph_capture_size")
"""Compilation settings Feather's builder reads (the graph mode each step, the largest
captured batch)."""


def engine_settings(vllm_config: Any) -> dict[str, dict[str, Any]]:
    """The engine's attention settings (``attention_config``: FlashAttention's version, its
    split cap under CUDA graphs, ...) and the compilation settings the builder reads, as
    the user gave them (the graph mode by name; other values not plain numbers, strings or
    None left out), for the check's child to build its config under (``check_config``).
    O(fields)."""
    attention = getattr(vllm_config, "attention_config", None)
    chosen = {field.name: getattr(attention, field.name) for field in
              (dataclasses.fields(attention) if dataclasses.is_dataclass(attention) else ())
              if field.name not in SETTINGS_CHOSEN_BY_THE_CHECK}
    compilation = vllm_config.compilation_config
    graphs = {name: getattr(compilation, name, None) for name in COMPILATION_SETTINGS}
    if isinstance(graphs["cudagraph_mode"], enum.Enum):
        graphs["cudagraph_mode"] = graphs["cudagraph_mode"].name
    return {"attention": _plain(chosen), "compilation": _plain(graphs)}


def _plain(values: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in values.items()
            if isinstance(value, (type(None), bool, int, float, str))}


def recipe_subject(geometry: tuple[int, int, int], dtype: str, **options: Any) -> Any:
    """``gpu_subject`` from a recipe's plain values (``gpu_recipe``: unpickling them
    imports nothing of vLLM's, so the child can prepare its process before vLLM loads)."""
    return gpu_subject(geometry=Geometry(*geometry), dtype=getattr(torch, dtype), **options)


def gpu_subject(backend: str, geometry: Any, dtype: torch.dtype, block: int,
                max_rows: int, max_model_len: int, device: str = "cuda",
                kv_layout: str | None = None, attention: dict[str, Any] | None = None,
                compilation: dict[str, Any] | None = None,
                expected_flash: str | None = None) -> GpuSubject:
    """The engine-start check of vLLM's ``backend`` ("FLASH_ATTN" or "TRITON_ATTN") at
    these shapes, outside an engine (``feather attention-check --backend``): vLLM's config
    for the project's tiny model with these heads under the engine's ``attention`` and
    ``compilation`` settings (``engine_settings``; None: the platform's), current while
    Feather's builder (path on, no check of its own) and one layer's impl are made, so
    vLLM's kernels take the engine's FlashAttention version.  RuntimeError where the
    version they took is not ``expected_flash`` (the verdict's key: the engine's)."""
    from vllm.config import set_current_vllm_config

    config = check_config(geometry, dtype, block, max_rows, max_model_len, attention,
                          compilation)
    spec = _spec(geometry, dtype, block)
    backend_cls = getattr(backends, BACKEND_CLASSES[backend])
    if not backend_cls.__module__.startswith("feather_sched."):
        raise RuntimeError(f"Feather's {backend} backend did not import (vLLM's serves)")
    with set_current_vllm_config(config):
        builder = backend_cls.get_builder_cls()(spec, ["feather.check"], config,
                                                torch.device(device))
        impl = backend_cls.get_impl_cls()(geometry.q_heads, geometry.head_dim,
                                          geometry.head_dim ** -0.5, geometry.kv_heads,
                                          alibi_slopes=None, sliding_window=None,
                                          kv_cache_dtype="auto")
        ones = torch.ones(1, device=device)
        layer = SimpleNamespace(impl=impl, _q_scale=ones, _k_scale=ones, _v_scale=ones,
                                _q_scale_float=1.0, _k_scale_float=1.0, _v_scale_float=1.0)
        subject = GpuSubject(builder, config, spec, ["feather.check"], layer)
    taken = dict(subject.shapes.versions).get("flash-attn")
    if expected_flash is not None and taken != expected_flash:
        raise RuntimeError(f"the check would run FlashAttention {taken}, the engine runs "
                           f"{expected_flash}")
    subject.kv_layout = kv_layout or subject.kv_layout  # the engine's, where it has one
    return subject


def check_config(geometry: Any, dtype: torch.dtype, block: int, max_rows: int,
                 max_model_len: int, attention: dict[str, Any] | None = None,
                 compilation: dict[str, Any] | None = None) -> Any:
    """vLLM's configuration of the check: the project's tiny model with ``geometry``'s
    heads, Feather's path on, under the engine's settings (``engine_settings``: those this
    release names; vLLM resolves them as it resolved the engine's)."""
    from vllm.config import CacheConfig, CompilationConfig, ModelConfig, VllmConfig
    from vllm.config.attention import AttentionConfig
    from vllm.config.compilation import CUDAGraphMode

    from feather_sched.models import TINY_LLAMA

    heads, kv_heads, head_dim = geometry.q_heads, geometry.kv_heads, geometry.head_dim
    model = ModelConfig(model=str(TINY_LLAMA), dtype=dtype, skip_tokenizer_init=True,
                        max_model_len=max_model_len, hf_overrides={
                            "num_attention_heads": heads, "num_key_value_heads": kv_heads,
                            "head_dim": head_dim, "hidden_size": heads * head_dim,
                            "max_position_embeddings": max(max_model_len, 32768)})
    graphs = _known(CompilationConfig, compilation)
    if graphs.get("cudagraph_mode") is not None:
        graphs["cudagraph_mode"] = CUDAGraphMode[graphs["cudagraph_mode"]]
    config = VllmConfig(model_config=model, cache_config=CacheConfig(block_size=block),
                        attention_config=AttentionConfig(**_known(AttentionConfig, attention)),
                        compilation_config=CompilationConfig(**graphs),
                        additional_config={"feather": {"shared_prefix_attention": "on"}})
    config.scheduler_config.max_num_seqs = max_rows
    return config


def _known(config_cls: Any, settings: dict[str, Any] | None) -> dict[str, Any]:
    """``settings`` this release's ``config_cls`` has a field for (a recipe from another
    release may name more)."""
    names = {field.name for field in dataclasses.fields(config_cls)}
    return {name: value for name, value in (settings or {}).items() if name in names}


def _spec(geometry: Any, dtype: torch.dtype, block: int) -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=block, num_kv_heads=geometry.kv_heads,
                             head_size=geometry.head_dim, dtype=dtype)
