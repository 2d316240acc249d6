"""The command line of vLLM's OpenAI-compatible server with Feather as its scheduler."""

from __future__ import annotations

import json
import sys

from feather_sched.config import FeatherConfig
from feather_sched.models import TINY_LLAMA

SCHEDULER_CLS = "feather_sched.integrations.vllm.FeatherScheduler"
EMBEDDED_MODEL_ARGS = ["--load-format", "dummy", "--skip-tokenizer-init",
                       "--max-model-len", "16384"]
"""The embedded model is a config.json only: random weights and token-id prompts."""


def vllm_server_command(model: str | None, feather: dict, passthrough: list[str]) -> list[str]:
    """``python -m vllm.entrypoints.openai.api_server`` with Feather's scheduler and options.

    Feather options are validated here, so a typo fails before the server starts; a
    ``--additional-config`` among the pass-through arguments is merged, not replaced.
    """
    FeatherConfig.from_sources(feather, environ={})
    passthrough = list(passthrough)
    if _take(passthrough, "--scheduler-cls") is not None:
        raise ValueError("feather serve sets --scheduler-cls itself; leave it out")
    additional = json.loads(_take(passthrough, "--additional-config") or "{}")
    additional["feather"] = {**additional.get("feather", {}), **feather}
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", model or str(TINY_LLAMA),
               "--scheduler-cls", SCHEDULER_CLS,
               "--additional-config", json.dumps(additional)]
    if model is None:
        command += EMBEDDED_MODEL_ARGS
    if "--enable-prompt-tokens-details" not in passthrough:
        command.append("--enable-prompt-tokens-details")  # cached tokens, for feather bench
    return command + passthrough


def _take(args: list[str], flag: str) -> str | None:
    """Remove ``flag VALUE`` or ``flag=VALUE`` from ``args`` and return the value."""
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
            del args[i : i + 2]
            return value
        if arg.startswith(flag + "="):
            del args[i]
            return arg.split("=", 1)[1]
    return None
