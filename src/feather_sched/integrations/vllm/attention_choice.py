"""Whether Feather's shared-prefix attention acts in a vLLM engine, for the CPU and the
GPU backends alike: the engine's option, its scheduler, the self-check's verdict agreed
by every tensor-parallel rank, and the one log line that says which and why.

Only builders of an engine that chose Feather (``choice.feather_chosen``) ask: in any
other engine vLLM's builders run exactly as vLLM's, and nothing here is read or logged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from feather_sched.attention import selfcheck
from feather_sched.attention.selfcheck import Verdict
from feather_sched.integrations.vllm.choice import feather_scheduler, worker_option

logger = logging.getLogger("vllm.feather_sched")
_announced: set[str] = set()


def announce(message: str) -> None:
    """Log ``message`` once per process (every builder and layer decides the same)."""
    if message not in _announced:
        _announced.add(message)
        logger.info("Feather shared-prefix attention: %s", message)


def attention_options(vllm_config: Any) -> tuple[str, int | None]:
    """The engine's ``shared_prefix_attention`` option (``auto``, ``on`` or ``off``) and
    its ``shared_prefix_min_tokens``, each read alone (no other option is checked)."""
    return (worker_option(vllm_config, "shared_prefix_attention"),
            worker_option(vllm_config, "shared_prefix_min_tokens"))


def decide(vllm_config: Any, mode: str) -> str | None:
    """Why option ``mode`` leaves vLLM's path alone, or None when it asks for shared
    prefixes."""
    if mode == "off":
        return "off (option shared_prefix_attention)"
    if mode == "auto" and not feather_scheduler(vllm_config):
        return "off (auto, and the scheduler is not Feather's)"
    return None


def checked(measure: Callable[[], Verdict]) -> tuple[Verdict | None, str | None]:
    """``selfcheck.checked`` with the tensor-parallel ranks' vote (``agreed``)."""
    return selfcheck.checked(measure, agreed)


def agreed(verdict: Verdict | None) -> Verdict | None:
    """One verdict for every tensor-parallel rank (each rank measured its own; None, a
    check that failed, votes off): on only if every rank is on, from the longest
    break-even any rank found.  The ranks must agree, or they would form different
    batches' attention differently."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return verdict
    group = parallel_state.get_tp_group()
    if group.world_size == 1:
        return verdict
    on = verdict is not None and verdict.on
    votes = torch.tensor([0 if on else 1, (verdict and verdict.min_shared_tokens) or 0])
    torch.distributed.all_reduce(votes, op=torch.distributed.ReduceOp.MAX,
                                 group=group.cpu_group)
    off, tokens = (int(v) for v in votes)
    if verdict is None:
        return None
    if off and on:
        return replace(verdict, on=False, reason="another tensor-parallel rank found it off",
                       min_shared_tokens=None)
    return replace(verdict, min_shared_tokens=tokens or None) if on else verdict


