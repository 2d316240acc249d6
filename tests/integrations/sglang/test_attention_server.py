"""Shared-prefix decode on SGLang's real server (CPU, torch_native, fp32): greedy outputs
identical with the path on and off, over prefix groups, singletons, chunked prefill and
retractions (SGLang's own test switch, ``SGLANG_TEST_RETRACT``, retracts decoding requests
every third step, and they come back through Feather's queue and SGLang's prefix cache)."""

from __future__ import annotations

import json
import os
import shutil
import urllib.request
from pathlib import Path

import pytest
import torch

from feather_sched.bench.cht.sglang_policy import sglang_installed
from tests.helpers.servers import BOUNDED_POOL, SGLANG_READY, serving

if not sglang_installed():
    pytest.skip("SGLang is not installed (scripts/setup.sh --sglang)", allow_module_level=True)

from feather_sched.models import TINY_LLAMA

PROBE = '''\
import os
if os.environ.get("FEATHER_TEST_PROBE"):
    from feather_sched.attention import cpu_kernel
    _attend = cpu_kernel.attend_groups
    def attend_groups(plan, *args, **kwargs):
        with open(os.environ["FEATHER_TEST_PROBE"], "a") as probe:
            probe.write(f"{len(plan.tokens)}\\n")
        return _attend(plan, *args, **kwargs)
    cpu_kernel.attend_groups = attend_groups
'''
"""A ``sitecustomize`` counting, in the server's processes, the rows the path computed."""


def checkpoint(path: Path) -> Path:
    """The tiny Llama in fp32 with weights large enough for peaked attention (SGLang's
    dummy weights, +-1e-3, leave it near uniform: a wrong prefix would hardly show)."""
    path.mkdir()
    config = json.loads((TINY_LLAMA / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "torch_dtype": "float32"}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY_LLAMA / name, path / name)
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(0)
    hidden, inner, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * std

    weights = {"model.embed_tokens.weight": normal(vocab, hidden, std=1.0),
               "model.norm.weight": torch.ones(hidden),
               "lm_head.weight": normal(vocab, hidden, std=0.05)}
    for layer in range(config["num_hidden_layers"]):
        at = f"model.layers.{layer}."
        weights |= {at + "input_layernorm.weight": torch.ones(hidden),
                    at + "post_attention_layernorm.weight": torch.ones(hidden)}
        for name in ("q_proj", "k_proj"):
            weights[f"{at}self_attn.{name}.weight"] = normal(hidden, hidden, std=0.08)
        for name in ("v_proj", "o_proj"):
            weights[f"{at}self_attn.{name}.weight"] = normal(hidden, hidden, std=0.04)
        weights |= {at + "mlp.gate_proj.weight": normal(inner, hidden, std=0.04),
                    at + "mlp.up_proj.weight": normal(inner, hidden, std=0.04),
                    at + "mlp.down_proj.weight": normal(hidden, inner, std=0.04)}
    save_file(weights, str(path / "model.safetensors"))
    return path


def prompts() -> tuple[list[list[int]], list[int]]:
    """Three groups of four (prefixes of 300-700 tokens, chunked at 256), two singletons,
    interleaved; output lengths vary, so groups shrink while they decode."""
    generator = torch.Generator().manual_seed(1)

    def tokens(count: int) -> list[int]:
        return torch.randint(3, 32000, (count,), generator=generator).tolist()

    prefixes = [tokens(n) for n in (300, 520, 700)]
    batch = [prefixes[i % 3] + tokens(10 + 7 * i) for i in range(12)]
    batch[4:4] = [tokens(450), tokens(610)]
    return batch, [24 + 3 * (i % 5) for i in range(len(batch))]


def generate(url: str, batch: list[list[int]], lengths: list[int]) -> list[list[int]]:
    body = json.dumps({"input_ids": batch, "sampling_params": [
        {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True} for n in lengths]})
    request = urllib.request.Request(f"{url}/generate", body.encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return [item["output_ids"] for item in json.loads(response.read())]


def run_server(tmp_path: Path, model: Path, mode: str) -> tuple[list[list[int]], str, int]:
    """The outputs, the log and the rows the path computed, of a server whose option
    ``shared_prefix_attention`` is ``mode``."""
    probe, log = tmp_path / f"{mode}.probe", tmp_path / f"{mode}.log"
    options = json.dumps({"gate": "always", "shared_prefix_attention": mode})
    command = ["feather_sched.integrations.sglang.launch", "--model-path", str(model),
               "--device", "cpu", "--skip-tokenizer-init", "--dtype", "float32",
               "--attention-backend", "torch_native", "--schedule-policy", "feather",
               "--feather-options", options, "--chunked-prefill-size", "256",
               "--random-seed", "0", *BOUNDED_POOL]
    sitecustomize = tmp_path / "site"
    sitecustomize.mkdir(exist_ok=True)
    (sitecustomize / "sitecustomize.py").write_text(PROBE)
    env = {"FEATHER_TEST_PROBE": str(probe), "SGLANG_TEST_RETRACT": "1",
           "PYTHONPATH": os.pathsep.join([str(sitecustomize),
                                          *filter(None, [os.environ.get("PYTHONPATH")])])}
    with serving(command, log, env, SGLANG_READY) as url:
        batch, lengths = prompts()
        outputs = generate(url, batch, lengths)
    rows = sum(int(line) for line in probe.read_text().split()) if probe.exists() else 0
    return outputs, log.read_text(), rows


def test_greedy_outputs_are_identical_with_the_path_on_and_off(tmp_path):
    model = checkpoint(tmp_path / "model")
    on, on_log, on_rows = run_server(tmp_path, model, "on")  # auto's check: test_attention
    off, off_log, off_rows = run_server(tmp_path, model, "off")
    assert "Feather shared-prefix attention: on (on; torch_native" in on_log
    assert "Feather shared-prefix attention: off (option" in off_log
    assert on_rows > 0 and off_rows == 0  # the path computed grouped rows, only when on
    for log in (on_log, off_log):  # both servers retracted decoding requests
        retracted = [int(line.split("#retracted_reqs: ")[1].split(",")[0])
                     for line in log.splitlines() if "Testing retraction. #retracted_reqs" in line]
        assert sum(retracted) > 0, log[-3000:]
    assert [len(o) for o in on] == prompts()[1]
    assert on == off
