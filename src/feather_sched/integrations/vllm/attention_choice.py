"""Whether Feather's shared-prefix attention acts in a vLLM engine, for the CPU and the
GPU backends alike: the engine's option, its scheduler, the self-check's verdict agreed
by every tensor-parallel rank, and the one log line that says which and why.

Only builders of an engine that chose Feather (``choice.feather_chosen``) ask: in any
other engine vLLM's builders run exactly as vLLM's, and nothing here is read or logged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from feather_sched.attention import selfcheck
from feather_sched.attention.announce import Announcer
from feather_sched.attention.selfcheck import Verdict
from feather_sched.integrations.vllm.choice import feather_scheduler, worker_option

announce = Announcer(logging.getLogger("vllm.feather_sched"))
"""Log a decision once per process (every builder and layer decides the same)."""


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
    """``selfcheck.tp_vote`` over vLLM's tensor-parallel group: every rank takes one
    answer."""
    from vllm.distributed import parallel_state

    return selfcheck.tp_vote(verdict, parallel_state)
