"""Feather across vLLM replicas on Ray Serve: the two deployments and the application.

``VLLMReplica``: one vLLM ``AsyncLLM`` with ``vllm serve``'s arguments and vLLM's own
OpenAI app over it (its middlewares included); its Feather files and metrics its own, and
with KV events on it registers its endpoints and block hashing once a probe has run.
``OpenAIIngress``: forwards every request as it came to a replica chosen by
``FeatherRequestRouter``, with the router's hints (``forward.Hints``), and answers with
the replica's answer.  ``build_app``: both, as ``feather serve --replicas`` runs them.
So every path and field ``vllm serve`` takes reaches the engine.  Invariants: a request
whose replica died is resent only before any of its answer reached the client; nothing
two replicas write is shared.  In full: docs/replicas.md.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator
from typing import Any, cast

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from feather_sched.core import REPLICA_VARIABLE
from feather_sched.integrations.ray.forward import Hints, HttpCall, answer
from feather_sched.integrations.ray.metrics import MetricsRelay
from feather_sched.integrations.ray.router import ROUTER_CLASS, register_kv_events, router_states
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
"""Response header naming the replica (its Ray actor name) that served the request."""
MAX_ONGOING_REQUESTS = 1024
"""Per replica: high, so the router (not Serve's cap) decides; vLLM queues the rest."""
ATTEMPTS = 3
"""Sends per request when replicas die before answering."""
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "ServiceUnavailableError",
                                   "code": status}}, status_code=status)


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
LISTENER_FLAGS = frozenset({
    "ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "ssl_cert_reqs", "ssl_ciphers",
    "enable_ssl_refresh", "uds", "root_path", "api_server_count", "headless", "grpc",
    "grpc_port", "data_parallel_supervisor_port", "dp_supervisor_probe_interval_s",
    "dp_supervisor_probe_timeout_s", "dp_supervisor_probe_failure_threshold",
    "enable_scale_out", "h11_max_header_count", "h11_max_incomplete_event_size"})
"""``vllm serve`` options of its listening server and processes, which Ray Serve's proxy
takes the place of: refused.  Every other server option (API key, chat template, tool
parsers, LoRA modules, middlewares, request logging...) applies: each replica runs vLLM's
own app with them."""
LOGGING_SERVER_FLAGS = frozenset({
    "uvicorn_log_level", "disable_uvicorn_access_log", "disable_access_log_for_endpoints"})
"""``vllm serve`` options about its HTTP server's own logs: ignored with a warning."""


def unserved_server_flags(argv: list[str]) -> tuple[list[str], list[str]]:
    """The ``vllm serve`` options that ``argv`` sets to other than their defaults and the
    replicas' endpoint does not apply, as ``--flags``: those of the listening server
    (refused), and those about its logs (ignored)."""
    parser = _vllm_parser()
    args = vars(parse_vllm_args(argv))
    unserved = [name for name, value in args.items()
                if name in LISTENER_FLAGS | LOGGING_SERVER_FLAGS
                and value != parser.get_default(name)]
    return (_flags([name for name in unserved if name in LISTENER_FLAGS]),
            _flags([name for name in unserved if name in LOGGING_SERVER_FLAGS]))


def _flags(names: list[str]) -> list[str]:
    return [f"--{name.replace('_', '-')}" for name in names]


