"""Measure a running OpenAI-compatible server (vLLM or SGLang) as ``vllm bench serve`` does.

Requests are sent on a schedule (all at once, the workload's arrival times, or gamma gaps
at a target rate) under an optional concurrency cap, every completion streamed so each
output token's arrival is recorded; token counting follows vLLM's
``async_request_openai_completions`` (each streamed chunk with a choice is one arrival;
the final usage chunk fixes the output length).  A request's priority goes in the body's
``priority`` (when not 0), its tenant in ``vllm_xargs.tenant`` (SGLang's ``/generate``:
``sampling_params.custom_params.tenant``; when not the default tenant), which every vLLM
server carries to Feather's scheduler; with ``routing_keys``, its prefix group as SGLang's
routing key (``_keyed``).  The prompt tokens a server computed are the prompt less the
cached tokens its usage reports (``RequestRecord.prefill_cached``); ``server_preemptions``
reads the run's total from vLLM's ``/metrics``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import numpy as np

from feather_sched.core.tenants import DEFAULT_TENANT, TENANT_ARG
from feather_sched.results.records import RequestRecord
from feather_sched.workloads.spec import RequestSpec, Workload

MODELS_TIMEOUT_S = 10.0
"""Limit on the ``/v1/models`` query, so an unreachable server is reported quickly."""
ERROR_CHARS = 300
"""Error texts are squashed to one line of at most this many characters."""
PREEMPTIONS_METRIC = "vllm:num_preemptions_total"
"""vLLM's preemption counter on ``/metrics`` (one sample per engine)."""
ROUTING_KEY_HEADER = "x-smg-routing-key"
"""Where SGLang's OpenAI endpoints read a request's routing key
(``serving_base.OpenAIServingBase.extract_routing_key``); other servers ignore it."""


def send_offsets(
    workload: Workload,
    *,
    request_rate: float | None = None,
    burstiness: float = 1.0,
    seed: int = 0,
) -> np.ndarray:
    """When to send each request, in seconds from the run's start, in workload order.

    ``request_rate=None`` replays the workload's ``arrival_s`` (all zero: everything at
    once); ``inf`` sends everything at once; a finite rate draws seeded gamma gaps with shape
    ``burstiness`` and mean ``1/rate`` (1 = Poisson), rescaled like vLLM's ``get_request`` so
    the last request goes out at ``n / rate`` whatever the seed.
    """
    n = len(workload)
    if request_rate is None:
        return np.array([r.arrival_s for r in workload], dtype=float)
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0, got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(request_rate) or n == 0:
        return np.zeros(n)
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / request_rate)
    else:
        scale = 1.0 / (request_rate * burstiness)
        gaps = np.random.default_rng(seed).gamma(burstiness, scale, size=n)
    offsets = np.cumsum(gaps)
    return offsets * (n / request_rate / offsets[-1]) if offsets[-1] > 0 else offsets


async def run_against_server(
    workload: Workload,
    *,
    base_url: str,
    model: str | None = None,
    request_rate: float | None = None,
    max_concurrency: int | None = None,
    burstiness: float = 1.0,
    seed: int = 0,
    timeout_s: float = 600.0,
    on_done: Callable[[RequestRecord], None] | None = None,
    api: str = "openai",
    routing_keys: bool = False,
) -> tuple[list[RequestRecord], float]:
    """Stream every request of ``workload`` from the server; return (records, duration_s).

    Records come back in workload order with times relative to the run's start;
    ``submitted_s`` is when the request went out (after waiting for a concurrency slot, as
    vLLM's start time).  ``model=None`` asks the server for its first model and raises
    ``ConnectionError`` when it cannot be reached.  A failing request never raises: its
    record has ``success=False`` and the error text.  ``timeout_s`` limits each request;
    ``on_done`` is called as each request finishes (e.g. to advance a progress bar).
    ``api="sglang"``: SGLang's native ``/generate`` with ``input_ids`` (unlike its OpenAI
    endpoint, it serves token ids without a tokenizer); ``routing_keys``: ``_keyed``."""
    if api not in APIS:
        raise ValueError(f"api must be one of {', '.join(APIS)}, got {api!r}")
    if api != "openai" and any(spec.priority for spec in workload):
        raise ValueError(f"priorities are sent on the openai API (vLLM's priority field) "
                         f"only, not on {api!r}")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    offsets = send_offsets(workload, request_rate=request_rate, burstiness=burstiness, seed=seed)
    base_url = base_url.rstrip("/")
    connector = aiohttp.TCPConnector(
        limit=max_concurrency or 0, limit_per_host=max_concurrency or 0, keepalive_timeout=60
    )
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        model = model or await _first_model(session, base_url)
        slots = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
        path, payload_of, fold = APIS[api]
        url = f"{base_url}{path}"
        start = time.perf_counter()

        async def one(spec: RequestSpec) -> RequestRecord:
            payload, headers = _keyed(payload_of(spec, model), spec, api, routing_keys)
            async with slots:
                record = await _send(session, url, payload, spec, start, fold, headers)
            if on_done is not None:
                on_done(record)
            return record

        async with asyncio.TaskGroup() as group:
            tasks = []
            for spec, offset in zip(workload, offsets, strict=True):
                await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
                tasks.append(group.create_task(one(spec)))
        duration_s = time.perf_counter() - start
    return [task.result() for task in tasks], duration_s


