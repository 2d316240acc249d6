"""feather serve: the command it builds, and real servers probed the way users hurt them."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from feather_sched.cli import app
from feather_sched.serve import (
    KV_FLAG,
    SCHEDULER_CLS,
    SHUTDOWN_TIMEOUT_S,
    vllm_server_args,
)
from tests.helpers.replay_trace import REPLAY_FLAGS, REQUESTS, implied_hit_rate, write_trace
from tests.helpers.servers import (
    READY_TIMEOUT_S,
    bench_server,
    free_port,
    serving,
    wait_for,
    wait_until_serving,
)
from tests.telemetry.test_prometheus import documented_series, exposed_series


def flag(command: list[str], name: str) -> str | None:
    return command[command.index(name) + 1] if name in command else None


def test_command_merges_feather_options_into_additional_config() -> None:
    command = vllm_server_args(None, {"gate": "bandit"},
                               ["--additional-config", '{"other": 1}', "--port", "9"],
                               environ={})
    config = json.loads(flag(command, "--additional-config"))
    assert config == {"other": 1, "feather": {"gate": "bandit"}}
    assert flag(command, "--scheduler-cls") == SCHEDULER_CLS
    assert command[-2:] == ["--port", "9"] and "--load-format" in command
    assert "--skip-tokenizer-init" not in command  # the embedded model has a tokenizer
    assert flag(command, "--shutdown-timeout") == str(SHUTDOWN_TIMEOUT_S)


def test_the_kv_cache_is_the_size_asked_for() -> None:
    assert flag(vllm_server_args(None, {}, [], kv_cache_gib=0.25, environ={}),
                KV_FLAG) == str(2**28)
    explicit = vllm_server_args(None, {}, [KV_FLAG, "268435456"], environ={})
    assert explicit.count(KV_FLAG) == 1 and explicit[-2:] == [KV_FLAG, "268435456"]
    assert flag(vllm_server_args(None, {}, [], environ={}), KV_FLAG) == str(4 * 2**30)
    assert KV_FLAG not in vllm_server_args(None, {}, [], on_cpu=False, environ={})
    with pytest.raises(ValueError, match="VLLM_CPU_KVCACHE_SPACE is set"):
        vllm_server_args(None, {}, [], kv_cache_gib=1, environ={"VLLM_CPU_KVCACHE_SPACE": "4"})
    with pytest.raises(ValueError, match="not both"):
        vllm_server_args(None, {}, [KV_FLAG, "1"], kv_cache_gib=1, environ={})
    kept = vllm_server_args(None, {}, ["--shutdown-timeout", "5"], environ={})
    assert kept.count("--shutdown-timeout") == 1 and kept[-1] == "5"


def test_bad_options_fail_before_the_server_starts(tmp_path) -> None:
    with pytest.raises(ValueError, match="feather option 'gate'"):
        vllm_server_args(None, {"gate": "sometimes"}, [], environ={})
    with pytest.raises(ValueError, match="FEATHER_MAX_WAIT_S='soon'"):
        vllm_server_args(None, {}, [], environ={"FEATHER_MAX_WAIT_S": "soon"})
    with pytest.raises(ValueError, match=r"'state_file'.*does not exist"):
        vllm_server_args(None, {"gate": "bandit",
                                "state_file": str(tmp_path / "no" / "t.json")}, [],
                         environ={})
    with pytest.raises(ValueError, match="sets --scheduler-cls itself"):
        vllm_server_args(None, {}, ["--scheduler-cls", "x.Y"], environ={})


def test_a_metrics_port_without_replicas_is_refused() -> None:
    result = CliRunner().invoke(app, ["serve", "--metrics-port", "9000", "--dry-run"],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 2 and "--metrics-port is for --replicas" in result.output


def test_serve_outside_the_supported_vllm_range_says_so_once_and_runs(monkeypatch) -> None:
    from feather_sched.integrations.vllm import compat

    monkeypatch.setattr(compat, "installed_version", lambda: "0.35.0")
    result = CliRunner().invoke(app, ["serve", "--dry-run"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert result.output.count("feather-sched supports vLLM >=0.32.0,<0.35, this is vLLM "
                               "0.35.0") == 1
    monkeypatch.undo()
    result = CliRunner().invoke(app, ["serve", "--dry-run"], env={"COLUMNS": "200"})
    assert result.exit_code == 0 and "supports vLLM" not in result.output


@dataclass
class Server:
    """The module's ``feather serve``: where it answers, its log, its process and the
    directory of Feather's files (``bandit.json``, ``stats.json``)."""

    url: str
    log: Path
    process: subprocess.Popen
    state_dir: Path


