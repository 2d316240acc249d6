"""Requests forwarded whole from the replicas' ingress to vLLM's own OpenAI server.

The ingress does not re-model a request: it hands the replica the HTTP request as it came
(``HttpCall``: method, path, query, headers, body), and the replica answers it with vLLM's
own FastAPI app over its engine (``answer``), so every endpoint and field ``vllm serve``
takes (tools, response_format, logprobs, priority, cache_salt, ...) gets the engine's
answer, errors included.  What the ingress adds is what its router needs (``Hints``): the
prompt's token ids where it can tell them (a completion's prompt, a chat's messages through
the chat template), and the request's isolation namespace (``core.isolation``: its
``cache_salt``, its LoRA adapter, its tenant under ``isolate_tenants``).  A hint it cannot
work out routes the request by load; it never fails one.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from feather_sched.core import SHARED, FeatherConfig, Isolation, Namespace, named_tenant
from feather_sched.integrations import asgi

logger = logging.getLogger("ray.serve")


@dataclass
class HttpCall:
    """One HTTP request as the ingress forwards it, and its routing hints (routers read
    ``prompt_token_ids``, ``prompt`` and ``namespace``)."""

    method: str
    path: str
    query: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    prompt_token_ids: list[int] | None = None
    """The prompt's token ids where the ingress could tell them (None: route by load)."""
    prompt: str = ""
    """The prompt's text, for text-matching routers ("": none)."""
    namespace: Namespace = SHARED
    session_id: str = ""
    """The request's session, for routers that keep sessions together ("": none)."""


async def _nothing_more() -> asgi.Message:
    """``receive`` after the body: it never returns (the client's leaving is the
    handling's cancellation)."""
    return await asyncio.get_running_loop().create_future()


async def answer(app: asgi.ASGIApp, call: HttpCall) -> AsyncIterator[dict[str, Any] | bytes]:
    """``app``'s answer to ``call``: first ``{"status", "headers"}``, then the body's
    pieces as the app sends them (an event stream's events one by one).  Cancelling the
    iteration cancels the app's handling (vLLM then aborts the request).  The app reads
    the body whole, then no disconnect (the client's leaving is this cancellation)."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": call.method, "scheme": "http", "path": call.path,
             "raw_path": call.path.encode(), "query_string": call.query, "root_path": "",
             "headers": call.headers, "client": None, "server": None}
    sent: asyncio.Queue = asyncio.Queue()
    task = asyncio.ensure_future(app(scope, asgi.replay(call.body, _nothing_more), sent.put))
    task.add_done_callback(lambda _: sent.put_nowait(None))
    try:
        while (message := await sent.get()) is not None:
            if message["type"] == "http.response.start":
                yield {"status": message["status"], "headers": list(message["headers"])}
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    break
        await task
    except Exception:  # Starlette answers a handler's exception (500), then re-raises it
        logger.exception("vLLM's server failed a forwarded request")
    finally:
        task.cancel()


class Hints:
    """What the router needs from a forwarded request (module docstring).

    ``tokenizer``: a Hugging Face tokenizer (None: no token ids); ``chat_template``: the
    server's (None: the model's); ``adapters``: the LoRA adapters by served name
    (``--lora-modules``) with their paths, as vLLM keys their blocks; ``options``: Feather's
    options (``isolate_tenants``, ``tenant_header``).
    """

    def __init__(self, tokenizer: Any, chat_template: str | None,
                 adapters: Mapping[str, str], options: Mapping[str, Any] | None) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.adapters = dict(adapters)
        self.isolation = Isolation(FeatherConfig.option("isolate_tenants", options))
        self.tenant_header = FeatherConfig.option("tenant_header", options)

    def __call__(self, call: HttpCall, headers: Mapping[str, str]) -> None:
        """Fill ``call``'s hints from its JSON body; a body or part the ingress cannot read
        leaves them unset (vLLM answers the request as it would)."""
        try:
            body = json.loads(call.body) if call.method == "POST" and call.body else None
        except ValueError:
            return
        if not isinstance(body, dict):
            return
        session = body.get("session_id")
        call.session_id = session if isinstance(session, str) else ""
        call.namespace = self.isolation.namespace(
            self._boundary(body), lambda: self._tenant(body, headers))
        try:
            call.prompt_token_ids, call.prompt = self._prompt(body)
        except Exception as error:
            logger.debug("Feather ingress: routing by load (%s)", error)

    def _boundary(self, body: dict) -> tuple:
        """The request's cache boundary as vLLM's engine will key it (``vllm.scheduler.
        boundary``): its LoRA adapter, its ``cache_salt``."""
        model, salt = body.get("model"), body.get("cache_salt")
        lora = ("lora", model, self.adapters[model]) \
            if isinstance(model, str) and model in self.adapters else None
        return lora, ("cache_salt", salt) if isinstance(salt, str) and salt else None

    def _tenant(self, body: dict, headers: Mapping[str, str]) -> str | None:
        try:
            return named_tenant(headers.get(self.tenant_header), body.get("vllm_xargs"),
                                body.get("user"), header_name=self.tenant_header)
        except ValueError:
            return None  # the replica refuses the request, saying why

    def _prompt(self, body: dict) -> tuple[list[int] | None, str]:
        """The prompt's token ids and text: a completion's (its first, of several), a chat's
        messages rendered as the server would (``template_kwargs``); none for a chat with
        media (``has_media``: routed by load)."""
        encode: Callable[..., list[int]] | None = getattr(self.tokenizer, "encode", None)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt, " ".join(map(str, prompt))
        if isinstance(prompt, str):
            return (encode(prompt) if encode else None), prompt
        messages = body.get("messages")
        if not isinstance(messages, list) or encode is None or has_media(messages):
            return None, ""
        text = self.tokenizer.apply_chat_template(
            messages, tools=body.get("tools"),
            chat_template=body.get("chat_template") or self.chat_template, tokenize=False,
            **template_kwargs(body))
        return encode(text, add_special_tokens=bool(body.get("add_special_tokens"))), text


TEXT_PARTS = frozenset({"text", "input_text", "output_text"})
"""The chat content parts that are text; any other (an image, audio, video, a file,
embeddings) is keyed by vLLM through its item's hash, which the ingress cannot compute."""


def has_media(messages: list) -> bool:
    """Whether any message carries a content part that is not text: such a chat is
    routed by load (the engine's namespace holds its items' hashes, the router's could
    not)."""
    return any(isinstance(message, dict) and isinstance(message.get("content"), list)
               and any(not isinstance(part, str) and not (
                   isinstance(part, dict) and part.get("type") in TEXT_PARTS)
                   for part in message["content"])
               for message in messages)


def template_kwargs(body: dict) -> dict[str, Any]:
    """The chat template's arguments as vLLM's server passes them
    (``ChatCompletionRequest.build_chat_params``): the request's ``chat_template_kwargs``,
    overridden by its ``add_generation_prompt`` (default true), ``continue_final_message``,
    ``documents`` and ``reasoning_effort`` where set (None and "auto" are unset), and
    ``enable_thinking`` from the effort unless the request names it."""
    user = body.get("chat_template_kwargs")
    user = user if isinstance(user, dict) else {}
    fields = {"add_generation_prompt": body.get("add_generation_prompt", True),
              "continue_final_message": body.get("continue_final_message", False),
              "documents": body.get("documents"),
              "reasoning_effort": body.get("reasoning_effort")}
    if fields["reasoning_effort"] is not None and "enable_thinking" not in user:
        fields["enable_thinking"] = fields["reasoning_effort"] != "none"
    return user | {key: value for key, value in fields.items() if value not in (None, "auto")}
