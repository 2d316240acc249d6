"""Feather across vLLM replicas on Ray Serve: the two deployments and the application.

* ``VLLMReplica``: one vLLM ``AsyncLLM`` engine with ``vllm serve``'s arguments (so
  ``feather serve``'s Feather scheduler and options); ``generate`` streams a completion's
  deltas.  Its Feather files are its own (its Serve rank in ``FEATHER_REPLICA``), its
  ``vllm:`` and ``feather:`` metrics go through Ray's (``ray.metrics``), and with KV
  events on it registers its endpoints and block hashing (``router.register_kv_events``)
  once a one-block probe prompt has run.
* ``OpenAIIngress``: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` and
  ``/feather/router``; it tokenizes text once and calls the replicas through a handle
  whose request router is ``FeatherRequestRouter`` (or another, for comparisons).  It
  names each request's tenant as ``feather serve``'s middleware does (``named_tenant``:
  the ``x-tenant-id`` header, then ``vllm_xargs.tenant``, then ``user``; a bad one is a
  400) in the sampling parameters' ``extra_args``, where the replica's scheduler reads it.
* ``build_app``: both, as ``feather serve --replicas`` runs them.

Invariants: a request whose replica died is resent only before any of its output reached
the client; nothing two replicas write is shared.  Why not Ray Serve LLM, the endpoints
and metrics in full: docs/replicas.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypeVar

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from jinja2 import TemplateError
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from feather_sched.core import REPLICA_VARIABLE, TENANT_ARG, TENANT_HEADER, named_tenant
from feather_sched.integrations.ray.metrics import MetricsRelay
from feather_sched.integrations.ray.router import ROUTER_CLASS, register_kv_events, router_states
from feather_sched.integrations.vllm.tenants import TENANT_MIDDLEWARE
from feather_sched.telemetry import prometheus as metrics

RAY_ROUTERS = {
    "feather": ROUTER_CLASS,
    "power-of-two": "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter",
    "prefix-affinity": "ray.llm._internal.serve.routing_policies.prefix_aware."
                       "prefix_aware_router.PrefixCacheAffinityRouter",
}
"""Request routers by name: Feather's and Ray's own two (Serve's default is power-of-two;
``ray.serve.llm.request_router.PrefixCacheAffinityRouter`` is an empty subclass of the one
named here, but its module needs ``pyarrow``)."""
logger = logging.getLogger(__name__)
REPLICA_HEADER = "x-feather-replica"
"""Response header naming the replica (its Ray actor name) that served the completion."""
MAX_ONGOING_REQUESTS = 1024
"""Per replica: high, so the router (not Serve's cap) decides; vLLM queues the rest."""
ATTEMPTS = 3
"""Sends per request when replicas die before answering."""


@dataclass
class Completion:
    """One completion, as the ingress sends it to a replica (and routers read it)."""

    request_id: str
    prompt_token_ids: list[int]
    prompt: str
    """Text for text-matching routers: the request's own, else its token ids written out."""
    sampling: dict[str, Any]
    """``vllm.SamplingParams`` arguments."""
    session_id: str = ""
    """The request's session, for routers that keep sessions together ("": none)."""


RequestModel = TypeVar("RequestModel", bound="_GenerationRequest")
Choice = dict[str, Any]
WholeChoice = Callable[[dict[str, Any]], Choice]
"""The choice of a whole completion, from its merged deltas (``_merged``)."""
DeltaChoice = Callable[[dict[str, Any], bool], Choice]
"""The choice of one streamed delta, told whether it is the first."""


# Helpers first: serve.ingress pickles the ingress class where it is defined.
def _choice(chunk: dict[str, Any], with_ids: bool) -> dict[str, Any]:
    """A completion choice: of the whole completion or of one streamed delta."""
    choice = {"index": 0, "text": chunk["text"], "logprobs": None,
              "finish_reason": chunk["finish_reason"]}
    return {**choice, "token_ids": chunk["token_ids"]} if with_ids else choice


def _message(whole: dict[str, Any]) -> dict[str, Any]:
    """A chat completion choice of the whole completion."""
    return {"index": 0, "message": {"role": "assistant", "content": whole["text"]},
            "logprobs": None, "finish_reason": whole["finish_reason"]}


def _delta(chunk: dict[str, Any], first: bool) -> dict[str, Any]:
    """A chat completion choice of one streamed delta (the first names the role)."""
    delta = {"role": "assistant", "content": chunk["text"]} if first else \
        {"content": chunk["text"]}
    return {"index": 0, "delta": delta, "logprobs": None,
            "finish_reason": chunk["finish_reason"]}


def _merged(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """A completion's deltas as one: its text, token ids and finish reason."""
    return {"text": "".join(c["text"] for c in chunks),
            "token_ids": [t for c in chunks for t in c["token_ids"]],
            "finish_reason": chunks[-1]["finish_reason"]}


def _usage(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    prompt = chunks[0]["prompt_tokens"]
    completion = sum(len(c["token_ids"]) for c in chunks)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": chunks[0]["cached_tokens"]}}


def _session(request: Request, body: _GenerationRequest) -> str:
    """A request's session id: Ray Serve's header, else vLLM's body field ("": none)."""
    return request.headers.get(SESSION_HEADER) or body.session_id or ""


def _event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data)}\n\n"


def _error(status: int, message: str) -> JSONResponse:
    kind = "NotFoundError" if status == 404 else "BadRequestError"
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}},
                        status_code=status)