async def server_preemptions(base_url: str) -> float | None:
    """The server's preemptions so far: vLLM's ``vllm:num_preemptions_total`` on
    ``/metrics``, summed over engines; None where ``/metrics`` cannot be read or has no
    such counter (e.g. SGLang).  The difference of two reads around a run is the run's
    count if nothing else uses the server meanwhile.  One HTTP request."""
    url = f"{base_url.rstrip('/')}/metrics"
    try:
        timeout = aiohttp.ClientTimeout(total=MODELS_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as session, \
                session.get(url) as response:
            response.raise_for_status()
            text = await response.text()
    except (aiohttp.ClientError, TimeoutError):
        return None
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith((f"{PREEMPTIONS_METRIC}{{", f"{PREEMPTIONS_METRIC} "))]
    return sum(values) if values else None


async def _first_model(session: aiohttp.ClientSession, base_url: str) -> str:
    """The first model id the server lists (``ConnectionError`` if it cannot be queried)."""
    url = f"{base_url}/v1/models"
    try:
        limit = aiohttp.ClientTimeout(total=MODELS_TIMEOUT_S)
        async with session.get(url, timeout=limit) as response:
            response.raise_for_status()
            listing = await response.json()
    except (aiohttp.ClientError, TimeoutError) as err:
        raise ConnectionError(f"cannot query {url}: {_describe(err)}") from err
    try:
        return str(listing["data"][0]["id"])
    except (KeyError, IndexError, TypeError):
        raise ValueError(f"{url} lists no models: {_squash(str(listing))}") from None


