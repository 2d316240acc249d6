"""The benchmark client against a fake OpenAI-compatible streaming server on loopback."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import time
from typing import Any

import numpy as np
import pytest
from aiohttp import web

from feather_sched.bench.client import (
    ROUTING_KEY_HEADER,
    run_against_server,
    send_offsets,
    server_preemptions,
)
from feather_sched.results.records import RequestRecord
from feather_sched.workloads.spec import RequestSpec, Workload

FAIL_TOKEN = 0
"""A prompt holding this token id is rejected with HTTP 400."""
MODEL = "fake-model"


class FakeServer:
    """``/v1/models`` and streaming ``/v1/completions`` (and SGLang's ``/generate``, its
    tokens in one chunk), counting requests in flight and keeping each body and its
    routing-key header.

    Each completion streams ``max_tokens`` tokens ``tokens_per_chunk`` at a time, as
    ``token_ids`` lists or (``token_ids=False``) as one piece of text per chunk, then a
    usage chunk reporting half the prompt as cached (unless ``report_cached=False``).
    ``/metrics`` counts vLLM's preemptions on two engines: engine 0 one per completion
    served, engine 1 a constant 3 (no ``/metrics`` with ``metrics=False``).
    """

    def __init__(
        self,
        *,
        token_delay_s: float = 0.005,
        tokens_per_chunk: int = 1,
        token_ids: bool = False,
        report_cached: bool = True,
        metrics: bool = True,
    ) -> None:
        self.token_delay_s = token_delay_s
        self.tokens_per_chunk = tokens_per_chunk
        self.token_ids = token_ids
        self.report_cached = report_cached
        self.bodies: list[dict[str, Any]] = []
        self.routing_headers: list[str | None] = []
        self.in_flight = 0
        self.max_in_flight = 0
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/generate", self.generate)
        if metrics:
            app.router.add_get("/metrics", self.metrics)
        self.runner = web.AppRunner(app)

    async def __aenter__(self) -> str:
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        host, port = self.runner.addresses[0][:2]
        return f"http://{host}:{port}/"

    async def __aexit__(self, *exc: object) -> None:
        await self.runner.cleanup()

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL}, {"id": "other"}]})

    async def metrics(self, request: web.Request) -> web.Response:
        labels = 'model_name="fake-model"'
        return web.Response(text="\n".join([
            "# HELP vllm:num_preemptions_total Cumulative number of preemption.",
            "# TYPE vllm:num_preemptions_total counter",
            f'vllm:num_preemptions_total{{engine="0",{labels}}} {len(self.bodies)}.0',
            f'vllm:num_preemptions_created{{engine="0",{labels}}} 1.7e+09',
            f'vllm:num_preemptions_total{{engine="1",{labels}}} 3.0',
            f"vllm:num_requests_running{{{labels}}} 0.0", ""]))

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.routing_headers.append(request.headers.get(ROUTING_KEY_HEADER))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        count = body["sampling_params"]["max_new_tokens"]
        await response.write(sse({"output_ids": list(range(count)), "meta_info": {
            "completion_tokens": count, "prompt_tokens": len(body["input_ids"]),
            "cached_tokens": 0}}))
        await response.write(b"data: [DONE]\n\n")
        return response

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.routing_headers.append(request.headers.get(ROUTING_KEY_HEADER))
        if FAIL_TOKEN in body["prompt"]:
            return web.json_response({"error": {"message": "bad prompt"}}, status=400)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self.stream(request, body)
        finally:
            self.in_flight -= 1

    async def stream(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b": ping\n\n")
        total = body["max_tokens"]
        for first in range(0, total, self.tokens_per_chunk):
            await asyncio.sleep(self.token_delay_s)
            ids = list(range(first, min(first + self.tokens_per_chunk, total)))
            choice = {"index": 0, "text": "x" * len(ids)}
            if self.token_ids:
                choice["token_ids"] = ids
            await response.write(sse({"choices": [choice]}))
        usage: dict[str, Any] = {"prompt_tokens": len(body["prompt"]), "completion_tokens": total}
        if self.report_cached:
            usage["prompt_tokens_details"] = {"cached_tokens": len(body["prompt"]) // 2}
        await response.write(sse({"choices": [], "usage": usage}))
        await response.write(b"data: [DONE]\n\n")
        return response


def sse(data: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


def workload(n: int, *, output_len: int = 4, fail: tuple[int, ...] = (), arrivals=None) -> Workload:
    """``n`` requests with distinct 8-token prompts; indices in ``fail`` hold FAIL_TOKEN."""
    arrivals = [0.0] * n if arrivals is None else arrivals
    specs = [
        RequestSpec(
            f"r{i}",
            np.array([FAIL_TOKEN if i in fail else 1, *range(2, 8), 100 + i]),
            output_len,
            arrivals[i],
            group=i % 3,
        )
        for i in range(n)
    ]
    return Workload("test", specs)


def run(server: FakeServer, load: Workload, **kwargs: Any) -> tuple[list[RequestRecord], float]:
    async def go() -> tuple[list[RequestRecord], float]:
        async with server as base_url:
            return await run_against_server(load, base_url=base_url, **kwargs)

    return asyncio.run(go())


def test_streams_every_token_with_monotone_times() -> None:
    server, load = FakeServer(), workload(6, output_len=5)
    records, duration = run(server, load)
    assert [r.request_id for r in records] == [s.request_id for s in load]
    for record, spec in zip(records, load, strict=True):
        assert record.success and not record.error
        assert (record.prompt_len, record.group) == (spec.prompt.size, spec.group)
        assert record.output_len == 5
        assert record.ttft_s is not None and record.ttft_s > 0
        times = [record.submitted_s, *record.token_times_s, record.finished_s]
        assert times == sorted(times)
        assert record.finished_s <= duration
    body = server.bodies[0]
    assert body["model"] == MODEL  # the server's first model
    assert body["prompt"] == load.requests[0].prompt.tolist()
    assert (body["max_tokens"], body["min_tokens"], body["ignore_eos"]) == (5, 5, True)
    assert body["stream"] and body["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize("token_ids", [True, False])
def test_bundled_tokens_repeat_their_chunk_time(token_ids: bool) -> None:
    server = FakeServer(tokens_per_chunk=3, token_ids=token_ids)
    (record,), _ = run(server, workload(1, output_len=7), model=MODEL)
    assert record.success and record.output_len == 7
    assert record.token_times_s == sorted(record.token_times_s)
    assert len(set(record.token_times_s)) == 3  # three chunks: 3 + 3 + 1 tokens
    if token_ids:
        assert record.token_times_s[0] == record.token_times_s[2] < record.token_times_s[3]


def test_failed_requests_are_recorded_not_raised() -> None:
    done: list[str] = []
    records, _ = run(
        FakeServer(), workload(5, fail=(1, 3)), on_done=lambda r: done.append(r.request_id)
    )
    assert [r.success for r in records] == [True, False, True, False, True]
    for record in (records[1], records[3]):
        assert record.error.startswith("HTTP 400") and "bad prompt" in record.error
        assert record.token_times_s == [] and record.finished_s is not None
    assert sorted(done) == [f"r{i}" for i in range(5)]


def test_request_timeout_fails_the_request() -> None:
    (record,), _ = run(FakeServer(token_delay_s=0.2), workload(1), model=MODEL, timeout_s=0.3)
    assert not record.success and "Timeout" in record.error


def test_max_concurrency_is_respected() -> None:
    server = FakeServer(token_delay_s=0.01)
    records, _ = run(server, workload(12), max_concurrency=3)
    assert all(r.success for r in records)
    assert server.max_in_flight == 3


def test_request_rate_spreads_submissions() -> None:
    """No request goes out before its offset (``send_offsets``), so 20 requests at 50/s
    span about 0.4 s; how late each goes depends on the machine's load, so that is not
    asserted."""
    load = workload(20, output_len=1)
    records, duration = run(FakeServer(), load, request_rate=50.0)
    submitted = np.array([r.submitted_s for r in records])
    offsets = send_offsets(load, request_rate=50.0)
    assert np.all(np.diff(submitted) >= 0)
    assert np.all(submitted >= offsets - 1e-3)  # both from the run's start
    assert submitted[-1] - submitted[0] > 0.35
    assert duration >= submitted[-1]


def test_send_offsets() -> None:
    load = workload(20)
    offsets = send_offsets(load, request_rate=50.0, seed=1)
    assert np.all(np.diff(offsets) >= 0) and offsets[-1] == pytest.approx(0.4)
    assert np.array_equal(offsets, send_offsets(load, request_rate=50.0, seed=1))
    assert not np.array_equal(offsets, send_offsets(load, request_rate=50.0, seed=2))
    even = send_offsets(load, request_rate=50.0, burstiness=math.inf)
    assert np.allclose(np.diff(even), 0.02)
    assert not send_offsets(load).any() and not send_offsets(load, request_rate=math.inf).any()
    replay = workload(3, arrivals=[0.0, 0.5, 1.5])
    assert send_offsets(replay).tolist() == [0.0, 0.5, 1.5]
    with pytest.raises(ValueError, match="burstiness"):
        send_offsets(load, request_rate=1.0, burstiness=0.0)


def test_trace_arrivals_are_replayed() -> None:
    records, _ = run(FakeServer(), workload(2, output_len=1, arrivals=[0.0, 0.25]))
    assert records[1].submitted_s - records[0].submitted_s > 0.2


def test_unreachable_server_raises_connection_error_quickly() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    began = time.perf_counter()
    with pytest.raises(ConnectionError, match=f"{url}/v1/models"):
        asyncio.run(run_against_server(workload(2), base_url=url))
    assert time.perf_counter() - began < 5


@pytest.mark.parametrize("report", [True, False])
def test_cached_tokens_come_from_usage(report: bool) -> None:
    records, _ = run(FakeServer(report_cached=report), workload(2))
    expected = 8 // 2 if report else None
    assert [r.cached_tokens for r in records] == [expected, expected]


def test_tenants_go_in_vllm_xargs_and_stay_in_the_records() -> None:
    """Beside each record's tenant, the prompt tokens computed (less the cached ones):
    the input side of its service in the report."""
    server = FakeServer()
    load = Workload("t", [RequestSpec(f"r{i}", [1, 2, 3, 4 + i], 2, 0.0,
                                      tenant=("acme", "default")[i % 2]) for i in range(4)])
    records, _ = run(server, load)
    sent = {body["prompt"][-1] - 4: body.get("vllm_xargs") for body in server.bodies}
    assert sent == {0: {"tenant": "acme"}, 1: None, 2: {"tenant": "acme"}, 3: None}
    assert [r.tenant for r in records] == ["acme", "default"] * 2
    assert [r.computed_tokens for r in records] == [4 - 4 // 2] * 4  # less the cached half
    from feather_sched.bench.client import APIS

    generate = APIS["sglang"][1]  # SGLang's /generate: in its sampling params
    assert [generate(spec, MODEL)["sampling_params"].get("custom_params") for spec in load] \
        == [{"tenant": "acme"}, None] * 2


@pytest.mark.parametrize("api", ["openai", "sglang"])
def test_routing_keys_name_each_requests_prefix_group_where_sglang_reads_them(api) -> None:
    """``routing_keys``: a grouped request's group goes as SGLang's routing key (the
    header on the OpenAI API, ``routing_key`` in ``/generate``'s body), none for a
    request that shares nothing; without it, nothing is sent."""
    load = Workload("k", [RequestSpec(f"r{i}", [1, 2, 3 + i], 2, 0.0, group=(0, 5, -1)[i])
                          for i in range(3)])
    expected = {0: "group-0", 1: "group-5", 2: None}
    for routing_keys in (True, False):
        server = FakeServer()
        records, _ = run(server, load, api=api, routing_keys=routing_keys)
        assert all(r.success for r in records)
        last = [(b.get("prompt") or b.get("input_ids"))[-1] - 3 for b in server.bodies]
        sent = dict(zip(last, server.routing_headers if api == "openai" else
                        [b.get("routing_key") for b in server.bodies], strict=True))
        assert sent == (expected if routing_keys else dict.fromkeys(expected))
        if api == "sglang":
            assert server.routing_headers == [None] * 3
        else:
            assert all("routing_key" not in b for b in server.bodies)


def test_sglang_generate_chunks_count_tokens_from_meta_info() -> None:
    from feather_sched.bench.client import APIS, _fold_generate_chunk
    from feather_sched.results.records import RequestRecord

    record = RequestRecord("r", prompt_len=0, group=0, submitted_s=0.0)
    for now, count in ((0.5, 1), (0.7, 3), (0.9, 3)):
        _fold_generate_chunk(record, {"output_ids": list(range(count)), "meta_info": {
            "completion_tokens": count, "prompt_tokens": 5, "cached_tokens": 2}}, now)
    assert record.token_times_s == [0.5, 0.7, 0.7]
    assert (record.prompt_len, record.cached_tokens) == (5, 2)
    assert APIS["sglang"][0] == "/generate"


def test_priorities_go_in_vllms_field_and_stay_in_the_records() -> None:
    server = FakeServer()
    load = Workload("p", [RequestSpec(f"r{i}", [1, 2, 3 + i], 2, 0.0, priority=i % 2)
                          for i in range(4)])
    records, _ = run(server, load)
    sent = {body["prompt"][-1] - 3: body.get("priority") for body in server.bodies}
    assert sent == {0: None, 1: 1, 2: None, 3: 1}  # 0 is not sent
    assert [r.priority for r in records] == [0, 1, 0, 1]
    assert all(r.preemptions is None for r in records)  # a server reports none per request
    with pytest.raises(ValueError, match="openai API"):
        run(FakeServer(), load, api="sglang")


def test_server_preemptions_sum_vllms_counter_over_engines() -> None:
    async def read(server: FakeServer, served: int) -> float | None:
        async with server as base_url:
            server.bodies.extend([{}] * served)
            return await server_preemptions(base_url)

    assert asyncio.run(read(FakeServer(), 4)) == 7.0
    assert asyncio.run(read(FakeServer(metrics=False), 4)) is None


def test_bench_against_a_server_reports_classes_and_the_runs_preemptions(tmp_path) -> None:
    """``feather bench --base-url`` (the fake server on its own loop in a thread): the
    run's preemptions are the rise of the server's counter; classes are reported."""
    import threading

    from typer.testing import CliRunner

    from feather_sched.cli import app

    server, loop = FakeServer(), asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    url = asyncio.run_coroutine_threadsafe(server.__aenter__(), loop).result()
    out = tmp_path / "server.json"
    try:
        result = CliRunner().invoke(app, [
            "bench", "--base-url", url, "--groups", "2", "--prompts-per-group", "4",
            "--prefix-len", "16", "--output-len", "3", "--high-priority-share", "0.25",
            "--json", str(out)], env={"COLUMNS": "200"})
    finally:
        asyncio.run_coroutine_threadsafe(server.__aexit__(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
    assert result.exit_code == 0, result.output
    summary = json.loads(out.read_text())["runs"]["server"]
    assert summary["preemptions"] == 8 and summary["preemptions_by_group"] is None
    assert summary["scheduling_policy"] is None
    assert [c["requests"] for c in summary["by_priority"].values()] == [2, 6]
    assert sorted(body.get("priority", 0) for body in server.bodies) == [0, 0] + [1] * 6
    assert "Scheduling policy:                       n/a" in result.output
