"""The backends vLLM's registry names after Feather's plug-ins load: Feather's subclasses
where they import, vLLM's own classes (one warning) where they do not, so a plain vLLM
runs whatever breaks in Feather."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed")

from feather_sched.integrations.vllm import backends
from feather_sched.models import TINY_LLAMA
from tests.helpers.releases import prelude

# vLLM's own plug-in loading, in a fresh process where ``feather_sched.core`` cannot be
# imported, then vLLM's resolution of every backend Feather names; with argv[2] "run", a
# plain engine (vLLM's scheduler, no Feather option) generating greedily on the CPU.
BROKEN_CORE = textwrap.dedent("""
    import json, logging, sys
    sys.modules["feather_sched.core"] = None  # any import of it raises ImportError
    warnings = []

    class Collect(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    logging.getLogger("vllm.feather_sched").addHandler(Collect())
    from vllm.plugins import load_general_plugins
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E

    load_general_plugins()
    resolved = {m.name: m.get_path() for m in (E.CPU_ATTN, E.FLASH_ATTN, E.TRITON_ATTN)}
    from feather_sched.integrations.vllm import backends

    classes = {n: f"{c.__module__}.{c.__qualname__}" for n, c in
               ((n, getattr(backends, n)) for n in backends.SUBCLASSES)}
    tokens = None
    if sys.argv[2] == "run":
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(model=sys.argv[1], load_format="dummy", skip_tokenizer_init=True,
                  enforce_eager=True, seed=0, max_model_len=512, block_size=128,
                  kv_cache_memory_bytes=64 * 128 * 4096)
        prompts = [TokensPrompt(prompt_token_ids=list(range(1, 40)))] * 2
        params = SamplingParams(max_tokens=4, temperature=0.0, detokenize=False)
        tokens = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    print(json.dumps({"paths": resolved, "classes": classes, "tokens": tokens,
                      "warnings": warnings}))
""")


def broken_core(mode: str) -> dict:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_TARGET_DEVICE": "cpu"}
    env.pop("VLLM_PLUGINS", None)
    done = subprocess.run([sys.executable, "-c", prelude() + BROKEN_CORE, str(TINY_LLAMA),
                           mode],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


LOADED_BY_VLLM = ("feather_sched.integrations.vllm.plugins",
                  "feather_sched.integrations.vllm.backends",
                  "feather_sched.integrations.vllm.attention",
                  "feather_sched.integrations.vllm.attention_gpu",
                  "feather_sched.integrations.vllm.batch_order",
                  "feather_sched.integrations.vllm.scheduler",
                  "feather_sched.integrations.vllm.tenants")
"""Every module of Feather's that vLLM imports itself: the entry points' module, the
backends its registry names, the V1 runner's hook, ``--scheduler-cls`` and the server
middleware (run on each release by ``test_releases_harness.HARNESS``)."""


@pytest.mark.parametrize("module", LOADED_BY_VLLM)
def test_every_module_vllm_may_load_imports_on_this_release(module):
    importlib.import_module(module)


def test_each_name_resolves_to_feathers_subclass_where_it_imports():
    from feather_sched.integrations.vllm import attention, attention_gpu

    assert backends.SharedPrefixCPUBackend is attention.SharedPrefixCPUBackend
    assert backends.SharedPrefixFlashBackend is attention_gpu.SharedPrefixFlashBackend
    assert backends.SharedPrefixTritonBackend is attention_gpu.SharedPrefixTritonBackend
    with pytest.raises(AttributeError):
        backends.SharedPrefixNothing  # noqa: B018


def test_without_feathers_core_vllm_resolves_its_own_backends_with_one_warning_each():
    """As in a plain vLLM whose Feather install broke: the registry still names Feather's
    path (the plug-ins import no core), and vLLM's resolution yields vLLM's classes."""
    report = broken_core("resolve")
    assert report["paths"]["CPU_ATTN"] == backends.path("SharedPrefixCPUBackend")
    assert report["classes"] == {
        name: engines for name, (_, engines) in backends.SUBCLASSES.items()}
    fell_back = [line for line in report["warnings"] if "serves instead" in line]
    assert len(fell_back) == len(backends.SUBCLASSES), report["warnings"]
    assert all("feather_sched.core" in line for line in fell_back), fell_back


@pytest.mark.real_engine
def test_without_feathers_core_a_plain_vllm_engine_still_runs():
    report = broken_core("run")
    assert [len(tokens) for tokens in report["tokens"]] == [4, 4]
    assert report["tokens"][0] == report["tokens"][1]  # greedy, same prompt
