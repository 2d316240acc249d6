"""Feather across two real vLLM replicas on real Ray Serve (CPU, embedded model, no mocks).

One Ray cluster for the module: two ``VLLMReplica``s (Feather scheduler, 1 GiB KV cache,
one CPU each, KV events on) behind ``OpenAIIngress`` routing with ``FeatherRequestRouter``
on its precise index at a tight load bound (``balance_abs=2``), so that a hot group
spreads with a few requests; both write Feather's files (bandit table, stats, step log)
under the same names.  Greedy
outputs and every answer's shape are compared with vLLM's own server (its own scheduler)
on the same model and server arguments.  Ray is imported unconditionally: a broken or
missing Ray install fails this module.
"""

from __future__ import annotations

import itertools
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from feather_sched.gates.bandit import UCBBanditGate
from feather_sched.gates.base import Decision, GateContext
from feather_sched.integrations.ray.app import (
    REPLICA_HEADER,
    build_app,
    unserved_server_flags,
)
from feather_sched.models import TINY_LLAMA
from feather_sched.serve import SERVER_MODULE, serve_replicas, vllm_server_args
from feather_sched.telemetry.stats import SchedulerStats
from feather_sched.telemetry.steplog import read_steps
from tests.helpers.servers import free_port, serving

vllm = pytest.importorskip("vllm", reason="the vllm extra is not installed")

Key = tuple[str, int]
PREFIX, SUFFIX = 256, 16  # two 128-token chunks shared by a group, then its own tokens
KV_GIB = 1
API_KEY = "feather-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}


def prompts(group: int, count: int) -> list[list[int]]:
    """``count`` prompts of one prefix group (seeded by the group number)."""
    rng = np.random.default_rng(group)
    prefix = rng.integers(1, 32000, PREFIX).tolist()
    return [prefix + rng.integers(1, 32000, SUFFIX).tolist() for _ in range(count)]


GROUPS = {name: prompts(g, 6) for g, name in enumerate(["a", "b", "c", "hot", "k1", "k2"])}
LENGTHS = {"a": 8, "b": 8, "c": 8, "hot": 32, "k1": 512, "k2": 512}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Iterator[str]:
    """vLLM's own server (its scheduler: no ``--scheduler-cls``, no Feather options) with
    the replicas' server arguments but the API key (its readiness probe lacks one; vLLM
    ignores the header without one), for the module: whose tokens and answers the
    replicas' must equal."""
    template = chat_template(tmp_path_factory)
    argv = vllm_server_args(None, {}, ["--enforce-eager", "--chat-template", str(template)],
                            kv_cache_gib=KV_GIB, environ={})
    for flag in ("--scheduler-cls", "--additional-config"):
        at = argv.index(flag)
        del argv[at:at + 2]
    directory = tmp_path_factory.mktemp("reference")
    metrics = directory / "metrics"
    metrics.mkdir()
    with serving([SERVER_MODULE, *argv], directory / "server.log",
                 {"PROMETHEUS_MULTIPROC_DIR": str(metrics)}) as address:
        yield address


@pytest.fixture(scope="module")
def expected(reference) -> dict[Key, list[int]]:
    """Greedy output token ids of every prompt from vLLM's own server, all sent at once."""
    keys = [(name, i) for name, group in GROUPS.items() for i in range(len(group))]

    def one(key: Key) -> list[int]:
        status, body, _ = complete(reference, GROUPS[key[0]][key[1]], LENGTHS[key[0]])
        assert status == 200, (key, body)
        return body["choices"][0]["token_ids"]

    with ThreadPoolExecutor(len(keys)) as pool:
        return dict(zip(keys, pool.map(one, keys), strict=True))


CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'forbidden' %}"
                 "{{ raise_exception('no forbidden role') }}{% endif %}"
                 "[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}[assistant] {% endif %}")
"""Given with ``--chat-template``, in place of the model's own."""


