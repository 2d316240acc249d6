"""Test-wide set-up: SGLang's scheduler code imports on this CPU machine as in the product
(``feather_sched.stand_ins``)."""

from __future__ import annotations

from feather_sched.stand_ins import prepare_sglang_import

prepare_sglang_import()
