"""The tenant at SGLang's HTTP front: ``x-tenant-id`` and OpenAI's ``user`` into the field
SGLang carries to its scheduler.

SGLang 0.5.23 carries no request header and drops OpenAI's ``user`` before its scheduler;
the one per-request field that reaches the scheduler's ``Req`` from every endpoint is
``SamplingParams.custom_params`` (native ``/generate``: ``sampling_params.custom_params``;
``/v1/completions`` and ``/v1/chat/completions``: the body's ``custom_params``), where
Feather's view reads ``custom_params["tenant"]`` (``scheduler.SGLangRequests.tenant``).
``TenantMiddleware``, an ASGI middleware the launcher adds to SGLang's FastAPI app, fills
it on those three routes: the ``x-tenant-id`` header wins, then a tenant the body names
already, then OpenAI's ``user``; an invalid one (``parse_tenant``) is answered 400 saying
why.  Other routes, and a native request without the header, pass untouched (the body is
read only where something may change it).
"""

from __future__ import annotations

import json
from typing import Any

from feather_sched.core import TENANT_HEADER, parse_tenant
from feather_sched.integrations import asgi
from feather_sched.integrations.sglang.scheduler import TENANT_PARAM

NATIVE_ROUTES = frozenset({"/generate"})
OPENAI_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions"})


def carry_tenant(body: dict, header: str | None, *, native: bool) -> bool:
    """Name the request's tenant in ``body`` (a parsed request of a native or an OpenAI
    route) where it names none itself or the header overrides it; True if ``body``
    changed.  ValueError (``parse_tenant``'s) for an invalid header, body tenant or
    ``user``.  O(sampling params)."""
    header_tenant = None if header is None else parse_tenant(header)
    if not native:
        user = body.get("user")
        fallback = header_tenant or (None if user is None else parse_tenant(user))
        return _name(body, "custom_params", fallback, overrides=header_tenant is not None)
    params = body.get("sampling_params")
    if params is None:
        params = body["sampling_params"] = {}
    changed = False
    for one in params if isinstance(params, list) else [params]:
        if isinstance(one, dict):
            changed |= _name(one, "custom_params", header_tenant, overrides=True)
    return changed


def _name(holder: dict, key: str, tenant: str | None, *, overrides: bool) -> bool:
    """Put ``tenant`` in ``holder[key]["tenant"]`` if it overrides or none is named there
    (the one named is validated all the same); True if ``holder`` changed."""
    custom = holder.get(key)
    named = custom.get(TENANT_PARAM) if isinstance(custom, dict) else None
    if named is not None:
        parse_tenant(named)
        if not overrides:
            return False
    if tenant is None or tenant == named:
        return False
    holder[key] = {**(custom if isinstance(custom, dict) else {}), TENANT_PARAM: tenant}
    return True


class TenantMiddleware:
    """ASGI middleware: ``carry_tenant`` on SGLang's generation routes (module docstring).
    A body that is not a JSON object, or is compressed, passes untouched (SGLang answers
    it as it would)."""

    def __init__(self, app: asgi.ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: asgi.Scope, receive: asgi.Receive, send: asgi.Send) -> None:
        path = scope.get("path") if scope["type"] == "http" and \
            scope.get("method") == "POST" else None
        native = path in NATIVE_ROUTES
        if not native and path not in OPENAI_ROUTES:
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", ())}
        header = headers.get(TENANT_HEADER)
        if (native and header is None) or "content-encoding" in headers:
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
                return await asgi.bad_request(send, str(error), TENANT_PARAM)
            if changed:
                raw = json.dumps(body).encode()
                scope = asgi.with_length(scope, raw)
        await self.app(scope, asgi.replay(raw, receive), send)


def install(app: Any) -> None:
    """Add ``TenantMiddleware`` to SGLang's FastAPI ``app`` (before it starts)."""
    app.add_middleware(TenantMiddleware)

