"""Request bodies in an ASGI middleware in front of an engine's HTTP server: read one
whole, hand it on (perhaps rewritten), or refuse the request with a 400 in OpenAI's error
shape, which vLLM's and SGLang's servers both answer in.  The tenant middlewares of both
(``vllm.tenants``, ``sglang.tenant_front``) are built on these.  No engine imported."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


async def read_body(receive: Receive) -> bytes | None:
    """The whole request body, or None if the client disconnected first (nothing to
    answer then).  O(body)."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def header(scope: Scope, name: str) -> str | None:
    """The value of header ``name`` (lower case) as UTF-8 text, None where absent;
    ValueError where it is given more than once (which one counts would be a guess) or is
    not UTF-8.  O(headers)."""
    wanted = name.encode("latin-1")
    values = [value for key, value in scope.get("headers", ()) if key.lower() == wanted]
    if len(values) > 1:
        raise ValueError(f"the {name} header is given {len(values)} times; give it once")
    try:
        return values[0].decode("utf-8") if values else None
    except UnicodeDecodeError:
        raise ValueError(f"the {name} header is not UTF-8 text") from None


def replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives the app ``body`` whole, then whatever the client sends
    next (a disconnect)."""
    given = False

    async def replayed() -> Message:
        nonlocal given
        if given:
            return await receive()
        given = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed


def with_length(scope: Scope, body: bytes) -> Scope:
    """``scope`` with its ``content-length`` header that of ``body`` (a rewritten body)."""
    headers = [(name, value) for name, value in scope["headers"] if name != b"content-length"]
    return {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}


async def bad_request(send: Send, message: str, param: str | None = None) -> None:
    """Answer 400 with ``message`` in OpenAI's error shape (``param``: the field at fault),
    as vLLM's ``ErrorResponse`` and SGLang's own errors are worded."""
    content = json.dumps({"error": {"message": message, "type": "BadRequestError",
                                    "param": param, "code": 400}}).encode()
    await send({"type": "http.response.start", "status": 400,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(content)).encode())]})
    await send({"type": "http.response.body", "body": content})