@serve.deployment(max_ongoing_requests=MAX_ONGOING_REQUESTS)
class VLLMReplica:
    """A vLLM engine and vLLM's OpenAI server app over it, both built from ``vllm serve``
    arguments, its processes started with ``env`` added to the environment, and its Serve
    rank as ``FEATHER_REPLICA``."""

    async def __init__(self, argv: list[str], env: dict[str, str]) -> None:  # type: ignore[misc]
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

        context = serve.get_replica_context()
        rank = f"{context.rank.rank}/{context.world_size}"
        server_args = parse_vllm_args(argv)
        args = AsyncEngineArgs.from_cli_args(server_args)
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
        self.app = await self._openai_app(server_args)
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
        relay = getattr(self, "relay", None)  # None where __init__ did not get so far
        if relay is not None:
            relay.stop()
            shutil.rmtree(relay.directory, ignore_errors=True)

    async def _openai_app(self, args: Any) -> Any:
        """vLLM's OpenAI server app over this engine, as ``vllm serve`` builds it (its
        launcher's ``build_app`` and ``init_app_state``; not started: requests come by
        ``http``)."""
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.app import build_app as build_vllm_app

        tasks = await self.engine.get_supported_tasks()
        app = build_vllm_app(args, tasks, self.engine.model_config)
        await init_app_state(self.engine, app.state, args, tasks)
        return app

    async def http(self, call: HttpCall) -> AsyncIterator[dict[str, Any] | bytes]:
        """vLLM's server's answer to a forwarded request (``forward.answer``), its head
        naming this replica."""
        async for part in answer(self.app, call):
            if isinstance(part, dict):
                part["headers"].append((REPLICA_HEADER.encode(), self.name.encode()))
            yield part

    async def check_health(self) -> None:
        await self.engine.check_health()


# Helpers first: serve.ingress pickles the ingress class where it is defined.
def _tokenizer(name: str, options: dict[str, Any]) -> Any:
    """The Hugging Face tokenizer the ingress routes by, None where it cannot load."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name, **options)
    except (OSError, ValueError) as error:
        logger.warning("feather serve --replicas: no tokenizer to route by (%s): requests "
                       "route by load", error)
        return None


api = FastAPI(title="feather serve --replicas")


@serve.deployment(max_ongoing_requests=10_000, ray_actor_options={"num_cpus": 0})
@serve.ingress(api)
class OpenAIIngress:
    """The replicas' endpoint (see the module docstring).  ``hints``' tokenizer loads here
    (``tokenizer``, ``tokenizer_options``; where it cannot, requests route by load)."""

    def __init__(self, replicas: DeploymentHandle, tokenizer: str,
                 tokenizer_options: dict[str, Any], hints: dict[str, Any],
                 api_keys: list[str]) -> None:
        from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

        self.replicas = replicas.options(stream=True, method_name="http")
        self.hints = Hints(_tokenizer(tokenizer, tokenizer_options), **hints)
        # vLLM's own check of "Authorization: Bearer <key>", for the ingress's own path
        self.auth = AuthenticationMiddleware(None, api_keys) if api_keys else None

    @api.get("/feather/router")
    async def router(self, request: Request) -> Any:
        """What the replicas' Feather router routes by (``router.router_states``; empty
        under another router, or before the first request)."""
        if self.auth is not None and not self.auth.verify_token(request.headers):
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        return {"routers": router_states()}

    @api.api_route("/{path:path}", methods=METHODS)
    async def forward(self, request: Request, path: str) -> Any:
        """Any other request, to a replica as it came; the replica's answer."""
        call = HttpCall(request.method, request.url.path, request.url.query.encode(),
                        list(request.headers.raw), await request.body())
        self.hints(call, request.headers)
        call.session_id = request.headers.get(SESSION_HEADER) or call.session_id
        try:
            head, first, rest = await self._open(call)
        except (RayActorError, StopAsyncIteration) as error:
            return _error(503, f"no replica answered: {error!r}")
        response = StreamingResponse(self._body(first, rest), status_code=head["status"])
        response.raw_headers = head["headers"]
        return response

    async def _open(self, call: HttpCall) -> tuple[dict[str, Any], bytes, Any]:
        """The head and first piece of the replica's answer, and the stream of the rest;
        resent while nothing came back (the replica died)."""
        for attempt in range(ATTEMPTS):
            handle = self.replicas.options(session_id=call.session_id) if call.session_id \
                else self.replicas
            stream = handle.remote(call)
            try:
                head = await anext(stream)
                return head, await anext(stream, b""), stream
            except RayActorError:
                if attempt == ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")

    @staticmethod
    async def _body(first: bytes, rest: Any) -> AsyncIterator[bytes]:
        try:
            yield first
            async for piece in rest:
                yield piece
        except RayActorError as error:  # output already went out: too late to resend
            logger.warning("feather serve --replicas: a replica died mid-answer: %s", error)
        except BaseException:  # the client left: abort on the replica
            rest.cancel()
            raise