def chat_template(tmp_path_factory) -> Path:
    """``CHAT_TEMPLATE`` in a file (one for the module)."""
    template = tmp_path_factory.getbasetemp() / "template.jinja"
    template.write_text(CHAT_TEMPLATE)
    return template


@pytest.fixture(scope="module")
def metrics_port() -> int:
    """Where the module's Ray cluster exports metrics for Prometheus."""
    return free_port()


PRETRAINED = 3
"""Decisions in the bandit table every replica starts from."""


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """Where the replicas' Feather files go: a pre-trained bandit table is there."""
    directory = tmp_path_factory.mktemp("feather-files")
    gate = UCBBanditGate()
    context = GateContext(batch_size=5, chunk_loss=2, sharing_waiters=0, num_waiting=3)
    gate.reward([(context, Decision.STOP)] * PRETRAINED, batch_size=5, seconds=0.5)
    gate.save(directory / "bandit.json")
    return directory


@pytest.fixture(scope="module")
def url(expected, tmp_path_factory, metrics_port, files) -> Iterator[str]:
    """Ray (2 CPUs) with the app of two replicas (an API key, a chat template file, the
    same Feather file names, fair share between tenants), started after ``expected``
    (the reference server idle by then); torn down after the module."""
    template = chat_template(tmp_path_factory)
    feather = {"gate": "bandit", "state_file": str(files / "bandit.json"),
               "stats_file": str(files / "stats.json"), "step_log": str(files / "steps.csv"),
               "fairness": "tenants"}
    argv = vllm_server_args(None, feather, [
        "--enforce-eager", "--api-key", API_KEY, "--chat-template", str(template)],
        kv_cache_gib=KV_GIB, environ={})
    app = build_app(argv, replicas=2, router_options={"balance_abs": 2, "balance_rel": 1.0})
    port = free_port()
    started = time.monotonic()
    ray.init(num_cpus=2, include_dashboard=False, _metrics_export_port=metrics_port)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(app, name="feather", route_prefix="/")
        print(f"two replicas serving after {time.monotonic() - started:.0f} s")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def post(url: str, path: str, body: dict,
         headers: dict[str, str] = AUTH) -> tuple[int, dict, str | None]:
    """POST a JSON body (with the API key); (status, body, serving replica)."""
    request = urllib.request.Request(f"{url}{path}", data=json.dumps(body).encode(),
                                     headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, json.loads(response.read()), response.headers[REPLICA_HEADER]
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}"), None


def complete(url: str, prompt: list[int] | str, max_tokens: int,
             **extra) -> tuple[int, dict, str | None]:
    """POST a greedy completion; (status, body, serving replica)."""
    return post(url, "/v1/completions", {
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True, **extra})


def stream(url: str, path: str, body: dict) -> list[dict]:
    """POST a streamed request; its chunks, after checking the replica header and the
    closing [DONE]."""
    data = json.dumps({**body, "stream": True}).encode()
    request = urllib.request.Request(f"{url}{path}", data=data, headers=AUTH)
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.headers[REPLICA_HEADER]
        events = [line.removeprefix(b"data: ") for line in response.read().splitlines()
                  if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    return [json.loads(event) for event in events[:-1]]


def run(url: str, expected: dict[Key, list[int]], keys: list[Key],
        concurrency: int) -> dict[Key, str]:
    """Complete every (group, index) prompt; assert each equals vLLM's own server's
    output; return the replica that served each."""
    def one(key: tuple[str, int]) -> tuple[int, dict, str | None]:
        return complete(url, GROUPS[key[0]][key[1]], LENGTHS[key[0]])

    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, keys))
    for key, (status, body, _) in zip(keys, results, strict=True):
        assert status == 200, (key, body)
        assert body["choices"][0]["token_ids"] == expected[key], key
    return {key: replica for key, (_, _, replica) in zip(keys, results, strict=True)}