def _vllm_parser() -> Any:
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from feather_sched.integrations.vllm.compat import make_arg_parser

    return make_arg_parser()(FlexibleArgumentParser())


def parse_vllm_args(argv: list[str]) -> Any:
    """``vllm serve``'s arguments parsed by vLLM's own parser (ValueError on a bad one)."""
    try:
        args = _vllm_parser().parse_args(argv)
    except SystemExit as exit_:
        raise ValueError(f"bad vLLM arguments {argv}: exit {exit_.code}") from None
    if args.model_tag:
        args.model = args.model_tag
    return args


KV_EVENTS = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:0",
             "replay_endpoint": "tcp://*:0"}
"""The replicas' KV events for the precise index: PUB and replay sockets on ports the OS
picks (several replicas share a node), on the node's address (``VLLM_HOST_IP``)."""
SESSION_HEADER = "x-session-id"
"""Ray Serve's session header (its proxy's default ``RAY_SERVE_SESSION_ID_HEADER_KEY``)."""
SERVED_SERVER_FLAGS = frozenset({"host", "port", "api_key", "chat_template",
                                 "enable_prompt_tokens_details", "model_tag", "config"})
"""``vllm serve`` options beyond the engine's that the replicas' endpoint applies (the
ingress always reports cached prompt tokens)."""
SERVED_DEFAULTS = {"middleware": [TENANT_MIDDLEWARE]}
"""``vllm serve`` options as ``feather serve`` sets them whose work the endpoint does
itself (the ingress names each request's tenant)."""
LOGGING_SERVER_FLAGS = frozenset({
    "uvicorn_log_level", "disable_uvicorn_access_log", "disable_access_log_for_endpoints",
    "max_log_len", "enable_log_outputs", "enable_log_deltas", "log_error_stack",
    "disable_fastapi_docs"})
"""``vllm serve`` options about its own logs and docs: ignored with a warning."""
TOKENIZER_MODES = ("auto", "hf", "slow")
"""``--tokenizer-mode`` values the ingress's Hugging Face tokenizer can follow."""