@pytest.fixture(scope="module")
def feather_server(tmp_path_factory) -> Iterator[Server]:
    """One ``feather serve`` for the module: bandit gate saving its table and stats every
    0.5 s, fair share between tenants, vLLM logging each request's sampling parameters.
    ``test_a_server_no_client_or_disk_can_take_down``, the module's last test on it,
    stops it (SIGTERM under load); the fixture kills what is left."""
    pytest.importorskip("vllm", reason="the vllm extra is not installed")
    directory = tmp_path_factory.mktemp("feather-serve")
    state_dir = directory / "state"
    state_dir.mkdir()
    options = json.dumps({"gate": "bandit", "fairness": "tenants",
                          "state_file": str(state_dir / "bandit.json"),
                          "stats_file": str(state_dir / "stats.json"), "save_every_s": 0.5})
    port, log = free_port(), directory / "server.log"
    command = [sys.executable, "-m", "feather_sched.cli", "serve", "--enforce-eager",
               "--kv-cache-gib", "1", "--feather-options", options, "--enable-log-requests",
               "--host", "127.0.0.1", "--port", str(port)]
    env = {**os.environ, "FEATHER_SGLANG": "", "PROMETHEUS_MULTIPROC_DIR": ""}
    with open(log, "w") as handle:
        process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_serving(url, process, READY_TIMEOUT_S)
        yield Server(url, log, process, state_dir)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def test_a_fresh_feather_serve_lists_every_documented_counter(feather_server) -> None:
    """Before its first request, the server's /metrics lists every ``feather:`` counter
    docs/metrics.md documents, with HELP and TYPE, at zero (the engine-core process's
    scheduler, collected by vLLM's server)."""
    url = feather_server.url
    metrics = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    counters = documented_series("counter")
    assert "feather:faults_total" in counters and "feather:preemptions_total" in counters
    assert exposed_series(metrics, counters) == set(counters)
    assert re.search(r'^feather:tenant_service_tokens_total\{.*tenant="default".*\} 0\.0$',
                     metrics, re.M)


def test_feather_serve_answers_feather_bench(feather_server, tmp_path) -> None:
    url, log = feather_server.url, feather_server.log
    summary = bench_server(url, tmp_path / "server.json", "feather-server",
                           "--max-concurrency", "4")
    metrics = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    replay = bench_server(url, tmp_path / "replay.json", "replay", "--trace",
                          str(write_trace(tmp_path / "trace.jsonl")), *REPLAY_FLAGS)
    # the trace's requests with their own lengths and times, its sharing in the cache
    assert replay["completed"] == len(REQUESTS)
    assert replay["prefix_cache_hit_rate"] == pytest.approx(implied_hit_rate(), abs=0.02)
    assert summary["completed"] == 6 and summary["total_output_tokens"] == 30
    assert summary["prefix_cache_hit_rate"] > 0.3
    assert "Feather scheduler" in log.read_text()
    # Feather's metrics come from the engine-core process, on vLLM's own endpoint
    assert "# HELP feather:gate_decisions_total" in metrics
    admitted = re.findall(r'^feather:gate_decisions_total\{decision="add",.*\} ([0-9.]+)$',
                          metrics, re.M)
    assert admitted and float(admitted[0]) >= 1
    assert "feather:admission_deferral_seconds_bucket" in metrics
    assert "vllm:num_requests_running" in metrics


