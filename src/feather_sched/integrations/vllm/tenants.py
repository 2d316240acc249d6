"""Tenants through vLLM's OpenAI server: ``TenantMiddleware`` names each request's tenant
where vLLM's engine carries it to Feather's scheduler.

Loaded with ``--middleware feather_sched.integrations.vllm.tenants.TenantMiddleware``
(``feather serve`` adds it); it acts only where the server's Feather options use tenants,
else every request passes untouched.  For a POST to one of ``TENANT_PATHS`` whose body is
a JSON object, the tenant the request names (``core.named_tenant``: the header, then the
body's ``vllm_xargs.tenant``, then OpenAI's ``user``) is written to
``vllm_xargs.tenant``, which vLLM passes on as ``SamplingParams.extra_args`` to
``VllmRequests.tenant``.  A bad header or ``vllm_xargs.tenant`` is a 400 in vLLM's error
shape; any other body, path or method passes unread (the header: docs/isolation.md).

Cost: the body read and parsed once (about 0.8 ms for an 8K-token prompt here), rewritten
only where the tenant it carries is not the one named.  docs/vllm.md, "Tenants".
"""

from __future__ import annotations

import json
import logging
from typing import Any

from feather_sched.core import TENANT_ARG, TENANT_HEADER, FeatherConfig, named_tenant
from feather_sched.integrations import asgi

logger = logging.getLogger("vllm.feather_sched")

TENANT_MIDDLEWARE = f"{__name__}.TenantMiddleware"
"""The import path vLLM's ``--middleware`` takes."""
TENANT_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses",
                          "/v1/messages"})
"""vLLM 0.32's generation endpoints whose request carries ``vllm_xargs`` to the engine."""
_UNREAD = object()


def with_tenant(body: bytes, header: str | None, header_name: str = TENANT_HEADER) -> bytes:
    """``body`` with ``vllm_xargs.tenant`` set to the tenant the request names (the
    ``header``'s value, else the body's own), unchanged where it already says so, names
    none, or is not a JSON object.  ValueError for a bad tenant.  O(body)."""
    try:
        data = json.loads(body)
    except ValueError:  # not JSON, not UTF-8: vLLM answers it
        return body
    if not isinstance(data, dict):
        return body
    engine_args = data.get("vllm_xargs")
    if engine_args is not None and not isinstance(engine_args, dict):
        return body  # vLLM refuses it
    tenant = named_tenant(header, engine_args, data.get("user"), header_name=header_name)
    if tenant is None or (engine_args or {}).get(TENANT_ARG) == tenant:
        return body
    opened = body.lstrip()
    if "vllm_xargs" not in data and opened.startswith(b"{"):  # no key to replace: prepend
        head = json.dumps({"vllm_xargs": {TENANT_ARG: tenant}}).encode()[:-1]
        return head + (b", " if data else b"") + opened[1:]
    data["vllm_xargs"] = {**(engine_args or {}), TENANT_ARG: tenant}
    return json.dumps(data).encode()


class TenantMiddleware:
    """A pure ASGI middleware: see the module docstring."""

    def __init__(self, app: asgi.ASGIApp) -> None:
        self.app = app
        self._header: Any = _UNREAD
        """The tenant header's name, None where tenants are off; read at the first request
        (vLLM's app state holds its config only once the server starts)."""

    async def __call__(self, scope: asgi.Scope, receive: asgi.Receive, send: asgi.Send) -> None:
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        if scope["type"] != "http" or scope.get("method") != "POST" or \
                path not in TENANT_PATHS or (header_name := self.header_name(scope)) is None:
            return await self.app(scope, receive, send)
        body = await asgi.read_body(receive)
        if body is None:
            return None  # the client left while sending
        try:
            named = with_tenant(body, asgi.header(scope, header_name), header_name)
        except ValueError as error:
            return await asgi.bad_request(send, str(error), TENANT_ARG)
        if named is not body:
            scope = asgi.with_length(scope, named)
        return await self.app(scope, asgi.replay(named, receive), send)

    def header_name(self, scope: asgi.Scope) -> str | None:
        """The tenant header of this server's Feather options (its ``--additional-config``,
        else ``FEATHER_*``), None where they use no tenants or are bad (the engine says
        why as it starts)."""
        if self._header is _UNREAD:
            state = getattr(scope.get("app"), "state", None)
            additional = getattr(getattr(state, "vllm_config", None), "additional_config",
                                 None)
            options = additional.get("feather") if isinstance(additional, dict) else None
            try:
                self._header = FeatherConfig.tenant_header_of(options)
            except ValueError as error:
                logger.warning("Feather's tenant middleware is off: %s", error)
                self._header = None
        return self._header
