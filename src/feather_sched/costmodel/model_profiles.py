"""Model geometries: what a transformer reads (weights, KV) and computes per token.

Numbers come from each model's Hugging Face ``config.json``; parameter counts are the
published totals (embeddings and untied LM head included), except ``tiny-llama``, which
is counted from the project's own config by :func:`llama_parameter_count`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from feather_sched.costmodel.hardware import is_integer, is_number, require
from feather_sched.models import TINY_LLAMA

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")
"""Config fields of mixture-of-experts models, whose step reads only the routed experts."""


@dataclass(frozen=True)
class ModelProfile:
    """A decoder-only transformer's geometry, as far as step cost depends on it."""

    name: str
    layers: int
    heads: int
    """Query heads."""
    kv_heads: int
    """Key/value heads (fewer than ``heads`` under grouped-query attention)."""
    head_dim: int
    params: float
    """Total parameter count."""
    dtype_bytes: int = 2
    """Bytes per weight and per KV element (2 for bf16/fp16)."""

    def __post_init__(self) -> None:
        require(self, "name", isinstance(self.name, str) and bool(self.name),
                "a non-empty string")
        for name in ("layers", "heads", "kv_heads", "head_dim"):
            value = getattr(self, name)
            require(self, name, is_integer(value) and value > 0, "a positive integer")
        require(self, "kv_heads", self.kv_heads <= self.heads, "at most heads")
        require(self, "params", is_number(self.params) and math.isfinite(self.params) and
                self.params > 0, "a positive finite number")
        require(self, "dtype_bytes", is_integer(self.dtype_bytes) and
                0 < self.dtype_bytes <= 8, "an integer from 1 to 8")

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V, every layer, every KV head."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes

    @property
    def hidden(self) -> int:
        """Attention width (query heads x head dim)."""
        return self.heads * self.head_dim

    @classmethod
    def from_hf_config(cls, name: str, config: dict[str, Any]) -> ModelProfile:
        """Profile of a Llama-architecture model from its Hugging Face ``config.json``."""
        heads = config["num_attention_heads"]
        return cls(
            name=name,
            layers=config["num_hidden_layers"],
            heads=heads,
            kv_heads=config.get("num_key_value_heads", heads),
            head_dim=config.get("head_dim", config["hidden_size"] // heads),
            params=llama_parameter_count(config),
            dtype_bytes=DTYPE_BYTES[config.get("torch_dtype", "bfloat16")],
        )

    @classmethod
    def of_engine(cls, config: Mapping[str, Any], *, dtype_bytes: int = 2,
                  tensor_parallel: int = 1) -> ModelProfile | None:
        """What one of ``tensor_parallel`` ranks reads per step, for a dense Llama-style
        model an engine serves (its Hugging Face config); None for a model this geometry
        does not describe (mixture of experts, missing fields)."""
        if any(key in config for key in MOE_KEYS) or tensor_parallel < 1:
            return None
        try:
            whole = cls.from_hf_config(str(config.get("model_type", "model")), dict(config))
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            return None
        return cls(name=whole.name, layers=whole.layers,
                   heads=max(whole.heads // tensor_parallel, 1),
                   kv_heads=max(whole.kv_heads // tensor_parallel, 1),
                   head_dim=whole.head_dim, params=whole.params / tensor_parallel,
                   dtype_bytes=dtype_bytes)


def llama_parameter_count(config: dict[str, Any]) -> int:
    """Parameters of a Llama model: embeddings, per layer q/k/v/o + gate/up/down + two
    RMSNorms, the final norm, and the LM head unless tied to the embeddings."""
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim", hidden // heads)
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q and o; k and v
    mlp = 3 * hidden * config["intermediate_size"]
    layer = attention + mlp + 2 * hidden
    embeddings = config["vocab_size"] * hidden
    lm_head = 0 if config.get("tie_word_embeddings", False) else embeddings
    return embeddings + config["num_hidden_layers"] * layer + hidden + lm_head


def _tiny_llama() -> ModelProfile:
    config = json.loads((TINY_LLAMA / "config.json").read_text())
    return ModelProfile.from_hf_config("tiny-llama", config)


MODELS: dict[str, ModelProfile] = {
    # meta-llama/Meta-Llama-3-8B config.json; 8.03e9 parameters (model card).
    "llama-3-8b": ModelProfile("llama-3-8b", 32, 32, 8, 128, 8.03e9),
    # Qwen/Qwen2.5-0.5B config.json (hidden 896 = 14 x 64); 0.49e9 parameters (model card).
    "qwen2.5-0.5b": ModelProfile("qwen2.5-0.5b", 24, 14, 2, 64, 0.49e9),
    # Qwen/Qwen2.5-1.5B config.json (hidden 1536 = 12 x 128); 1.54e9 parameters (model card).
    "qwen2.5-1.5b": ModelProfile("qwen2.5-1.5b", 28, 12, 2, 128, 1.54e9),
    # Qwen/Qwen3-8B config.json (head_dim 128); 8.19e9 parameters (model card).
    "qwen3-8b": ModelProfile("qwen3-8b", 36, 32, 8, 128, 8.19e9),
    # lmsys/longchat-13b-16k: Llama-2-13B geometry (multi-head attention, 40 KV heads).
    "longchat-13b": ModelProfile("longchat-13b", 40, 40, 40, 128, 13.0e9),
    # The project's embedded CPU model (src/feather_sched/models/tiny-llama/config.json).
    "tiny-llama": _tiny_llama(),
}
