"""The command line of vLLM's OpenAI-compatible server with Feather as its scheduler.

What ``feather serve`` adds to the user's vLLM arguments: ``--scheduler-cls`` and
``--additional-config '{"feather": ...}'`` (merged with the user's; Feather's options
validated here, before the engine spends half a minute starting); the embedded model by
default, served as ``tiny-llama`` (a local directory by its ``served_name``); an exact KV
cache size (``--kv-cache-gib``, else 4 GiB on CPU; ``VLLM_CPU_KVCACHE_SPACE`` beside
either is refused); ``--middleware`` ``TenantMiddleware``; and ``--shutdown-timeout``
(``SHUTDOWN_TIMEOUT_S``: running requests finish and Feather saves its files on
SIGTERM, where vLLM's default 0 kills the engine at once).

``serve_replicas`` (``feather serve --replicas N``) runs the same engine arguments as N
replicas on Ray Serve behind one OpenAI endpoint (``integrations.ray.app``).
docs/vllm.md, "feather serve".
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from feather_sched.core.config import FeatherConfig
from feather_sched.integrations.vllm.tenants import TENANT_MIDDLEWARE
from feather_sched.models import TINY_LLAMA

SCHEDULER_CLS = "feather_sched.integrations.vllm.FeatherScheduler"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
EMBEDDED_MODEL_ARGS = ["--load-format", "dummy", "--max-model-len", "16384"]
"""The embedded model is a config.json and a tokenizer: random weights."""
CPU_KV_CACHE_GIB = 4.0
SHUTDOWN_TIMEOUT_S = 20
KV_FLAG = "--kv-cache-memory-bytes"
LEGACY_KV_VARIABLE = "VLLM_CPU_KVCACHE_SPACE"


def server_command(argv: list[str]) -> list[str]:
    """``python -m vllm.entrypoints.openai.api_server`` with ``argv``."""
    return [sys.executable, "-m", SERVER_MODULE, *argv]


def vllm_server_args(model: str | None, feather: dict, passthrough: list[str], *,
                     kv_cache_gib: float | None = None, on_cpu: bool = True,
                     environ: Mapping[str, str] = os.environ) -> list[str]:
    """``vllm serve``'s arguments with Feather's scheduler and options (see above).

    ValueError for a bad Feather option or contradictory arguments, so a mistake fails
    before the server starts.
    """
    FeatherConfig.from_sources(feather, environ=environ)
    passthrough = list(passthrough)
    if _take(passthrough, "--scheduler-cls") is not None:
        raise ValueError("feather serve sets --scheduler-cls itself; leave it out")
    additional = json.loads(_take(passthrough, "--additional-config") or "{}")
    additional["feather"] = {**additional.get("feather", {}), **feather}
    command = ["--model", model or str(TINY_LLAMA),
               "--scheduler-cls", SCHEDULER_CLS,
               "--additional-config", json.dumps(additional)]
    name = served_name(model)
    if name is not None and not _given(passthrough, "--served-model-name"):
        command += ["--served-model-name", name]
    if model is None:
        command += EMBEDDED_MODEL_ARGS
    command += _kv_cache_args(passthrough, kv_cache_gib, on_cpu, environ)
    if not _given(passthrough, "--shutdown-timeout"):
        command += ["--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
    if not {TENANT_MIDDLEWARE, f"--middleware={TENANT_MIDDLEWARE}"} & set(passthrough):
        command += ["--middleware", TENANT_MIDDLEWARE]
    if "--enable-prompt-tokens-details" not in passthrough:
        command.append("--enable-prompt-tokens-details")  # cached tokens, for feather bench
    return command + passthrough


def served_name(model: str | None) -> str | None:
    """The model id served by default: the embedded model's or a local model directory's
    name (``tiny-llama``, as ``vllm serve --served-model-name`` gives), rather than a
    filesystem path; None (vLLM's own: the id as given) for a hub id."""
    path = TINY_LLAMA if model is None else Path(model).expanduser()
    return (path.resolve().name or None) if path.is_dir() else None


def _kv_cache_args(passthrough: list[str], kv_cache_gib: float | None, on_cpu: bool,
                   environ: Mapping[str, str]) -> list[str]:
    explicit = _given(passthrough, KV_FLAG)
    if explicit and kv_cache_gib is not None:
        raise ValueError(f"give --kv-cache-gib or {KV_FLAG}, not both")
    if environ.get(LEGACY_KV_VARIABLE) and (explicit or kv_cache_gib is not None):
        raise ValueError(f"{LEGACY_KV_VARIABLE} is set: on CPU vLLM takes it over "
                         f"--kv-cache-gib and {KV_FLAG}; unset it or leave those out")
    if explicit or environ.get(LEGACY_KV_VARIABLE):
        return []
    if kv_cache_gib is None:
        if not on_cpu:
            return []  # a GPU sizes its cache from --gpu-memory-utilization
        kv_cache_gib = CPU_KV_CACHE_GIB
    if not kv_cache_gib > 0:
        raise ValueError(f"--kv-cache-gib must be positive, got {kv_cache_gib}")
    return [KV_FLAG, str(int(kv_cache_gib * 2**30))]


def _given(args: list[str], flag: str) -> bool:
    return any(arg == flag or arg.startswith(flag + "=") for arg in args)


def _take(args: list[str], flag: str) -> str | None:
    """Remove ``flag VALUE`` or ``flag=VALUE`` from ``args`` and return the value."""
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
            del args[i : i + 2]
            return value
        if arg.startswith(flag + "="):
            del args[i]
            return arg.split("=", 1)[1]
    return None


def serve_replicas(argv: list[str], *, replicas: int, address: str | None = None,
                   router: str = "feather", router_options: dict[str, Any] | None = None,
                   cpus_per_replica: float = 1.0, metrics_port: int | None = None,
                   ingresses: int = 1) -> None:
    """Serve ``replicas`` engines built from ``argv`` (``vllm_server_args``) on Ray Serve
    until SIGINT or SIGTERM.

    Starts a local Ray cluster (``address=None``, Ray's default) or joins ``address``; the
    endpoint listens on ``argv``'s ``--host`` (default all interfaces) and ``--port``
    (default 8000).  The local cluster exports the replicas' vLLM metrics for Prometheus
    at ``metrics_port`` (default: a port Ray picks); a cluster joined exports them where
    it was started to (``ray start --metrics-export-port``).  ValueError for a bad
    argument, before Ray starts.
    """
    import ray
    from ray import serve

    from feather_sched.integrations.ray.app import build_app, parse_vllm_args

    if address is not None and metrics_port is not None:
        raise ValueError("a metrics port is the local cluster's: a cluster joined with "
                         "--address exports metrics where `ray start --metrics-export-port` "
                         "said")
    args = parse_vllm_args(argv)
    app = build_app(argv, replicas=replicas, router=router, router_options=router_options,
                    cpus_per_replica=cpus_per_replica, ingresses=ingresses)
    ray.init(address=address, _metrics_export_port=metrics_port)
    signal.signal(signal.SIGTERM, _raise_interrupt)  # after Ray's own, which exits at once
    try:
        serve.start(http_options={"host": args.host or "0.0.0.0", "port": args.port})
        serve.run(app, name="feather", route_prefix="/")
        print(f"feather serve: {replicas} replicas at http://{args.host or '0.0.0.0'}:"
              f"{args.port}/v1", flush=True)
        if address is None:
            node = ray.nodes()[0]  # the local cluster's only node
            print(f"feather serve: replica metrics at http://{node['NodeManagerAddress']}:"
                  f"{node['MetricsExportPort']}/metrics", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()


def _raise_interrupt(*_: object) -> None:
    raise KeyboardInterrupt