def test_a_group_stays_on_one_replica_while_load_allows(url, expected) -> None:
    keys = [(name, i) for i in range(4) for name in ("a", "b", "c")]  # interleaved groups
    served = run(url, expected, keys, concurrency=2)  # 2 in flight: always within the bound
    for name in ("a", "b", "c"):
        assert len({served[name, i] for i in range(4)}) == 1, served


def test_a_hot_group_spreads_to_the_second_replica(url, expected) -> None:
    served = run(url, expected, [("hot", i) for i in range(6)], concurrency=6)
    assert len(set(served.values())) == 2, served


def test_each_replica_writes_its_own_files(url, expected, files) -> None:
    """Under the same names: each replica's are its own (its Serve rank inserted), and
    each started from the shared pre-trained table, which none writes."""
    shared = (files / "bandit.json").read_bytes()
    served = run(url, expected, [("hot", i) for i in range(6)], concurrency=6)
    assert len(set(served.values())) == 2, served
    names = sorted(p.name for p in files.iterdir())
    assert names == ["bandit.json", "bandit.rank0.json", "bandit.rank1.json",
                     "stats.rank0.json", "stats.rank1.json", "steps.rank0.csv",
                     "steps.rank1.csv"], names  # a replica saves as soon as it drains
    assert (files / "bandit.json").read_bytes() == shared
    pretrained = UCBBanditGate()
    pretrained.load(files / "bandit.json")
    for rank in (0, 1):
        stats = SchedulerStats.read(files / f"stats.rank{rank}.json")
        assert stats.steps == len(read_steps(files / f"steps.rank{rank}.csv")) > 0
        own = UCBBanditGate()
        own.load(files / f"bandit.rank{rank}.json")
        assert all(own.table[context][decision].pulls >= arm.pulls  # it started warm
                   for context, arms in pretrained.table.items()
                   for decision, arm in arms.items())


def router_state(url: str) -> dict:
    """The ingress's Feather router: its index and, by replica, load and cached blocks."""
    request = urllib.request.Request(f"{url}/feather/router", headers=AUTH)
    with urllib.request.urlopen(request, timeout=30) as response:
        routers = json.loads(response.read())["routers"]
    assert len(routers) == 1
    return routers[0]


def wait_for(condition, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while not (found := condition()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)
    return found


def test_the_router_knows_what_each_replica_caches_from_its_kv_events(url) -> None:
    complete(url, [1, 2, 3], 1)  # the handle builds its router on its first call
    state = wait_for(lambda: (s := router_state(url))["index"] and all(  # start-up: each
        r["events"] and r["events"]["next_seq"] >= 1 and r["cached_blocks"] >= 1  # probe's
        for r in s["replicas"].values()) and s)  # block came through its events
    assert state["index"] == "precise" and state["hashing"]["block_size"] == 128
    for replica in state["replicas"].values():
        assert not replica["mismatch"] and replica["events"]["clears"] == 0
    before = {r: v["cached_blocks"] for r, v in state["replicas"].items()}
    prompt = [int(t) for t in np.random.default_rng(99).integers(1, 32000, 3 * 128 + 5)]
    _, _, served = complete(url, prompt, 2)
    assert wait_for(lambda: router_state(url)["replicas"][served]["cached_blocks"]
                    >= before[served] + 3)  # the header names the replica by its full id
    _, _, again = complete(url, [*prompt[:3 * 128], 7, 8, 9], 2)
    assert again == served  # where its three blocks are cached


def test_a_session_stays_on_its_replica(url) -> None:
    rng = np.random.default_rng(7)
    homes = set()
    for turn in range(4):  # prompts sharing nothing: only the session ties them
        prompt = [int(t) for t in rng.integers(1, 32000, 200)]
        headers = {**AUTH, "x-session-id": "chat-1"} if turn % 2 else AUTH
        extra = {} if turn % 2 else {"session_id": "chat-1"}
        _, _, served = post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 2,
                                                     **extra}, headers=headers)
        homes.add(served)
    assert len(homes) == 1