def unserved_server_flags(argv: list[str]) -> tuple[list[str], list[str]]:
    """The ``vllm serve`` server options (not engine arguments) that ``argv`` sets to other
    than their defaults and the replicas' endpoint does not apply, as ``--flags``: those
    that change what is served (refused), and those about logs and docs (ignored)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    parser = _vllm_parser()
    args = vars(parse_vllm_args(argv))
    engine = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    unserved = [name for name, value in args.items()
                if name not in engine and name not in SERVED_SERVER_FLAGS
                and value != parser.get_default(name)
                and not (name in SERVED_DEFAULTS and value == SERVED_DEFAULTS[name])]
    refused = [name for name in unserved if name not in LOGGING_SERVER_FLAGS]
    ignored = [name for name in unserved if name in LOGGING_SERVER_FLAGS]
    return _flags(refused), _flags(ignored)


def _flags(names: list[str]) -> list[str]:
    return [f"--{name.replace('_', '-')}" for name in names]


@serve.deployment(max_ongoing_requests=MAX_ONGOING_REQUESTS)
class VLLMReplica:
    """A vLLM engine built from ``vllm serve`` arguments (engine arguments only are used),
    its processes started with ``env`` added to the environment, and its Serve rank as
    ``FEATHER_REPLICA``."""

    async def __init__(self, argv: list[str], env: dict[str, str]) -> None:  # type: ignore[misc]
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

        context = serve.get_replica_context()
        rank = f"{context.rank.rank}/{context.world_size}"
        args = AsyncEngineArgs.from_cli_args(parse_vllm_args(argv))
        events = args.kv_events_config is not None and \
            args.kv_events_config.enable_kv_cache_events
        if events:  # where its publisher binds tcp://*:0
            env = {"VLLM_HOST_IP": ray.util.get_node_ip_address(), **env}
        # before vLLM spawns its engine process, which inherits it
        os.environ.update({**env, REPLICA_VARIABLE: rank})
        self.relay = None if args.disable_log_stats else self._relay_feather_metrics()
        loggers = None if args.disable_log_stats else [RayPrometheusStatLogger]
        self.engine = AsyncLLM.from_engine_args(args, stat_loggers=loggers)
        if self.relay is not None:
            self.relay.start()
        self.name = context.replica_id.to_full_id_str()
        self.defaults = {"max_tokens": None,
                         **self.engine.model_config.get_diff_sampling_param()}
        """What vLLM's server applies where a request is silent: the model's generation
        config (``--generation-config``), else no token limit below the model's length."""
        if events:
            await self._register_kv_events()

    async def _register_kv_events(self) -> None:
        """Run a one-block probe prompt (its ``BlockStored`` event lets the router check
        its hashes), then register where the engine publishes (data-parallel rank 0's)."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import SamplingParams

        cache = self.engine.vllm_config.cache_config
        probe = TokensPrompt(prompt_token_ids=list(range(1, cache.block_size + 1)))
        async for _ in self.engine.generate(probe, SamplingParams(max_tokens=1),
                                            f"feather-kv-probe-{uuid.uuid4().hex}"):
            pass
        source = self.engine.engine_core.get_kv_event_sources()[0]
        register_kv_events(self.name, source.endpoint, source.replay_endpoint,
                           cache.block_size, cache.prefix_caching_hash_algo)

    @staticmethod
    def _relay_feather_metrics() -> MetricsRelay:
        """A directory of this replica's own for the engine process's Feather metrics
        (``feather_sched.telemetry.prometheus``), and the relay that carries them to Ray's."""
        directory = tempfile.mkdtemp(prefix="feather-replica-metrics-")
        os.environ[metrics.ENV_MULTIPROC] = directory
        return MetricsRelay(directory)

    def __del__(self) -> None:
        """Serve's shutdown of the replica: the last metrics out, the directory removed."""
        if getattr(self, "relay", None) is not None:
            self.relay.stop()
            shutil.rmtree(self.relay.directory, ignore_errors=True)

    async def generate(self, call: Completion) -> AsyncIterator[dict[str, Any]]:
        """Deltas of one completion: text, token ids, finish reason, prompt and cached
        token counts, and this replica's name.  A bad request raises ValueError."""
        from vllm.exceptions import VLLMClientError
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        try:
            params = SamplingParams(**{**self.defaults, **call.sampling},
                                    output_kind=RequestOutputKind.DELTA)
            prompt = TokensPrompt(prompt_token_ids=call.prompt_token_ids)
            async for output in self.engine.generate(prompt, params, call.request_id):
                choice = output.outputs[0]
                yield {"replica": self.name, "text": choice.text,
                       "token_ids": list(choice.token_ids),
                       "finish_reason": choice.finish_reason,
                       "prompt_tokens": len(output.prompt_token_ids or ()),
                       "cached_tokens": output.num_cached_tokens or 0}
        except VLLMClientError as error:
            raise ValueError(str(error)) from None

    async def check_health(self) -> None:
        await self.engine.check_health()


class _GenerationRequest(BaseModel):
    """The OpenAI fields both endpoints serve (one choice); the rest are sampling
    parameters, passed to ``vllm.SamplingParams`` when given (``vllm_xargs`` as its
    ``extra_args``)."""

    model_config = ConfigDict(extra="forbid")
    _NOT_SAMPLING: ClassVar[frozenset[str]] = frozenset(
        {"model", "n", "stream", "stream_options", "user", "session_id", "vllm_xargs"})

    model: str | None = None
    min_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool | None = None
    n: int = 1
    stream: bool = False
    stream_options: dict[str, bool] | None = None
    user: str | None = None
    session_id: str | None = None
    """vLLM's field: related requests (a conversation, an agent's session)."""
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None
    """vLLM's field: arguments for extensions, the engine's ``extra_args`` (the tenant)."""

    def sampling(self, own: frozenset[str]) -> dict[str, Any]:
        """The sampling parameters given, less this request's own non-sampling ``own``."""
        fields = set(self.model_fields_set) - self._NOT_SAMPLING - own
        given = self.model_dump(include=fields, exclude_none=True)
        return {**given, "extra_args": dict(self.vllm_xargs)} if self.vllm_xargs else given

    def name_tenant(self, header: str | None) -> None:
        """Put the tenant the request names (``named_tenant``) in ``vllm_xargs``, as
        ``feather serve``'s middleware does; ValueError for a bad one."""
        tenant = named_tenant(header, self.vllm_xargs, self.user)
        if tenant is not None:
            self.vllm_xargs = {**(self.vllm_xargs or {}), TENANT_ARG: tenant}


