"""The tenant at SGLang's HTTP front: ``x-tenant-id`` and OpenAI's ``user`` into the field
SGLang carries to its scheduler.

SGLang 0.5.23 carries no request header and drops OpenAI's ``user`` before its scheduler;
the one per-request field that reaches the scheduler's ``Req`` from every endpoint is
``SamplingParams.custom_params``, where Feather's view reads ``custom_params["tenant"]``
(``scheduler.SGLangRequests.tenant``).  ``TenantMiddleware``, an ASGI middleware the
launcher adds to SGLang's FastAPI app, fills it on ``/generate``, ``/v1/completions`` and
``/v1/chat/completions`` by ``core.named_tenant``'s rule (the header, then the body's
tenant, then ``user``); an invalid header or body tenant, where chosen, or the header
given twice, is a 400 saying why.  Other routes, and a native request without the
header, pass untouched (the body is read only where something may change it).  Installed
only where Feather's options use tenants; the header is client input that only a gateway
should set (docs/isolation.md)."""

from __future__ import annotations

import json
from typing import Any

from feather_sched.core import TENANT_ARG, TENANT_HEADER, named_tenant
from feather_sched.integrations import asgi

NATIVE_ROUTES = frozenset({"/generate"})
OPENAI_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions"})


def carry_tenant(body: dict, header: str | None, *, native: bool,
                 header_name: str = TENANT_HEADER) -> bool:
    """Name the request's tenant in ``body`` (a parsed request of a native or an OpenAI
    route): on an OpenAI route the one ``named_tenant`` chooses (the header, the body's
    ``custom_params.tenant``, OpenAI's ``user``); on a native one the header's, in every
    ``sampling_params``.  True if ``body`` changed.  ValueError for an invalid header or
    body tenant, where chosen, or a ``custom_params`` that is not an object where the
    tenant must go (SGLang's native route would take it and lose the tenant).
    O(sampling params)."""
    if not native:
        tenant = named_tenant(header, body.get("custom_params"), body.get("user"),
                              "custom_params", header_name)
        return tenant is not None and _name(body, tenant)
    tenant = None if header is None else \
        named_tenant(header, None, None, header_name=header_name)
    if tenant is None:
        return False
    params = body.get("sampling_params")
    if params is None:
        params = body["sampling_params"] = {}
    changed = False
    for one in params if isinstance(params, list) else [params]:
        if isinstance(one, dict):
            changed |= _name(one, tenant)
    return changed


def _name(holder: dict, tenant: str) -> bool:
    """Put ``tenant`` in ``holder["custom_params"]["tenant"]``; True if ``holder``
    changed; ValueError if ``custom_params`` is there and not an object."""
    custom = holder.get("custom_params")
    if custom is None:
        custom = {}
    if not isinstance(custom, dict):
        raise ValueError("custom_params must be a JSON object to carry the tenant, got "
                         f"{type(custom).__name__}")
    if custom.get(TENANT_ARG) == tenant:
        return False
    holder["custom_params"] = {**custom, TENANT_ARG: tenant}
    return True


class TenantMiddleware:
    """ASGI middleware: ``carry_tenant`` on SGLang's generation routes (module docstring).
    A body that is not a JSON object, or is compressed, passes untouched (SGLang answers
    it as it would)."""

    def __init__(self, app: asgi.ASGIApp, header_name: str = TENANT_HEADER) -> None:
        self.app = app
        self.header_name = header_name

    async def __call__(self, scope: asgi.Scope, receive: asgi.Receive, send: asgi.Send) -> None:
        path = scope.get("path") if scope["type"] == "http" and \
            scope.get("method") == "POST" else None
        native = path in NATIVE_ROUTES
        if not native and path not in OPENAI_ROUTES:
            return await self.app(scope, receive, send)
        try:
            header = asgi.header(scope, self.header_name)
        except ValueError as error:
            return await asgi.bad_request(send, str(error), TENANT_ARG)
        encoded = any(key.lower() == b"content-encoding" for key, _ in scope.get("headers", ()))
        if (native and header is None) or encoded:
            return await self.app(scope, receive, send)
        raw = await asgi.read_body(receive)
        if raw is None:
            return None  # the client left while sending
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if isinstance(body, dict):
            try:
                changed = carry_tenant(body, header, native=native)
            except ValueError as error:
                return await asgi.bad_request(send, str(error), TENANT_ARG)
            if changed:
                raw = json.dumps(body).encode()
                scope = asgi.with_length(scope, raw)
        await self.app(scope, asgi.replay(raw, receive), send)


def install(app: Any, header_name: str = TENANT_HEADER) -> None:
    """Add ``TenantMiddleware`` reading ``header_name`` to SGLang's FastAPI ``app`` (before
    it starts)."""
    app.add_middleware(TenantMiddleware, header_name=header_name)

