"""The tenant at SGLang's HTTP front: precedence (header, then the body's tenant, then
OpenAI's ``user``), validation, and the middleware's rewrite of the body SGLang reads.
End to end through SGLang's real server: ``test_tenants_server``."""

from __future__ import annotations

import asyncio
import json

import pytest

from feather_sched.bench.cht.sglang_policy import sglang_installed

if not sglang_installed():
    pytest.skip("SGLang is not installed (scripts/setup.sh --sglang)", allow_module_level=True)

from feather_sched.integrations.sglang.tenant_front import TenantMiddleware, carry_tenant


def test_the_header_wins_then_the_bodys_tenant_then_openais_user() -> None:
    chat = {"messages": [], "user": "alice", "custom_params": {"tenant": "bob", "k": 1}}
    assert carry_tenant(chat, "team-a", native=False)
    assert chat["custom_params"] == {"tenant": "team-a", "k": 1}
    chat = {"messages": [], "user": "alice", "custom_params": {"tenant": "bob"}}
    assert not carry_tenant(chat, None, native=False)
    assert chat["custom_params"] == {"tenant": "bob"}
    completion = {"prompt": [1, 2], "user": 42}
    assert carry_tenant(completion, None, native=False)
    assert completion["custom_params"] == {"tenant": "42"}
    assert not carry_tenant({"prompt": [1]}, None, native=False)
    for user in ("", "alice ", "u" * 300):  # OpenAI's user, free-form: no tenant id, none
        assert not carry_tenant({"prompt": [1], "user": user}, None, native=False)
    odd = {"prompt": [1], "custom_params": {"tenant": [1]}}  # only the chosen is checked
    assert carry_tenant(odd, "gw", native=False) and odd["custom_params"] == {"tenant": "gw"}


def test_a_native_batch_takes_the_header_in_every_sampling_params() -> None:
    batch = {"input_ids": [[1], [2]], "sampling_params": [{"custom_params": {"tenant": "x"}},
                                                          {"max_new_tokens": 2}]}
    assert carry_tenant(batch, "t", native=True)
    assert [p["custom_params"]["tenant"] for p in batch["sampling_params"]] == ["t", "t"]
    bare = {"input_ids": [1]}
    assert carry_tenant(bare, "t", native=True)
    assert bare["sampling_params"] == {"custom_params": {"tenant": "t"}}
    odd = {"input_ids": [1], "sampling_params": {"custom_params": []}}  # SGLang would take it
    with pytest.raises(ValueError, match="custom_params must be a JSON object"):
        carry_tenant(odd, "t", native=True)


@pytest.mark.parametrize("body, header", [({"prompt": [1]}, "x" * 300),
                                          ({"prompt": [1], "custom_params": {"tenant": [1]}},
                                           None)])
def test_an_invalid_tenant_is_refused_saying_why(body, header) -> None:
    with pytest.raises(ValueError, match="must be a non-empty string"):
        carry_tenant(body, header, native=False)


def call(path: str, body: bytes, headers: dict[str, str] | list[tuple[bytes, bytes]],
         header_name: str = "x-tenant-id") -> tuple[int, bytes, dict]:
    """``TenantMiddleware`` (reading ``header_name``) over an app that echoes the body and
    headers it received."""
    seen: dict = {}

    async def echo(scope, receive, send) -> None:
        received = [await receive()]
        while received[-1]["more_body"]:
            received.append(await receive())
        seen.update(body=b"".join(m["body"] for m in received), headers=dict(scope["headers"]))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    sent: list[dict] = []

    async def run() -> None:
        chunks = [{"type": "http.request", "body": body[:5], "more_body": True},
                  {"type": "http.request", "body": body[5:], "more_body": False}]

        async def receive():
            return chunks.pop(0)

        async def send(message):
            sent.append(message)

        pairs = headers if isinstance(headers, list) else \
            [(k.encode(), v.encode()) for k, v in headers.items()]
        scope = {"type": "http", "method": "POST", "path": path, "headers": pairs}
        await TenantMiddleware(echo, header_name)(scope, receive, send)

    asyncio.run(run())
    reply = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], reply, seen


def test_the_middleware_rewrites_only_what_names_a_tenant() -> None:
    body = json.dumps({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}).encode()
    status, _, seen = call("/generate", body, {"x-tenant-id": "t1",
                                               "content-length": str(len(body))})
    assert status == 200
    assert json.loads(seen["body"])["sampling_params"] == {"max_new_tokens": 2,
                                                          "custom_params": {"tenant": "t1"}}
    assert seen["headers"][b"content-length"] == str(len(seen["body"])).encode()
    status, _, seen = call("/generate", body, {})  # no header: the body is not even parsed
    assert status == 200 and seen["body"] == body
    status, _, seen = call("/health", b"not json", {"x-tenant-id": "t1"})
    assert seen["body"] == b"not json"  # another route: untouched
    status, reply, seen = call("/v1/completions",
                               json.dumps({"custom_params": {"tenant": ""}}).encode(), {})
    assert status == 400 and not seen
    assert "tenant must be a non-empty string" in json.loads(reply)["error"]["message"]


def test_the_header_is_one_utf8_unreserved_name_of_the_configured_header() -> None:
    body = json.dumps({"prompt": [1]}).encode()

    def named(headers: list[tuple[bytes, bytes]], header_name: str = "x-tenant-id"):
        status, reply, seen = call("/v1/completions", body, headers, header_name)
        return json.loads(seen["body"])["custom_params"]["tenant"] if status == 200 else \
            json.loads(reply)["error"]["message"]

    assert named([(b"x-tenant-id", "café".encode())]) == "café"
    assert "given 2 times" in named([(b"x-tenant-id", b"a"), (b"x-tenant-id", b"b")])
    assert "not UTF-8" in named([(b"x-tenant-id", b"\xff")])
    assert "reserved" in named([(b"x-tenant-id", b"other")])
    assert "reserved" in named([(b"x-tenant-id", b"default")])
    assert named([(b"x-tenant-id", b"a"), (b"x-org", b"gw")], "x-org") == "gw"


def test_the_launcher_adds_the_front_only_where_tenants_are_used(monkeypatch) -> None:
    from feather_sched.integrations.sglang import launch

    installed: list[str] = []
    monkeypatch.setattr(launch, "serve_tenants", lambda workers, name: installed.append(name))
    monkeypatch.setattr("sglang.launch_server.run_server", lambda args: None)
    monkeypatch.setattr("sglang.srt.utils.kill_process_tree", lambda *a, **k: None)
    for name in ("FEATHER_SGLANG", "FEATHER_SGLANG_OPTIONS"):  # the launcher sets them
        monkeypatch.setenv(name, "")  # restored (removed) after the test
    for options, expected in [({}, []), ({"fairness": "tenants"}, ["x-tenant-id"]),
                              ({"isolate_tenants": True, "tenant_header": "X-Org"}, ["x-org"])]:
        installed.clear()
        for name in ("FEATHER_SGLANG", "FEATHER_SGLANG_OPTIONS"):
            monkeypatch.delenv(name, raising=False)
        launch.main(["--model-path", "m", "--schedule-policy", "feather",
                     "--feather-options", json.dumps(options)])
        assert installed == expected