def test_a_killed_replica_loses_no_request_and_its_replacement_is_routed_by_events(
        url, expected) -> None:
    _, _, home = complete(url, GROUPS["k1"][0], 1)  # k1 now lives on `home`
    first = [("k1", 1), ("k2", 1), ("k1", 2), ("k2", 2), ("k1", 3), ("k2", 3)]
    with ThreadPoolExecutor(len(first)) as pool:
        batch = pool.submit(run, url, expected, first, len(first))
        wait_for(lambda: router_state(url)["replicas"][home]["load"] >= 3)  # three on `home`
        ray.kill(ray.get_actor(home, namespace="serve"), no_restart=True)
        after = run(url, expected, [("k1", 4), ("k2", 4), ("k1", 5), ("k2", 5)], 4)
        served = batch.result()
    assert home not in after.values(), after
    assert all(served[key] != home for key in first), served  # resent, and completed
    assert home not in router_state(url)["replicas"]  # its entries are gone
    # Serve starts a replacement; once it is up the router subscribes to its events
    replacement = wait_for(lambda: next(
        (r for r, v in router_state(url)["replicas"].items()
         if r != home and r not in set(after.values())
         and v["events"] and v["cached_blocks"] >= 1), None), timeout_s=240)
    up = time.monotonic()
    rng = np.random.default_rng(5)
    for _ in range(4):  # new groups go to it too: it holds the fewest prefixes
        prompt = [int(t) for t in rng.integers(1, 32000, 2 * 128 + 3)]
        complete(url, prompt, 1)
    state = wait_for(lambda: (s := router_state(url))["replicas"][replacement][
        "cached_blocks"] >= 3 and s)
    print(f"the replacement routed by its events {time.monotonic() - up:.1f} s after it "
          f"came up: {state['replicas'][replacement]}")
    assert time.monotonic() - up < 30


def test_the_endpoint_speaks_openai(url) -> None:
    models = json.loads(urllib.request.urlopen(
        urllib.request.Request(f"{url}/v1/models", headers=AUTH), timeout=30).read())
    assert models["data"][0]["id"] == "tiny-llama"
    with urllib.request.urlopen(f"{url}/health", timeout=30) as health:
        assert health.status == 200
    status, body, _ = complete(url, "Hello there, a text prompt", 4)
    assert status == 200 and body["usage"]["completion_tokens"] == 4
    assert body["usage"]["prompt_tokens"] > 4 and isinstance(body["choices"][0]["text"], str)
    status, body, _ = complete(url, [5, 32000, 7], 2)
    assert status == 400 and "vocab" in json.dumps(body)
    status, _, _ = complete(url, [5, 6], 2, model="another-model")
    assert status == 404
    chunks = stream(url, "/v1/completions", {
        "prompt": GROUPS["a"][0], "max_tokens": 8, "temperature": 0, "ignore_eos": True,
        "stream_options": {"include_usage": True}})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def exported(port: int) -> dict[str, tuple[float, set[str]]]:
    """From Ray's Prometheus export, per sample name: its values summed over replicas, and
    the replicas that export it (vLLM's ``ReplicaId`` label, Serve's ``replica``)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    found: dict[str, tuple[float, set[str]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            total, replicas = found.get(sample.name, (0.0, set()))
            replica = sample.labels.get("ReplicaId") or sample.labels.get("replica")
            found[sample.name] = (total + sample.value, replicas | ({replica} - {None, ""}))
    return found


SUCCEEDED = "ray_vllm_request_success_total"
"""vLLM's successful requests (its stat logger through Ray)."""
ADMITTED = "ray_feather_admission_deferral_seconds_count"
"""Requests Feather's schedulers admitted (relayed from the engine processes)."""


