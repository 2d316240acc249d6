"""TenantMiddleware as ASGI sees it: which requests it reads, the body it hands on, its
400s (the real server's answers: tests/test_serve.py)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from feather_sched.integrations.vllm.tenants import TenantMiddleware, with_tenant


def test_the_body_carries_the_tenant_named_and_is_rewritten_only_to_change_it() -> None:
    body = json.dumps({"prompt": [1], "user": "u", "vllm_xargs": {"k": 1}}).encode()
    assert json.loads(with_tenant(body, None))["vllm_xargs"] == {"k": 1, "tenant": "u"}
    assert json.loads(with_tenant(body, "gw"))["vllm_xargs"] == {"k": 1, "tenant": "gw"}
    for bare, header in [(b' \n{"prompt": [1], "user": "u"}', None), (b"{ }", "gw"),
                         (b'{"prompt": [1], "vllm_xargs": null}', "gw")]:
        named = json.loads(with_tenant(bare, header))  # the key prepended, or rewritten
        assert named == {**json.loads(bare), "vllm_xargs": {"tenant": header or "u"}}
    for untouched, header in [
        (b'{"prompt": [1], "vllm_xargs": {"tenant": "a"}}', None),  # it says so already
        (b'{"prompt": [1]}', None),  # names none: the default tenant
        (b'{"prompt": [1], "user": "alice "}', None),  # a user that is no tenant id: none
        (b'{"prompt": [1', "gw"),  # not JSON: vLLM answers it
        (b"\xff\xfe", "gw"),  # not UTF-8 either
        (b'[{"user": "u"}]', "gw"),  # not an object
        (b'{"user": "u", "vllm_xargs": [1]}', "gw"),  # vLLM refuses its vllm_xargs
    ]:
        assert with_tenant(untouched, header) is untouched
    with pytest.raises(ValueError, match=r"^vllm_xargs\.tenant must be a non-empty string"):
        with_tenant(json.dumps({"user": "u", "vllm_xargs": {"tenant": "u" * 300}}).encode(),
                    None)


class Recorder:
    """The app behind the middleware: what it was handed."""

    def __init__(self) -> None:
        self.calls: list[tuple[dict, bytes]] = []

    async def __call__(self, scope, receive, send) -> None:
        message = await receive()
        self.calls.append((scope, message.get("body", b"")))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


TENANTS_ON = {"fairness": "tenants"}


def call(path: str, chunks: list[bytes], headers: list[tuple[bytes, bytes]] = (),
         method: str = "POST", disconnect: bool = False,
         options: dict | None = TENANTS_ON) -> tuple[Recorder, list[dict]]:
    """One request through the middleware, its body in ``chunks`` (the client leaving
    after them with ``disconnect``), on a server whose Feather ``options`` are these (in
    vLLM's app state, as ``--additional-config`` puts them)."""
    app, sent = Recorder(), []
    messages = [{"type": "http.request", "body": chunk,
                 "more_body": disconnect or i < len(chunks) - 1}
                for i, chunk in enumerate(chunks)]
    if disconnect:
        messages.append({"type": "http.disconnect"})

    async def receive():
        return messages.pop(0)

    async def send(message):
        sent.append(message)

    config = SimpleNamespace(additional_config={"feather": options})
    scope = {"type": "http", "method": method, "path": path, "root_path": "",
             "headers": [(b"content-length", b"1"), *headers],
             "app": SimpleNamespace(state=SimpleNamespace(vllm_config=config))}
    asyncio.run(TenantMiddleware(app)(scope, receive, send))
    return app, sent


def test_generation_requests_reach_vllm_naming_their_tenant() -> None:
    body = json.dumps({"messages": [], "user": "u"}).encode()
    app, _ = call("/v1/chat/completions", [body[:5], body[5:]])  # read whole, in pieces
    (scope, handed), = app.calls
    assert json.loads(handed)["vllm_xargs"] == {"tenant": "u"}
    assert dict(scope["headers"])[b"content-length"] == str(len(handed)).encode()
    app, _ = call("/v1/responses", [body], headers=[(b"x-tenant-id", b"gw")])
    assert json.loads(app.calls[0][1])["vllm_xargs"] == {"tenant": "gw"}


def test_other_requests_pass_unread_and_a_bad_tenant_is_a_400() -> None:
    body = json.dumps({"user": "u", "vllm_xargs": {"tenant": "u" * 300}}).encode()
    for path, method in [("/v1/embeddings", "POST"), ("/v1/completions", "GET")]:
        app, _ = call(path, [body], method=method)
        assert app.calls[0][1] == body
    app, sent = call("/v1/completions", [body])
    assert not app.calls and sent[0]["status"] == 400
    error = json.loads(sent[1]["body"])["error"]
    assert error["type"] == "BadRequestError" and error["message"].startswith(
        "vllm_xargs.tenant must be")
    app, sent = call("/v1/completions", [body[:3]], disconnect=True)
    assert not app.calls and not sent  # the client left mid-body: nothing to answer


def test_with_tenants_off_every_request_passes_untouched_as_vllm_takes_it() -> None:
    body = json.dumps({"prompt": [1], "user": "u", "vllm_xargs": {"tenant": [1]}}).encode()
    for header in [b"t" * 300, b"", b"a\tb", b"other", b"\xff"]:
        for options in (None, {}, {"fairness": "off", "tenant_header": "x-org"}):
            app, sent = call("/v1/completions", [body], options=options,
                             headers=[(b"x-tenant-id", header), (b"x-tenant-id", b"b")])
            (scope, handed), = app.calls
            assert handed == body and dict(scope["headers"])[b"content-length"] == b"1"
            assert sent[0]["status"] == 200


def _named(options: dict, headers: list[tuple[bytes, bytes]]) -> str | int:
    """The tenant a completion's body is handed on with, or the status refusing it."""
    app, sent = call("/v1/completions", [b'{"prompt": [1]}'], headers=headers,
                     options=options)
    return json.loads(app.calls[0][1])["vllm_xargs"]["tenant"] if app.calls else \
        sent[0]["status"]


def test_with_tenants_on_the_header_is_one_utf8_unreserved_name_of_the_configured_header(
        ) -> None:
    assert _named(TENANTS_ON, [(b"x-tenant-id", "café".encode())]) == "café"
    assert _named({"isolate_tenants": True}, [(b"x-tenant-id", b"acme")]) == "acme"
    assert _named(TENANTS_ON, [(b"x-tenant-id", b"a"), (b"x-tenant-id", b"b")]) == 400
    assert _named(TENANTS_ON, [(b"x-tenant-id", b"\xff")]) == 400
    for reserved in (b"default", b"other"):
        assert _named(TENANTS_ON, [(b"x-tenant-id", reserved)]) == 400
    org = {**TENANTS_ON, "tenant_header": "X-Org"}
    assert _named(org, [(b"x-tenant-id", b"acme"), (b"x-org", b"gw")]) == "gw"
    _, sent = call("/v1/completions", [b'{"prompt": [1]}'], options=org,
                     headers=[(b"x-org", b"")])
    assert json.loads(sent[1]["body"])["error"]["message"].startswith(
        "the x-org header must be a non-empty string")
