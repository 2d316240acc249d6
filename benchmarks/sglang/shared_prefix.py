"""Shared-prefix attention on SGLang's real CPU server, three ways side by side: SGLang's own
scheduler and kernel, SGLang's scheduler with Feather's shared-prefix path, Feather with it.

    .venv/bin/python benchmarks/sglang/shared_prefix.py [--rounds 3] [--output-len 64]
        [--shapes 4x16@8192,8x16@8192,none:64@2016] [--set NAME]

Each round starts one SGLang 0.5.23 server per configuration and shape (the embedded
2-layer Llama, random weights, ``--device cpu --attention-backend torch_native``, through
Feather's launcher) and measures it with the same client, ``feather bench --api sglang``:

* ``sglang``: ``--schedule-policy lpm``, ``FEATHER_SHARED_PREFIX_ATTENTION=off``;
* ``sglang-shared``: ``--schedule-policy lpm``, ``FEATHER_SHARED_PREFIX_ATTENTION=on``;
* ``feather``: ``--schedule-policy feather``, the option at its default (``auto``: the
  self-check at server start decides; its line is kept with the results).

A shape ``GxR@P`` is G prefix groups of R requests sharing a P-token prefix (32-token
suffixes, all at once); ``none:N@P`` is N requests of P tokens sharing nothing.  Rounds
run every configuration of a shape before the next round, so a ratio is taken round by
round (``feather_sched.bench.study``).  Per shape, ``results/<set>/shared-<shape>.json``
holds every run's summary, the servers' attention lines and the command; ``.md`` the
tables (output tokens/s and mean TPOT, medians with ranges, per-round ratios to
``sglang``); ``server-*.log`` the servers' logs.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from feather_sched.bench.study import Study, parser, ratio_table
from feather_sched.models import TINY_LLAMA

ROOT = Path(__file__).resolve().parents[2]
CONFIGS: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    "sglang": (("--schedule-policy", "lpm"), {"FEATHER_SHARED_PREFIX_ATTENTION": "off"}),
    "sglang-shared": (("--schedule-policy", "lpm"), {"FEATHER_SHARED_PREFIX_ATTENTION": "on"}),
    "feather": (("--schedule-policy", "feather"), {}),
}
"""Label -> (the launcher's arguments, the server's environment)."""
READY_TIMEOUT_S = 300
ATTENTION_LINE = re.compile(r"Feather shared-prefix attention: .*")


def shape_args(shape: str) -> list[str]:
    """``feather bench``'s workload arguments for ``GxR@P`` or ``none:N@P``."""
    match = re.fullmatch(r"(\d+)x(\d+)@(\d+)|none:(\d+)@(\d+)", shape)
    if not match:
        raise SystemExit(f"shape {shape!r}: GxR@PREFIX or none:N@TOKENS")
    groups, rows, prefix, alone, tokens = match.groups()
    if alone:
        return ["--workload", "no-sharing", "--groups", "1", "--prompts-per-group", alone,
                "--prefix-len", tokens]
    return ["--groups", groups, "--prompts-per-group", rows, "--prefix-len", prefix]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve(config: str, log: Path) -> tuple[subprocess.Popen, str]:
    """The server of ``config``, started and answering; its process and URL."""
    arguments, environ = CONFIGS[config]
    port = free_port()
    command = [sys.executable, "-m", "feather_sched.integrations.sglang.launch",
               "--model-path", str(TINY_LLAMA), "--device", "cpu", "--load-format", "dummy",
               "--skip-tokenizer-init", "--attention-backend", "torch_native",
               "--host", "127.0.0.1", "--port", str(port), *arguments]
    with log.open("w") as handle:
        server = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT,
                                  env={**os.environ, **environ}, cwd=ROOT,
                                  start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the {config} server exited ({server.returncode}); see {log}")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=2):
                return server, url
        except OSError:
            time.sleep(2)
    os.killpg(server.pid, signal.SIGKILL)
    raise SystemExit(f"the {config} server did not answer in {READY_TIMEOUT_S} s; see {log}")


def measure(study: Study, config: str, shape: str, label: str, output_len: int) -> dict:
    """One run: the server of ``config`` on ``shape``, its summary and attention lines."""
    stem = f"{shape.replace(':', '-').replace('@', '-')}-{label.replace('#', '-')}"
    log = study.path(f"server-{stem}.log")
    server, url = serve(config, log)
    try:
        result = study.path(f"run-{stem}.json")
        subprocess.run([str(Path(sys.executable).with_name("feather")), "bench",
                        "--base-url", url, "--api", "sglang", *shape_args(shape),
                        "--output-len", str(output_len), "--seed", "0", "--label", label,
                        "--json", str(result)], check=True, cwd=ROOT)
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the launcher and SGLang's processes
        server.wait(timeout=60)
    summary = json.loads(result.read_text())["runs"][label]
    result.unlink()
    lines = sorted(set(ATTENTION_LINE.findall(log.read_text())))
    return {**summary, "attention": lines}


def main() -> None:
    arguments = parser(__doc__)
    arguments.add_argument("--rounds", type=int, default=3)
    arguments.add_argument("--output-len", type=int, default=64)
    arguments.add_argument("--shapes", default="4x16@8192,8x16@8192,none:64@2016")
    args = arguments.parse_args()
    study = Study(__file__, set_name=args.set)
    for shape in args.shapes.split(","):
        labelled: dict[str, dict] = {}
        for round_ in range(1, args.rounds + 1):
            for config in CONFIGS:
                label = config if round_ == 1 else f"{config}#{round_}"
                labelled[label] = measure(study, config, shape, label, args.output_len)
                study.progress(f"{shape} {label}")
        runs: dict[str, list[dict]] = {}
        for label, summary in labelled.items():
            runs.setdefault(label.split("#")[0], []).append(summary)
        attention = {name: sorted({line for s in summaries for line in s["attention"]})
                     for name, summaries in runs.items()}
        text = "\n\n".join([
            f"## {shape}: output tokens/s, against sglang",
            ratio_table(runs, "output_throughput", "sglang"),
            "## mean TPOT (ms), against sglang",
            ratio_table(runs, "mean_tpot_ms", "sglang"),
            "## attention, per configuration",
            "\n".join(f"- {name}: {'; '.join(lines) or '(no line)'}"
                      for name, lines in attention.items())])
        study.save(f"shared-{shape.replace(':', '-').replace('@', '-')}",
                   {"shape": shape, "output_len": args.output_len, "runs": labelled}, text)


if __name__ == "__main__":
    main()