def _check_arguments(argv: list[str], *, replicas: int, router: str,
                     cpus_per_replica: float, ingresses: int) -> None:
    """``build_app``'s ValueError for a bad argument or a server flag it cannot apply,
    and its warning for those it ignores."""
    if router not in RAY_ROUTERS:
        raise ValueError(f"unknown router {router!r}: use {', '.join(RAY_ROUTERS)}")
    refused, ignored = unserved_server_flags(argv)
    if refused:
        raise ValueError(f"feather serve --replicas does not apply {', '.join(refused)}: "
                         "Ray Serve's proxy listens in place of vLLM's server (--host and "
                         "--port say where)")
    if ignored:
        logger.warning("feather serve --replicas ignores %s (Ray Serve's proxy keeps its "
                       "own logs)", ", ".join(ignored))
    if replicas < 1 or ingresses < 1 or not cpus_per_replica > 0:
        raise ValueError(f"need replicas >= 1, ingresses >= 1 and cpus_per_replica > 0, got "
                         f"{replicas}, {ingresses} and {cpus_per_replica}")


def _feather_router_options(options: dict[str, Any], argv: list[str], args: Any,
                            tokenizer: str) -> list[str]:
    """Fill in Feather's router ``options`` (its tokenizer; ``index`` becomes
    ``kv_events``), and ``argv`` with the replicas' KV events turned on where the precise
    index needs them and ``argv`` (parsed: ``args``) does not turn them on itself."""
    options.setdefault("tokenizer", tokenizer)
    index = options.pop("index", "precise")
    if index not in ("precise", "approximate"):
        raise ValueError(f"router option index: precise or approximate, not {index!r}")
    options["kv_events"] = index == "precise"
    events = args.kv_events_config
    if options["kv_events"] and not (events and events.enable_kv_cache_events):
        return [*argv, "--kv-events-config", json.dumps(KV_EVENTS)]
    return argv


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
    routing with its own router; ``env`` is added to the replicas' environment.
    ``argv``'s server options apply as with ``vllm serve`` (each replica runs vLLM's own
    app), but those of its listening server (``unserved_server_flags``), which are a
    ValueError rather than silently dropped.  ValueError on a bad argument, before
    anything starts.
    """
    _check_arguments(argv, replicas=replicas, router=router,
                     cpus_per_replica=cpus_per_replica, ingresses=ingresses)
    from vllm.exceptions import VLLMClientError
    from vllm.renderers.chat_utils import load_chat_template

    args = parse_vllm_args(argv)
    api_keys = [key for key in (args.api_key or [os.environ.get("VLLM_API_KEY")]) if key]
    try:
        chat_template = load_chat_template(args.chat_template)
    except (OSError, VLLMClientError) as error:
        raise ValueError(f"--chat-template: {error}") from None
    tokenizer = args.tokenizer or args.model
    tokenizer_options = {"revision": args.tokenizer_revision or args.revision,
                         "trust_remote_code": args.trust_remote_code,
                         "use_fast": args.tokenizer_mode != "slow"}
    options = dict(router_options or {})
    if router == "feather":
        argv = _feather_router_options(options, argv, args, tokenizer)
    threads = str(max(1, int(cpus_per_replica)))
    replica_env = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": threads,
                   "VLLM_ENABLE_V1_MULTIPROCESSING": "1", **(env or {})}
    # Deployments (``@serve.deployment``), which mypy types as the classes they decorate
    replica = cast(Any, VLLMReplica).options(
        num_replicas=replicas,
        ray_actor_options={"num_cpus": cpus_per_replica},
        request_router_config=RequestRouterConfig(request_router_class=RAY_ROUTERS[router],
                                                  request_router_kwargs=options),
    ).bind(argv, replica_env)
    additional = args.additional_config if isinstance(args.additional_config, dict) else {}
    hints = {"chat_template": chat_template, "options": additional.get("feather"),
             "adapters": {module.name: module.path for module in args.lora_modules or ()}}
    return cast(Any, OpenAIIngress).options(num_replicas=ingresses).bind(
        replica, tokenizer, tokenizer_options, hints, api_keys)