def test_each_replica_exports_vllm_and_feather_metrics_through_ray(url, metrics_port) -> None:
    """Ray reports metrics every few seconds: poll until the completions show.  vLLM's
    come from every replica; Feather's from every replica that has scheduled."""
    def counts() -> tuple[float, float, int, int]:
        found = exported(metrics_port)
        succeeded, vllm = found.get(SUCCEEDED, (0.0, set()))
        admitted, feather = found.get(ADMITTED, (0.0, set()))
        return succeeded, admitted, len(vllm), len(feather)

    before = counts()
    served = set()
    for group in ("a", "b", "c"):
        for prompt in GROUPS[group][:2]:
            status, _, replica = complete(url, prompt, 2)
            assert status == 200
            served.add(replica)
    deadline = time.monotonic() + 60
    while True:
        succeeded, admitted, vllm, feather = counts()
        if (succeeded >= before[0] + 6 and admitted >= before[1] + 6 and vllm >= 2
                and feather >= len(served)) or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert succeeded >= before[0] + 6 and admitted >= before[1] + 6
    assert vllm >= 2  # both replicas' engines (a restarted one's too)
    assert feather >= len(served)
    found = exported(metrics_port)
    assert found["ray_feather_gate_questions_total"][0] > 0
    assert "ray_feather_num_requests_running" in found


def test_chat_completions_render_the_given_chat_template_and_stream(url) -> None:
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hello "},
                                             {"type": "text", "text": "there"}]}]
    chat = {"messages": messages, "max_completion_tokens": 6, "temperature": 0,
            "ignore_eos": True}
    status, body, replica = post(url, "/v1/chat/completions", chat)
    assert status == 200 and replica and body["object"] == "chat.completion", body
    message = body["choices"][0]["message"]
    assert message["role"] == "assistant" and body["usage"]["completion_tokens"] == 6
    rendered = [{"role": "system", "content": "Be brief."},  # vLLM joins text parts so
                {"role": "user", "content": "Hello \nthere"}]
    ids = AutoTokenizer.from_pretrained(str(TINY_LLAMA)).apply_chat_template(
        rendered, chat_template=CHAT_TEMPLATE, add_generation_prompt=True, tokenize=True,
        return_dict=True)["input_ids"]  # --chat-template's, not the model's
    assert body["usage"]["prompt_tokens"] == len(ids)
    _, plain, _ = complete(url, ids, 6)
    assert message["content"] == plain["choices"][0]["text"]  # the same prompt, greedy
    chunks = stream(url, "/v1/chat/completions", chat)
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0]["role"] == "assistant" and all("role" not in d for d in deltas[1:])
    assert "".join(d["content"] for d in deltas) == message["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]
    assert post(url, "/v1/chat/completions", {"messages": image})[0] == 400
    status, refused, _ = post(url, "/v1/chat/completions", {
        "messages": [{"role": "forbidden", "content": "x"}]})
    assert status == 400 and "no forbidden role" in json.dumps(refused)
    assert post(url, "/v1/chat/completions", {**chat, "max_completion_tokens": 0})[0] == 400


def test_the_replicas_name_each_requests_tenant_as_feather_serve_does(url, expected) -> None:
    """With fair share on, each replica's vLLM app runs Feather's tenant middleware: the
    tenant a request names (the header, then ``vllm_xargs.tenant``, then ``user``) reaches
    its engine, such requests are served as any other, and a bad tenant is a 400 saying
    why; a ``user`` that is no tenant id names none."""
    status, answer, _ = complete(url, GROUPS["a"][1], LENGTHS["a"], user="u",
                                 vllm_xargs={"tenant": 7, "k": 1})
    assert status == 200 and answer["choices"][0]["token_ids"] == expected["a", 1]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert post(url, "/v1/chat/completions", chat, {**AUTH, "x-tenant-id": "gw"})[0] == 200
    odd_user = {**chat, "user": "u" * 300}  # OpenAI's, free-form: no tenant id, the default
    assert post(url, "/v1/chat/completions", odd_user, AUTH)[0] == 200
    for path, sent, headers, message in [
        ("/v1/completions", {"prompt": [5, 6], "max_tokens": 1}, {"x-tenant-id": "t" * 300},
         "the x-tenant-id header must be a non-empty string"),
        ("/v1/chat/completions", {**chat, "vllm_xargs": {"tenant": [1]}}, {},
         "vllm_xargs.tenant must be a non-empty string"),
    ]:
        status, answer, _ = post(url, path, sent, {**AUTH, **headers})
        assert status == 400 and answer["error"]["message"].startswith(message), answer


def test_the_api_key_guards_every_endpoint(url) -> None:
    completion = {"prompt": [5, 6], "max_tokens": 1}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    wrong = {**AUTH, "Authorization": "Bearer not-the-key"}
    for headers in ({"Content-Type": "application/json"}, wrong):
        assert post(url, "/v1/completions", completion, headers) == (
            401, {"error": "Unauthorized"}, None)
        assert post(url, "/v1/completions", {"bad": 1}, headers)[0] == 401  # key first
        assert post(url, "/v1/chat/completions", chat, headers)[0] == 401
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(f"{url}/v1/models", headers=headers),
                                   timeout=30)
        assert refused.value.code == 401
    assert post(url, "/v1/completions", completion)[0] == 200