def post(url: str, path: str, body: dict | bytes, timeout: float = 60,
         headers: dict[str, str] | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(f"{url}{path}", data=data, headers={
        "Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def test_feather_serve_names_each_requests_tenant(feather_server, tmp_path) -> None:
    """The ``x-tenant-id`` header wins, then ``vllm_xargs.tenant``, then OpenAI's ``user``:
    vLLM hands its engine the tenant named in the sampling parameters' ``extra_args`` (its
    request log says so), a ``user`` that is no tenant id names none; a bad header or
    ``vllm_xargs.tenant`` is a 400 saying why; a body that is not JSON is
    vLLM's own 400; feather bench's multi-tenant workload comes back per tenant."""
    url, log = feather_server.url, feather_server.log
    prompt = {"prompt": [5, 6, 7], "max_tokens": 2}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    named = [
        ("/v1/completions", {"x-tenant-id": "gw"},
         {**prompt, "user": "u", "vllm_xargs": {"tenant": "x", "k": 1}},
         "extra_args={'tenant': 'gw', 'k': 1}"),
        ("/v1/completions", {}, {**prompt, "user": "u", "vllm_xargs": {"tenant": 7}},
         "extra_args={'tenant': '7'}"),
        ("/v1/completions", {}, {**prompt, "user": "u"}, "extra_args={'tenant': 'u'}"),
        ("/v1/completions", {}, prompt, "extra_args=None"),
        ("/v1/chat/completions", {}, {**chat, "user": "chat user"},
         "extra_args={'tenant': 'chat user'}"),
        ("/v1/chat/completions", {}, {**chat, "user": "u" * 300},  # OpenAI's, free-form
         "extra_args=None"),
    ]
    for path, headers, body, logged in named:
        status, answer = post(url, path, body, headers=headers)
        assert status == 200, answer
        received = [line for line in log.read_text().splitlines()
                    if f"Received request {answer['id']}" in line]
        assert len(received) == 1 and logged in received[0], (logged, received)
    refused = [
        ("/v1/completions", {"x-tenant-id": "t" * 300}, prompt,
         "the x-tenant-id header must be a non-empty string of at most 256"),
        ("/v1/completions", {}, {**prompt, "vllm_xargs": {"tenant": [1]}},
         "vllm_xargs.tenant must be a non-empty string"),
    ]
    for path, headers, body, message in refused:
        status, answer = post(url, path, body, headers=headers)
        assert status == 400 and answer["error"]["message"].startswith(message), answer
    status, answer = post(url, "/v1/completions", b'{"prompt": [5, 6', headers={
        "x-tenant-id": "t" * 300})
    assert status == 400 and "tenant" not in json.dumps(answer)  # vLLM's own answer
    summary = bench_server(url, tmp_path / "tenants.json", "tenants", "--workload",
                           "multi-tenant", "--suffix-len", "16")
    tenants = summary["by_tenant"]
    assert {name: t["requests"] for name, t in tenants.items()} == {"t0": 12, "t1": 3}
    received = "\n".join(line for line in log.read_text().splitlines()
                         if "Received request" in line)
    assert "extra_args={'tenant': 't0'}" in received
    assert "extra_args={'tenant': 't1'}" in received
    # the flood's shared prefix costs it once: its service is well under full prompts
    flood_prompts = 12 * (256 + 16)
    assert 256 + 12 * 16 <= tenants["t0"]["service"] - 2 * 12 * 5 < flood_prompts
    assert tenants["t1"]["service"] == 3 * (256 + 16) + 2 * 3 * 5  # nothing shared
    assert summary["max_service_gap"] is not None


def _stopped_under_load(server: Server, model: str) -> tuple[float, list[int]]:
    """SIGTERM ``server`` while 8 requests are on their way in or running; the seconds it
    took to exit and the requests' statuses."""
    results: list[int] = []

    def one(i: int) -> None:
        results.append(post(server.url, "/v1/completions", {
            "model": model, "prompt": f"load {i} " * 50, "max_tokens": 60}, timeout=120)[0])

    load = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for thread in load:
        thread.start()
    time.sleep(2)  # the load on its way in (sent, some of it running)
    stopped = time.monotonic()
    os.killpg(server.process.pid, signal.SIGTERM)
    server.process.wait(timeout=SHUTDOWN_TIMEOUT_S + 30)
    drained_s = time.monotonic() - stopped
    for thread in load:
        thread.join(timeout=30)
    return drained_s, results


def test_a_server_no_client_or_disk_can_take_down(feather_server) -> None:
    """Text and chat prompts work; an out-of-vocabulary id is a 400; a state directory
    that vanishes at run time is logged, not fatal; SIGTERM under load drains, saves
    the bandit table and exits within the shutdown timeout; nothing the module's other
    tests sent (bad tenants, a body that is not JSON) left a traceback.  It stops the
    module's server: the last test on it."""
    url, state_dir = feather_server.url, feather_server.state_dir
    model = json.loads(urllib.request.urlopen(f"{url}/v1/models").read())["data"][0]["id"]
    status, body = post(url, "/v1/completions", {"model": model, "prompt": "Hello there",
                                                 "max_tokens": 4})
    assert status == 200 and body["usage"]["completion_tokens"] == 4
    status, body = post(url, "/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert status == 200 and body["choices"][0]["message"]["content"] is not None
    status, body = post(url, "/v1/completions", {"model": model, "prompt": [5, 32000, 7],
                                                 "max_tokens": 2})
    assert status == 400 and "out of vocabulary" in json.dumps(body)
    shutil.rmtree(state_dir)  # every write Feather makes now fails
    for _ in range(3):
        assert post(url, "/v1/completions", {"model": model, "prompt": "again and again",
                                             "max_tokens": 40})[0] == 200
    wait_for(lambda: "could not write its stats file" in feather_server.log.read_text(),
             "the failed write logged", timeout_s=30)  # a save is due every 0.5 s
    assert post(url, "/v1/completions", {"model": model, "prompt": "still here",
                                         "max_tokens": 4})[0] == 200
    state_dir.mkdir()
    drained_s, results = _stopped_under_load(feather_server, model)
    text = feather_server.log.read_text()
    # vLLM 0.32's API server logs EngineDeadError from its output handler once the engine
    # core has drained and exited; that is its own shutdown. Nothing may fail before it, and
    # no traceback anywhere may pass through Feather.
    serving, teardown, _ = text.partition("starting resource teardown")
    assert teardown and "Traceback" not in serving
    frames = [line for line in text.splitlines() if 'File "' in line]
    assert not [line for line in frames if "feather_sched" in line], frames
    assert drained_s < SHUTDOWN_TIMEOUT_S + 15, drained_s
    assert results and all(code == 200 for code in results), results  # drained, not cut
    saved = json.loads((state_dir / "bandit.json").read_text())  # saved at exit
    assert saved["format"] == "feather-bandit"
    assert json.loads((state_dir / "stats.json").read_text())["steps"] > 0


def _steps_and_groups(url: str) -> tuple[float, float]:
    """``feather:prefix_groups_per_step``'s count and sum so far (steps, groups in them)."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    return tuple(sum(float(value) for value in re.findall(
        rf"^feather:prefix_groups_per_step_{part}\{{.*\}} ([0-9.e+]+)$", text, re.M))
        for part in ("count", "sum"))


def _together(url: str, bodies: list[dict]) -> tuple[float, float]:
    """Send ``bodies`` at once; the steps they ran and the prefix groups per step."""
    before = _steps_and_groups(url)
    answers: list = [None] * len(bodies)
    threads = [threading.Thread(target=lambda i=i, body=body: answers.__setitem__(
        i, post(url, "/v1/completions", body))) for i, body in enumerate(bodies)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [status for status, _ in answers] == [200] * len(bodies), answers
    steps, groups = (after - was for after, was in zip(_steps_and_groups(url), before,
                                                          strict=True))
    return steps, groups / steps


OUTPUT_TOKENS = 128


def test_feather_serve_keeps_cache_salts_apart_and_vllms_api_as_it_is(tmp_path) -> None:
    """With prefix caching off (Feather keys by tokens then), two requests of one 2K prefix
    under two ``cache_salt`` values run as two prefix groups every step, unsalted as one
    (probes 38/39 of the newcomer review); with tenants off, a tenant header vLLM takes is
    taken (a 300-character one: 200); the embedded model is served as ``tiny-llama``."""
    pytest.importorskip("vllm", reason="the vllm extra is not installed")
    command = ["feather_sched.cli", "serve", "--enforce-eager", "--kv-cache-gib", "1",
               "--no-enable-prefix-caching"]
    with serving(command, tmp_path / "server.log", {"PROMETHEUS_MULTIPROC_DIR": ""}) as url:
        models = json.loads(urllib.request.urlopen(f"{url}/v1/models", timeout=10).read())
        assert [model["id"] for model in models["data"]] == ["tiny-llama"]
        for header in ("t" * 300, "", "a\tb", "default"):
            status, answer = post(url, "/v1/completions", {"prompt": [5, 6], "max_tokens": 2},
                                  headers={"x-tenant-id": header})
            assert status == 200, answer
        # Long enough that the two requests' arrival skew (a few steps on a loaded
        # machine) is a small part of their run.
        prompt = {"prompt": list(range(100, 100 + 2048)), "max_tokens": OUTPUT_TOKENS,
                  "ignore_eos": True, "model": "tiny-llama"}
        salted_steps, salted = _together(url, [{**prompt, "cache_salt": salt}
                                               for salt in ("tenantA", "tenantB")])
        # one body of two prompts: vLLM adds both at once, whatever the machine's load
        plain_steps, plain = _together(url, [{**prompt, "prompt": [prompt["prompt"]] * 2}])
    print(f"groups per step: salted {salted:.2f} over {salted_steps:.0f} steps, "
          f"unsalted {plain:.2f} over {plain_steps:.0f}")
    assert plain == 1.0 and plain_steps < 1.5 * OUTPUT_TOKENS  # together, as one group
    assert salted >= 1.9  # two groups (a step or two may hold one request alone)
