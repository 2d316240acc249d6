"""A model's attention shapes from its Hugging Face ``config.json``, per tensor-parallel
rank: what the self-check's plan (``feather attention-check --plan``) needs of a model
without loading it or an engine."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16",
          "fp16": "float16", "half": "float16", "float32": "float32", "float": "float32"}


@dataclass(frozen=True)
class AttentionShapes:
    """One rank's attention: query and KV heads (KV heads replicated where fewer than the
    ranks, as vLLM does), head size, the model's dtype and longest context."""

    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    max_context: int


def read_attention_shapes(model_dir: Path, tensor_parallel: int = 1,
                          dtype: str | None = None) -> AttentionShapes:
    """The shapes of ``model_dir/config.json`` at ``tensor_parallel`` ranks (``dtype``:
    the engine's, default the config's ``torch_dtype``); ValueError for a directory
    without a usable config."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: {error}") from None
    config = config.get("text_config", config) if isinstance(config, dict) else {}
    try:
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        max_context = int(config.get("max_position_embeddings") or 4096)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as error:
        raise ValueError(f"{path}: no attention shapes ({error!r})") from None
    name = dtype or str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    if name.removeprefix("torch.") not in DTYPES:
        raise ValueError(f"dtype {name!r}: one of {', '.join(sorted(set(DTYPES.values())))}")
    if tensor_parallel < 1 or heads % tensor_parallel or (
            kv_heads % tensor_parallel and tensor_parallel % kv_heads):
        raise ValueError(f"{heads} query and {kv_heads} KV heads do not split over "
                         f"{tensor_parallel} ranks")
    return AttentionShapes(heads // tensor_parallel, max(1, kv_heads // tensor_parallel),
                           head_dim, DTYPES[name.removeprefix("torch.")], max_context)