def test_server_options_the_endpoint_would_drop_are_refused_before_anything_starts(
        tmp_path) -> None:
    argv = vllm_server_args(None, {}, [], kv_cache_gib=KV_GIB, environ={})
    served = [*argv, "--port", "9000", "--api-key", "k", "--middleware", "x.Y",
              "--max-log-len", "9", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    assert unserved_server_flags(served) == ([], [])  # each replica runs vLLM's own app
    dropped = [*argv, "--ssl-keyfile", "key.pem", "--root-path", "/x",
               "--uvicorn-log-level", "debug"]
    refused, ignored = unserved_server_flags(dropped)
    assert sorted(refused) == ["--root-path", "--ssl-keyfile"]
    assert ignored == ["--uvicorn-log-level"]
    with pytest.raises(ValueError, match="does not apply --ssl-keyfile"):
        build_app([*argv, "--ssl-keyfile", "key.pem"], replicas=2)
    with pytest.raises(ValueError, match="--chat-template"):
        build_app([*argv, "--chat-template", str(tmp_path / "missing.jinja")], replicas=2)
    with pytest.raises(ValueError, match="metrics port is the local cluster's"):
        serve_replicas(argv, replicas=2, address="auto", metrics_port=9000)


def replica_setup(app) -> tuple[list[str], dict]:
    """The replicas' vLLM arguments and their router's kwargs, from a built application."""
    replicas = app._bound_deployment.init_args[0]._bound_deployment
    config = replicas._deployment_config.request_router_config
    return replicas.init_args[0], config.request_router_kwargs


def test_feathers_router_turns_the_replicas_kv_events_on_unless_told_not_to() -> None:
    argv = vllm_server_args(None, {}, [], kv_cache_gib=KV_GIB, environ={})
    engine, router = replica_setup(build_app(argv, replicas=2))
    assert engine[-2] == "--kv-events-config" and router["kv_events"] is True
    engine, router = replica_setup(build_app(argv, replicas=2,
                                             router_options={"index": "approximate"}))
    assert "--kv-events-config" not in engine and router["kv_events"] is False
    own = [*argv, "--kv-events-config", '{"enable_kv_cache_events": true}']
    engine, router = replica_setup(build_app(own, replicas=2))
    assert engine == own and router["kv_events"] is True  # the user's, kept
    engine, router = replica_setup(build_app(argv, replicas=2, router="prefix-affinity"))
    assert "--kv-events-config" not in engine and "kv_events" not in router
    with pytest.raises(ValueError, match="precise or approximate"):
        build_app(argv, replicas=2, router_options={"index": "exact"})


def shape(value: object) -> object:
    """A JSON value's shape: its keys and the types of its leaves (not their values); a
    map of tokens to log probabilities by its size (its keys are the tokens drawn)."""
    if isinstance(value, dict) and value and all(isinstance(v, float) for v in value.values()):
        return f"{{token: float}} x {len(value)}"
    if isinstance(value, dict):
        return {key: shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [shape(item) for item in value]
    return type(value).__name__


PER_EVENT = ("finish_reason", "stop_reason", "prompt_token_ids")
"""Choice fields whose type depends on which token event carries them: the reasons are
``str`` on the event that ends the stream, the prompt's ids (``echo``) a list on the
first; how many tokens each event carries depends on the engine's pace."""


def token_event(event: object) -> object:
    """A stream event's shape with each choice's ``PER_EVENT`` fields as one type."""
    if isinstance(event, dict) and isinstance(event.get("choices"), list):
        event["choices"] = [{**choice, **{key: "per event" for key in PER_EVENT
                                          if key in choice}}
                            if isinstance(choice, dict) else choice
                            for choice in event["choices"]]
    return event


def answered(base: str, method: str, path: str, body: dict | None) -> tuple[int, object]:
    """(status, shape of the JSON or event stream answered) of one request; a stream's
    token events alike (``token_event``) and repeats of one event shape in a row counted
    once: how many token events vLLM sends depends on the engine's pace (the echo
    stream came as one token event or two, 1 run in 3)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{base}{path}", data=data, method=method, headers=AUTH)
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as error:
        status, raw = error.code, error.read()
    if raw.startswith(b"data: "):
        events = [line.removeprefix(b"data: ") for line in raw.splitlines()
                  if line.startswith(b"data: ")]
        shapes = [token_event(shape(json.loads(e))) if e != b"[DONE]" else "[DONE]"
                  for e in events]
        return status, [one for one, _ in itertools.groupby(shapes)]
    return status, shape(json.loads(raw)) if raw.strip() else None


TOOLS = [{"type": "function", "function": {
    "name": "weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
HI = [{"role": "user", "content": "What is the weather in Paris?"}]
SAME_BODIES = [
    ("GET", "/health", None, 200),
    ("GET", "/v1/models", None, 200),
    ("POST", "/v1/chat/completions", {"messages": HI, "tools": TOOLS, "tool_choice": "none",
                                      "max_tokens": 4}, 200),
    ("POST", "/v1/chat/completions", {"messages": HI, "tools": TOOLS, "max_tokens": 4},
     400),  # tool_choice auto needs --enable-auto-tool-choice: vLLM's own 400
    ("POST", "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 4, "logprobs": 2,
                                 "priority": 1, "cache_salt": "tenant-a",
                                 "presence_penalty": 0.5}, 200),
    ("POST", "/v1/chat/completions", {"messages": HI, "max_completion_tokens": 4,
                                      "logprobs": True, "top_logprobs": 2,
                                      "response_format": {"type": "json_object"},
                                      "seed": 1, "n": 2}, 200),
    ("POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 3, "stream": True,
                                 "stream_options": {"include_usage": True},
                                 "echo": True}, 200),
    ("POST", "/v1/completions", {"prompt": [5, 6], "max_tokens": 2, "model": "gpt-4"}, 404),
    ("POST", "/v1/completions", {"prompt": [5, 6], "max_tokens": 2, "beam_width": 3}, 200),
    ("POST", "/tokenize", {"prompt": "Hello there"}, 200),
]
"""Requests as clients send them, each with the status ``vllm serve`` gives it."""


def test_the_replicas_answer_every_body_as_vllms_own_server_does(url, reference) -> None:
    """Every field vLLM's server takes reaches the replicas' engine: the same request gets
    the same status and the same response shape from ``feather serve --replicas 2`` as
    from vLLM's own server with the same arguments, on every path (``/health``
    included)."""
    for method, path, body, status in SAME_BODIES:
        one = answered(reference, method, path, body)
        assert one[0] == status, (path, body, one)
        assert answered(url, method, path, body) == one, (path, body)