def _payload(spec: RequestSpec, model: str) -> dict[str, Any]:
    """A streamed greedy completion of exactly ``output_len`` tokens of a token-id prompt,
    with the request's priority class unless it is 0, and its tenant unless it is the
    default one (module docstring)."""
    return {
        **({"priority": spec.priority} if spec.priority else {}),
        **_tenant_arg("vllm_xargs", spec),
        "model": model,
        "prompt": spec.prompt.tolist(),
        "max_tokens": spec.output_len,
        "min_tokens": spec.output_len,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _generate_payload(spec: RequestSpec, model: str) -> dict[str, Any]:
    """The same request for SGLang's native ``/generate`` (token ids in, token ids out),
    its tenant in the sampling parameters' ``custom_params`` unless it is the default
    one (where SGLang carries it to Feather's scheduler)."""
    return {
        "input_ids": spec.prompt.tolist(),
        # ignore_eos fixes the length; SGLang refuses min_new_tokens without a tokenizer.
        "sampling_params": {"max_new_tokens": spec.output_len, "ignore_eos": True,
                            "temperature": 0, **_tenant_arg("custom_params", spec)},
        "stream": True,
    }


def routing_key(spec: RequestSpec) -> str | None:
    """The routing key of a request: its prefix group's (``group-N``); None for one that
    shares no prefix."""
    return f"group-{spec.group}" if spec.group >= 0 else None


def _keyed(payload: dict[str, Any], spec: RequestSpec, api: str, routing_keys: bool
           ) -> tuple[dict[str, Any], dict[str, str]]:
    """``payload`` and the request's headers, with its ``routing_key`` where
    ``routing_keys`` (``/generate``'s field on the sglang API, else SGLang's header)."""
    key = routing_key(spec) if routing_keys else None
    if key is None:
        return payload, {}
    if api == "sglang":
        return {**payload, "routing_key": key}, {}
    return payload, {ROUTING_KEY_HEADER: key}


def _tenant_arg(field: str, spec: RequestSpec) -> dict[str, Any]:
    """``{field: {"tenant": ...}}`` for a request of a tenant other than the default one,
    else nothing (a one-tenant body stays what any server takes)."""
    return {field: {TENANT_ARG: spec.tenant}} if spec.tenant != DEFAULT_TENANT else {}


async def _send(
    session: aiohttp.ClientSession,
    url: str,
    payload: dict[str, Any],
    spec: RequestSpec,
    start: float,
    fold: Callable[[RequestRecord, dict[str, Any], float], None],
    headers: dict[str, str],
) -> RequestRecord:
    """Send one request (with ``headers``) and record its token arrivals; failures end up
    in the record."""
    record = RequestRecord(
        spec.request_id, spec.prompt.size, spec.group, time.perf_counter() - start,
        priority=spec.priority, tenant=spec.tenant,
    )
    try:
        async with session.post(url, json=payload, headers=headers) as response:
            if response.status == 200:
                await _read_stream(response.content, record, start, fold)
            else:
                record.error = _squash(f"HTTP {response.status}: {await response.text()}")
    except Exception as err:  # one failed request must not end the run
        record.error = _describe(err)
    record.finished_s = time.perf_counter() - start
    return record


async def _read_stream(content: aiohttp.StreamReader, record: RequestRecord, start: float,
                       fold: Callable[[RequestRecord, dict[str, Any], float], None]) -> None:
    """Fold an SSE completion stream into the record; success needs at least one token."""
    async for line in _lines(content):
        if not line.startswith(b"data:"):
            continue  # blank separators, ``:`` comments (pings), other SSE fields
        payload = line.removeprefix(b"data:").strip()
        if payload == b"[DONE]":
            break
        data = json.loads(payload)
        if "error" in data:
            record.error = _squash(f"stream error: {data['error']}")
            return
        fold(record, data, time.perf_counter() - start)
    record.success = bool(record.token_times_s)
    if not record.success:
        record.error = "stream ended without any output token"


async def _lines(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """Yield each line as soon as it is complete, then any unterminated rest."""
    buffer = b""
    async for chunk in content.iter_any():
        *lines, buffer = (buffer + chunk).split(b"\n")
        for line in lines:
            yield line
    yield buffer


def _fold_chunk(record: RequestRecord, data: dict[str, Any], now_s: float) -> None:
    """Record one stream chunk: token arrivals from a choice, counts from usage."""
    usage = data.get("usage") or {}
    if choices := data.get("choices"):
        arrived = _chunk_tokens(choices[0], usage, record.output_len)
        record.token_times_s.extend([now_s] * arrived)
    elif usage.get("completion_tokens") is not None:
        _fit_to_count(record.token_times_s, int(usage["completion_tokens"]))
    if usage.get("prompt_tokens") is not None:
        record.prompt_len = int(usage["prompt_tokens"])
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is not None:
        record.prefill_cached(int(cached))


def _fold_generate_chunk(record: RequestRecord, data: dict[str, Any], now_s: float) -> None:
    """Record one chunk of SGLang's ``/generate`` stream: its running token count."""
    meta = data.get("meta_info") or {}
    if meta.get("completion_tokens") is not None:
        arrived = int(meta["completion_tokens"]) - record.output_len
        record.token_times_s.extend([now_s] * max(arrived, 0))
    if meta.get("prompt_tokens") is not None:
        record.prompt_len = int(meta["prompt_tokens"])
    if meta.get("cached_tokens") is not None:
        record.prefill_cached(int(meta["cached_tokens"]))


def _chunk_tokens(choice: dict[str, Any], usage: dict[str, Any], seen: int) -> int:
    """How many tokens one chunk carries: its token ids, a running usage count's jump, or 1."""
    if isinstance(choice.get("token_ids"), list):
        return len(choice["token_ids"])
    if usage.get("completion_tokens") is not None:
        return max(int(usage["completion_tokens"]) - seen, 0)
    return 1


def _fit_to_count(times: list[float], completion_tokens: int) -> None:
    """Match arrivals to the server's final token count, which vLLM's client trusts.

    Missing tokens came bundled with the last chunk and share its time; surplus arrivals
    were chunks without a token (e.g. a bare finish), so the earliest ones are kept.
    """
    if not times:
        return
    last = times[-1]
    del times[completion_tokens:]
    times.extend([last] * (completion_tokens - len(times)))


def _describe(err: BaseException) -> str:
    """An exception as one line: its type, then its message if it has one."""
    return _squash(f"{type(err).__name__}: {err}".removesuffix(": "))


def _squash(text: str) -> str:
    """Collapse whitespace to single spaces and cap the length, for one-line error texts."""
    return " ".join(text.split())[:ERROR_CHARS]


APIS = {
    "openai": ("/v1/completions", _payload, _fold_chunk),
    "sglang": ("/generate", _generate_payload, _fold_generate_chunk),
}
"""Endpoint, request body and stream folding of each server API."""
