"""Launch an SGLang server with Feather: ``python -m feather_sched.integrations.sglang.launch``.

Takes every ``sglang serve`` / ``python -m sglang.launch_server`` argument, plus
``--schedule-policy feather`` (SGLang itself is given ``fcfs``, the base Feather
reorders; any other policy runs SGLang unchanged) and ``--feather-options JSON`` (else
``FEATHER_*`` variables).  At import it registers Feather's hooks with SGLang's
``HookRegistry`` and its attention factories (``attention.register``); SGLang's 'spawn'
re-imports this ``__main__`` in each scheduler process, where ``load_plugins()`` applies
them.  The selection travels as ``FEATHER_SGLANG=1`` (and ``FEATHER_SGLANG_OPTIONS``) in
the inherited environment; without it the hooks do nothing.  Where the options use
tenants, ``tenant_front.TenantMiddleware`` joins SGLang's HTTP app when one HTTP process
serves it.  docs/sglang.md, "Mechanism" and "Tenants".
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import MutableMapping, Sequence

from feather_sched.integrations.sglang import attention, tenant_front
from feather_sched.integrations.sglang.scheduler import (
    BASE_POLICY,
    ENV_ENABLE,
    ENV_OPTIONS,
    POLICY_NAME,
    feather_enabled,
    feather_options,
    register,
)

register()  # module level on purpose: spawned SGLang processes re-import this module
attention.register()

_HELP = f"""\
Feather options (feather_sched.integrations.sglang.launch):
  --schedule-policy {POLICY_NAME}   order SGLang's waiting queue with Feather's Chunked Hash Tree
                              and gate admission with its ADD/STOP gate (SGLang runs
                              '{BASE_POLICY}' underneath); other policies run SGLang unchanged
  --feather-options JSON      Feather options as a JSON object, e.g. '{{"gate": "bandit"}}'
                              (default: FEATHER_* environment variables)

SGLang server arguments follow.
"""


def feather_argv(argv: Sequence[str]) -> tuple[list[str], bool, str | None]:
    """Split Feather's arguments off ``argv``.

    Returns SGLang's arguments (with ``--schedule-policy feather`` turned into the base
    policy), whether Feather was selected, and the ``--feather-options`` JSON if given.
    """
    rest: list[str] = []
    selected, options = False, None
    args = list(argv)
    index = 0
    while index < len(args):
        arg = args[index]
        name, has_value, value = arg.partition("=")
        if name in ("--schedule-policy", "--feather-options"):
            if not has_value:
                if index + 1 >= len(args):
                    raise SystemExit(f"{name} needs a value")
                index += 1
                value = args[index]
            if name == "--feather-options":
                options = value
            elif value == POLICY_NAME:
                selected = True
                rest += ["--schedule-policy", BASE_POLICY]
            else:
                rest += ["--schedule-policy", value]
        else:
            rest.append(arg)
        index += 1
    return rest, selected, options


def configure(argv: Sequence[str], environ: MutableMapping[str, str] = os.environ) -> list[str]:
    """Set the environment that selects Feather in SGLang's processes; SGLang's argv.

    Options are validated here, so a typo fails before any SGLang process starts.
    """
    rest, selected, options = feather_argv(argv)
    if options is not None and not selected:
        raise SystemExit("--feather-options needs --schedule-policy feather")
    if selected:
        environ[ENV_ENABLE] = "1"
        if options is not None:
            try:
                json.loads(options)
            except json.JSONDecodeError as error:
                raise SystemExit(f"--feather-options: not JSON: {error}") from None
            environ[ENV_OPTIONS] = options
        try:
            feather_options(environ)
        except ValueError as error:
            raise SystemExit(f"feather: {error}") from None
    return rest


def main(argv: Sequence[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    from sglang.srt.server_args import prepare_server_args

    if "-h" in argv or "--help" in argv:
        print(_HELP, flush=True)
        prepare_server_args(["--help"])  # prints SGLang's own arguments and exits
        return
    sglang_argv = configure(argv)

    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    server_args = prepare_server_args(sglang_argv)
    header_name = feather_options().tenant_front_header if feather_enabled() else None
    if header_name is not None:
        serve_tenants(server_args.tokenizer_worker_num, header_name)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


def serve_tenants(http_workers: int, header_name: str) -> None:
    """Map the tenant header (``header_name``) and ``user`` at SGLang's HTTP front
    (``tenant_front``), which this process serves when it is the only HTTP worker; else say
    why not.  Only where Feather's options use tenants: otherwise SGLang's API is left as
    it is."""
    if http_workers > 1:
        logging.getLogger("sglang.feather_sched").warning(
            "Feather: with --tokenizer-worker-num %d the x-tenant-id header and OpenAI's "
            "user field do not name a request's tenant (each HTTP worker re-imports "
            "SGLang's app); name it in custom_params", http_workers)
        return
    from sglang.srt.entrypoints import http_server

    tenant_front.install(http_server.app, header_name)


if __name__ == "__main__":
    main()
