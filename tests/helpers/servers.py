"""Real inference servers for end-to-end tests: started on loopback, measured, stopped."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from typer.testing import CliRunner

from feather_sched.cli import app

READY_TIMEOUT_S = 480
"""How long a test server may take to serve: about 40 s alone on this project's 2-core
machine, past 240 s once while ``pytest -n 2`` ran an engine test beside it (a server
that exits fails at once, ``wait_until_serving``)."""
BOUNDED_POOL = ["--max-total-tokens", "32768"]
"""SGLang's KV pool for a test server: on a CPU SGLang sizes it from the machine's free
memory (13 GB here), which two servers started side by side (``pytest -n 2``) do not
both get."""


def wait_for(condition: Callable[[], object], what: str, timeout_s: float = 60,
             poll_s: float = 0.1) -> object:
    """Poll ``condition`` until it returns something true (returned); TimeoutError saying
    ``what`` did not happen.  Tests wait on state, not on the wall clock."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s} s")
        time.sleep(poll_s)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


SGLANG_READY = "The server is fired up and ready to roll!"
"""What SGLang's server logs once its own warmup request has finished (it answers
``/v1/models`` before: the warmup, least urgent under priority scheduling, would then run
beside a test's first requests)."""


def wait_until_serving(url: str, server: subprocess.Popen, timeout_s: float,
                       log_path: Path | None = None, ready: str | None = None) -> None:
    """Return once ``url`` answers ``/v1/models`` and, given ``ready``, the server's log at
    ``log_path`` holds that line; raise if the server exits or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"server exited with {server.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=2):
                if ready is None or (log_path is not None and ready in log_path.read_text()):
                    return
        except OSError:
            pass
        time.sleep(2)
    raise TimeoutError(f"no server at {url} after {timeout_s} s")


@contextmanager
def serving(module_args: list[str], log_path: Path, env: dict[str, str],
            ready: str | None = None) -> Iterator[str]:
    """Run ``python -m <module_args> --host 127.0.0.1 --port P``; yield its URL when ready
    (``wait_until_serving``: with ``ready``, once its log holds that line)."""
    port = free_port()
    command = [sys.executable, "-m", *module_args, "--host", "127.0.0.1", "--port", str(port)]
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                  env={**os.environ, **env}, start_new_session=True)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_until_serving(url, server, READY_TIMEOUT_S, log_path, ready)
            yield url
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=60)


def bench_server(url: str, out: Path, label: str, *extra: str) -> dict:
    """``feather bench --base-url`` on 2 groups x 3 short requests; returns the run's summary."""
    result = CliRunner().invoke(app, [
        "bench", "--base-url", url, "--groups", "2", "--prompts-per-group", "3",
        "--prefix-len", "256", "--output-len", "5", "--label", label, "--json", str(out),
        *extra], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())["runs"][label]
