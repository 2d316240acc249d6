"""Feather in SGLang 0.5.23: ``scheduler`` (the hooks on SGLang's scheduler, its schedule
policy and prefill adder), ``launch`` (``python -m feather_sched.integrations.sglang_launch``:
SGLang's server with ``--schedule-policy feather``), ``attention`` (shared-prefix decode
in SGLang's CPU attention backends) and ``stand_ins`` (an import-only
torchvision, so SGLang's scheduler code imports on a CPU machine).

``register`` (SGLang's general-plugin hook) resolves here lazily.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "register":
        from feather_sched.integrations.sglang.scheduler import register

        return register
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
