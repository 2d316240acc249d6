"""pytest plugin for tests run against a vLLM release installed from its CUDA wheel without
its kernels (``scripts/drift.sh exec`` loads it through ``PYTEST_PLUGINS``).

vLLM 0.34's x86 CPU platform refuses to check any config without Triton ("vLLM on x86 CPUs
requires Triton (triton-cpu)"; 0.32 and 0.33 only warn), and triton-cpu has no build on
PyPI. The tests here build configs and run the scheduler's Python, never a kernel, so
while the platform checks a config it is told Triton is present; nowhere else (Model
Runner V2's modules, imported for its batch order, build Triton kernels where it is).
"""

from __future__ import annotations

from importlib.util import find_spec


def pytest_configure(config) -> None:
    if find_spec("vllm") is None:
        return
    import vllm.triton_utils
    from vllm.platforms.cpu import CpuPlatform

    checks = CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        present = vllm.triton_utils.HAS_TRITON
        vllm.triton_utils.HAS_TRITON = True
        try:
            checks(cls, vllm_config)
        finally:
            vllm.triton_utils.HAS_TRITON = present

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