class CompletionRequest(_GenerationRequest):
    """The OpenAI completion fields served (one prompt, one choice)."""

    prompt: str | list[int]
    max_tokens: int = 16
    return_token_ids: bool = False
    """vLLM's extension: each choice carries its ``token_ids``."""

    def sampling_params(self) -> dict[str, Any]:
        return {"max_tokens": self.max_tokens,
                **self.sampling(frozenset({"prompt", "return_token_ids"}))}


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """A chat message with text content (a string or text parts)."""

    model_config = ConfigDict(extra="forbid")

    role: str
    content: str | list[TextPart]
    name: str | None = None

    def for_template(self) -> dict[str, str]:
        content = self.content if isinstance(self.content, str) else \
            "".join(part.text for part in self.content)
        return {"role": self.role, "content": content}


class ChatRequest(_GenerationRequest):
    """The OpenAI chat completion fields served (text messages, one choice).  Without
    ``max_completion_tokens`` or ``max_tokens`` a completion may run to the model's
    length limit (or its generation config's), as with vLLM's own server."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None

    def sampling_params(self) -> dict[str, Any]:
        limit = self.max_tokens if self.max_completion_tokens is None else \
            self.max_completion_tokens
        given = self.sampling(frozenset({"messages", "max_tokens", "max_completion_tokens"}))
        return given if limit is None else {"max_tokens": limit, **given}


api = FastAPI(title="feather serve --replicas")


@serve.deployment(max_ongoing_requests=10_000, ray_actor_options={"num_cpus": 0})
@serve.ingress(api)
class OpenAIIngress:
    """The OpenAI-compatible front of the replicas (see the module docstring)."""

    def __init__(self, replicas: DeploymentHandle, model_name: str, tokenizer: str,
                 tokenizer_options: dict[str, Any], api_keys: list[str],
                 chat_template: str | None) -> None:
        from transformers import AutoTokenizer
        from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

        self.replicas = replicas.options(stream=True, method_name="generate")
        self.model_name = model_name
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer, **tokenizer_options)
        self.chat_template = chat_template
        # vLLM's own check of "Authorization: Bearer <key>" (hashed, constant time)
        self.auth = AuthenticationMiddleware(None, api_keys) if api_keys else None

    def _unauthorized(self, request: Request) -> JSONResponse | None:
        """vLLM's answer to a request without a valid API key, when keys are set."""
        if self.auth is None or self.auth.verify_token(request.headers):
            return None
        return JSONResponse({"error": "Unauthorized"}, status_code=401)

    async def _admit(self, request: Request,
                     model: type[RequestModel]) -> RequestModel | JSONResponse:
        """The request's body as ``model``, its tenant named, once its API key is checked
        (before the body, as vLLM's server does), else the error to answer."""
        if (refused := self._unauthorized(request)) is not None:
            return refused
        try:
            body = model.model_validate_json(await request.body())
        except ValidationError as error:
            return _error(400, str(error.errors(include_url=False)))
        try:
            body.name_tenant(request.headers.get(TENANT_HEADER))
        except ValueError as error:
            return _error(400, str(error))
        return body

    @api.get("/v1/models")
    async def models(self, request: Request) -> Any:
        if (refused := self._unauthorized(request)) is not None:
            return refused
        return {"object": "list", "data": [{"id": self.model_name, "object": "model",
                                            "created": int(time.time()),
                                            "owned_by": "feather-sched"}]}

    @api.get("/feather/router")
    async def router(self, request: Request) -> Any:
        """What the replicas' Feather router routes by (``router.router_states``; empty
        under another router, or before the first request)."""
        if (refused := self._unauthorized(request)) is not None:
            return refused
        return {"routers": router_states()}

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Any:
        body = await self._admit(request, CompletionRequest)
        if isinstance(body, JSONResponse):
            return body
        if isinstance(body.prompt, str):
            ids, text = self.tokenizer.encode(body.prompt), body.prompt
        else:
            ids, text = body.prompt, " ".join(map(str, body.prompt))
        with_ids = body.return_token_ids
        return await self._serve(
            body, Completion(f"cmpl-{uuid.uuid4().hex}", ids, text, body.sampling_params(),
                             _session(request, body)),
            ("text_completion", "text_completion"),
            whole=lambda merged: _choice(merged, with_ids),
            delta=lambda chunk, _: _choice(chunk, with_ids))

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Any:
        body = await self._admit(request, ChatRequest)
        if isinstance(body, JSONResponse):
            return body
        try:
            text = self.tokenizer.apply_chat_template(
                [message.for_template() for message in body.messages],
                chat_template=self.chat_template, add_generation_prompt=True, tokenize=False)
        except (ValueError, TemplateError) as error:  # no template; the template refused
            return _error(400, f"chat template: {error}")
        ids = self.tokenizer.encode(text, add_special_tokens=False)  # as tokenize=True
        return await self._serve(
            body, Completion(f"chatcmpl-{uuid.uuid4().hex}", ids, text,
                             body.sampling_params(), _session(request, body)),
            ("chat.completion", "chat.completion.chunk"), whole=_message, delta=_delta)

    async def _serve(self, body: _GenerationRequest, call: Completion,
                     objects: tuple[str, str], whole: WholeChoice,
                     delta: DeltaChoice) -> Any:
        """Answer ``call`` as a whole JSON body or an event stream.  ``objects``: the
        object names of the whole body and of a stream chunk; ``whole(merged deltas)`` and
        ``delta(chunk, first)`` make their choices."""
        if body.model is not None and body.model != self.model_name:
            return _error(404, f"The model `{body.model}` does not exist.")
        if body.n != 1:
            return _error(400, "only n=1 is served")
        head = {"id": call.request_id, "created": int(time.time()), "model": self.model_name}
        try:
            if not body.stream:
                chunks = await self._complete(call)
                return JSONResponse({**head, "object": objects[0],
                                     "choices": [whole(_merged(chunks))],
                                     "usage": _usage(chunks)},
                                    headers={REPLICA_HEADER: chunks[-1]["replica"]})
            first, rest = await self._open(call)
        except ValueError as error:  # the engine refused the request
            return _error(400, str(error).splitlines()[-1])
        usage = bool((body.stream_options or {}).get("include_usage"))
        return StreamingResponse(self._sse(first, rest, {**head, "object": objects[1]}, usage,
                                           delta),
                                 media_type="text/event-stream",
                                 headers={REPLICA_HEADER: first["replica"]})

    async def _complete(self, call: Completion) -> list[dict[str, Any]]:
        """Every delta of a completion, resent from scratch if its replica dies."""
        for attempt in range(ATTEMPTS - 1):
            with contextlib.suppress(RayActorError):
                return [chunk async for chunk in self._send(call, attempt)]
        return [chunk async for chunk in self._send(call, ATTEMPTS - 1)]

    async def _open(self, call: Completion) -> tuple[dict[str, Any], Any]:
        """The first delta and the stream of the rest; resent while nothing came back."""
        for attempt in range(ATTEMPTS - 1):
            stream = self._send(call, attempt)
            with contextlib.suppress(RayActorError):
                return await anext(stream), stream
        stream = self._send(call, ATTEMPTS - 1)
        return await anext(stream), stream

    def _send(self, call: Completion, attempt: int) -> Any:
        request_id = call.request_id if not attempt else f"{call.request_id}-{attempt}"
        handle = self.replicas.options(session_id=call.session_id) if call.session_id \
            else self.replicas
        return handle.remote(dataclasses.replace(call, request_id=request_id))

    async def _sse(self, first: dict[str, Any], rest: Any, head: dict[str, Any],
                   usage: bool, delta: DeltaChoice) -> AsyncIterator[str]:
        seen = [first]
        try:
            yield _event({**head, "choices": [delta(first, True)]})
            async for chunk in rest:
                seen.append(chunk)
                yield _event({**head, "choices": [delta(chunk, False)]})
            if usage:
                yield _event({**head, "choices": [], "usage": _usage(seen)})
        except RayActorError as error:  # output already went out: too late to resend
            yield _event({"error": {"message": f"replica died: {error}", "code": 500}})
        except (GeneratorExit, asyncio.CancelledError):
            rest.cancel()  # the client left: abort on the replica
            raise
        yield "data: [DONE]\n\n"


