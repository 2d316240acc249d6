"""The ingress's forwarding on its own: a request answered by an ASGI app as it came (the
replicas' vLLM app end to end: ``test_serve``), and the hints the router reads."""

from __future__ import annotations

import asyncio
import json

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from transformers import AutoTokenizer

from feather_sched.core import SHARED, Namespace
from feather_sched.integrations.ray.forward import Hints, HttpCall, answer
from feather_sched.models import TINY_LLAMA

app = FastAPI()
stopped: list[str] = []


@app.post("/echo")
async def echo(request: Request) -> JSONResponse:
    return JSONResponse({"body": (await request.body()).decode(), "query": request.url.query,
                         "header": request.headers.get("x-a")}, status_code=201)


@app.get("/stream")
async def stream() -> StreamingResponse:
    async def events():
        try:
            for i in range(3):
                yield f"data: {i}\n\n"
            await asyncio.sleep(60)
        finally:
            stopped.append("stream")

    return StreamingResponse(events(), media_type="text/event-stream")


def collect(call: HttpCall, limit: int | None = None) -> list:
    async def run() -> list:
        parts = []
        stream = answer(app, call)
        async for part in stream:
            parts.append(part)
            if limit is not None and len(parts) == limit:
                await stream.aclose()  # the client left
                break
        return parts

    return asyncio.run(run())


def test_the_app_answers_the_request_as_it_came() -> None:
    body = b'{"prompt": [1, 2], "unknown_field": {"kept": true}}'
    head, *rest = collect(HttpCall("POST", "/echo", b"q=1", [(b"x-a", b"b")], body))
    assert head["status"] == 201 and (b"content-type", b"application/json") in head["headers"]
    assert json.loads(b"".join(rest)) == {"body": body.decode(), "query": "q=1", "header": "b"}
    head, *rest = collect(HttpCall("GET", "/missing", b"", [], b""))
    assert head["status"] == 404


def test_a_stream_comes_event_by_event_and_stops_when_the_client_leaves() -> None:
    parts = collect(HttpCall("GET", "/stream", b"", [], b""), limit=3)
    assert parts[1:] == [b"data: 0\n\n", b"data: 1\n\n"]
    assert stopped == ["stream"]  # the app's handling was cancelled


def test_the_hints_are_the_prompts_tokens_and_its_namespace() -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(TINY_LLAMA))
    hints = Hints(tokenizer, None, {"sql": "/adapters/sql"}, {"isolate_tenants": True})

    def hinted(body: object, headers: dict | None = None) -> HttpCall:
        call = HttpCall("POST", "/v1/x", b"", [], json.dumps(body).encode())
        hints(call, headers or {})
        return call

    call = hinted({"prompt": "Hello there", "cache_salt": "s", "model": "sql",
                   "session_id": "conv"})
    assert call.prompt_token_ids == tokenizer.encode("Hello there")
    assert call.namespace == Namespace((("lora", "sql", "/adapters/sql"), ("cache_salt", "s")))
    assert call.session_id == "conv"
    assert hinted({"prompt": [[4, 5], [6]]}).prompt_token_ids == [4, 5]
    assert hinted({"prompt": [1]}, {"x-tenant-id": "acme"}).namespace == \
        Namespace(tenant="acme")
    assert hinted({"prompt": [1]}, {"x-tenant-id": "t" * 300}).namespace == SHARED
    chat = hinted({"messages": [{"role": "user", "content": "hi"}]})
    assert chat.prompt and chat.prompt_token_ids == tokenizer.encode(
        chat.prompt, add_special_tokens=False)
    for body in ([1, 2], {"messages": "not a list"}):
        assert hinted(body).prompt_token_ids is None  # routed by load; vLLM answers it
    refusing = Hints(tokenizer, "{{ raise_exception('no') }}", {}, None)
    chat_body = {"messages": [{"role": "user", "content": "hi"}]}
    call = HttpCall("POST", "/v1/x", b"", [], json.dumps(chat_body).encode())
    refusing(call, {})
    assert call.prompt_token_ids is None  # the template refused: routed by load
    unparsed = HttpCall("POST", "/v1/x", b"", [], b"{not json")
    hints(unparsed, {})
    assert unparsed.prompt_token_ids is None and unparsed.namespace == SHARED


def test_a_chat_is_rendered_with_every_template_field_vllm_passes() -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(TINY_LLAMA))
    template = ("{% for m in messages %}[{{ m.content }}]{% endfor %}"
                "{% if add_generation_prompt %}<gen>{% endif %}"
                "{{ flavour }}"
                "{% for d in documents or [] %}<doc {{ d.text }}>{% endfor %}"
                "{% if enable_thinking %}<think>{% endif %}")
    hints = Hints(tokenizer, template, {}, None)

    def rendered(**fields: object) -> str:
        body = {"messages": [{"role": "user", "content": "hi"}], **fields}
        call = HttpCall("POST", "/v1/chat/completions", b"", [], json.dumps(body).encode())
        hints(call, {})
        assert call.prompt_token_ids == tokenizer.encode(call.prompt, add_special_tokens=False)
        return call.prompt

    assert rendered() == "[hi]<gen>"
    # The final message left open: the tokenizer cuts the text after its content.
    assert rendered(add_generation_prompt=False, continue_final_message=True) == "[hi"
    assert rendered(chat_template_kwargs={"flavour": "F"}) == "[hi]<gen>F"
    assert rendered(documents=[{"text": "d1"}]) == "[hi]<gen><doc d1>"
    assert rendered(reasoning_effort="high") == "[hi]<gen><think>"
    assert rendered(reasoning_effort="high",
                    chat_template_kwargs={"enable_thinking": False}) == "[hi]<gen>"
    # The request's fields win over its chat_template_kwargs, as in vLLM.
    assert rendered(chat_template_kwargs={"add_generation_prompt": False}) == "[hi]<gen>"


def test_a_chat_with_media_is_routed_by_load() -> None:
    """vLLM keys an image's blocks by the item's hash, which the ingress cannot compute:
    two chats with the same text and different images must not look alike."""
    tokenizer = AutoTokenizer.from_pretrained(str(TINY_LLAMA))
    hints = Hints(tokenizer, None, {}, None)

    def hinted(content: object) -> HttpCall:
        body = {"messages": [{"role": "user", "content": content}]}
        call = HttpCall("POST", "/v1/chat/completions", b"", [], json.dumps(body).encode())
        hints(call, {})
        return call

    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    for content in ([{"type": "text", "text": "what is it"}, image],
                    [{"type": "input_audio", "input_audio": {"data": "AAAA"}}]):
        call = hinted(content)
        assert call.prompt_token_ids is None and call.prompt == ""
    assert hinted([{"type": "text", "text": "what is it"}]).prompt_token_ids
