"""pytest plugin for tests run against a vLLM release installed from its CUDA wheel without
its kernels (``scripts/drift.sh exec`` loads it through ``PYTEST_PLUGINS``).

Where the V1 model runner is gone (vLLM 0.34), the x86 CPU platform refuses to build any
``VllmConfig`` without Triton ("vLLM on x86 CPUs requires Triton (triton-cpu)"), which has
no build on PyPI: Model Runner V2 JITs Triton kernels on CPU. The tests here build configs
and run the scheduler's Python, never a kernel, so the plugin says Triton is present.
Where the V1 runner exists (0.32, 0.33) it changes nothing: there the flag would make the
V1 runner import the real ``triton``.
"""

from __future__ import annotations

from importlib.util import find_spec


def pytest_configure(config) -> None:
    if find_spec("vllm") is None or find_spec("vllm.v1.worker.gpu_model_runner") is not None:
        return
    import vllm.triton_utils

    vllm.triton_utils.HAS_TRITON = True