def build_app(argv: list[str], *, replicas: int, router: str = "feather",
              router_options: dict[str, Any] | None = None,
              cpus_per_replica: float = 1.0, ingresses: int = 1,
              env: dict[str, str] | None = None) -> serve.Application:
    """The application: ``replicas`` ``VLLMReplica``s built from ``argv`` (``vllm serve``
    arguments) behind one ``OpenAIIngress`` routing with ``router`` (a ``RAY_ROUTERS`` name).

    ``router_options`` go to the router's ``initialize_state`` (Feather's: the tokenizer is
    filled in, and ``index``, ``"precise"`` (the default: the replicas' KV events are
    turned on, ``KV_EVENTS``, unless ``argv`` turns them on itself) or ``"approximate"``,
    becomes ``kv_events``); ``cpus_per_replica`` is each replica's Ray CPU reservation and
    its OpenMP thread count (vLLM's own core binding is off: replicas share a node);
    ``ingresses`` ingress replicas share the requests (Ray's proxy spreads them), each
    routing with its own router; ``env`` is added to the replicas' environment.  Of
    ``argv``'s server options, ``--api-key`` (else ``VLLM_API_KEY``) guards the endpoints
    as vLLM's server does and ``--chat-template`` replaces the model's; any other
    (``unserved_server_flags``) is a ValueError rather than silently dropped.  ValueError
    on a bad argument, before anything starts.
    """
    if router not in RAY_ROUTERS:
        raise ValueError(f"unknown router {router!r}: use {', '.join(RAY_ROUTERS)}")
    refused, ignored = unserved_server_flags(argv)
    if refused:
        raise ValueError(f"feather serve --replicas does not apply {', '.join(refused)}: "
                         "of vLLM's server options its endpoint applies --host, --port, "
                         "--api-key and --chat-template (and every engine argument)")
    if ignored:
        logger.warning("feather serve --replicas ignores %s (the server's own logs and "
                       "docs)", ", ".join(ignored))
    if replicas < 1 or ingresses < 1 or not cpus_per_replica > 0:
        raise ValueError(f"need replicas >= 1, ingresses >= 1 and cpus_per_replica > 0, got "
                         f"{replicas}, {ingresses} and {cpus_per_replica}")
    from vllm.exceptions import VLLMClientError
    from vllm.renderers.chat_utils import load_chat_template

    args = parse_vllm_args(argv)
    api_keys = [key for key in (args.api_key or [os.environ.get("VLLM_API_KEY")]) if key]
    try:
        chat_template = load_chat_template(args.chat_template)
    except (OSError, VLLMClientError) as error:
        raise ValueError(f"--chat-template: {error}") from None
    if args.tokenizer_mode not in TOKENIZER_MODES:
        raise ValueError(f"feather serve --replicas tokenizes with Hugging Face: "
                         f"--tokenizer-mode {args.tokenizer_mode!r} is not served (use "
                         f"{', '.join(TOKENIZER_MODES)})")
    model_name = (args.served_model_name or [args.model])[0]
    tokenizer = args.tokenizer or args.model
    tokenizer_options = {"revision": args.tokenizer_revision or args.revision,
                         "trust_remote_code": args.trust_remote_code,
                         "use_fast": args.tokenizer_mode != "slow"}
    options = dict(router_options or {})
    if router == "feather":
        options.setdefault("tokenizer", tokenizer)
        index = options.pop("index", "precise")
        if index not in ("precise", "approximate"):
            raise ValueError(f"router option index: precise or approximate, not {index!r}")
        options["kv_events"] = index == "precise"
        events = args.kv_events_config
        if options["kv_events"] and not (events and events.enable_kv_cache_events):
            argv = [*argv, "--kv-events-config", json.dumps(KV_EVENTS)]
    threads = str(max(1, int(cpus_per_replica)))
    replica_env = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": threads,
                   "VLLM_ENABLE_V1_MULTIPROCESSING": "1", **(env or {})}
    replica = VLLMReplica.options(
        num_replicas=replicas,
        ray_actor_options={"num_cpus": cpus_per_replica},
        request_router_config=RequestRouterConfig(request_router_class=RAY_ROUTERS[router],
                                                  request_router_kwargs=options),
    ).bind(argv, replica_env)
    return OpenAIIngress.options(num_replicas=ingresses).bind(
        replica, model_name, tokenizer, tokenizer_options, api_keys, chat_template)
