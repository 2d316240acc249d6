"""Soak a real ``feather serve`` the way production hurts a server, and check nothing is lost.

    .venv/bin/python benchmarks/soak/soak.py [--seconds 180] [--set NAME] [--out DIR]

One embedded-model server with a KV cache small enough to force preemption and a bandit
state file.  Concurrent clients stream shared-prefix requests from several groups; about
30% are cancelled by closing the connection at a random moment; malformed requests
(bad JSON, a negative max_tokens, an unknown model) and out-of-vocabulary token ids are
mixed in.  Half-way through the server gets SIGTERM, drains, and is started again on the
same state file.  It passes when:

* every request the clients sent ended exactly once, as completed, cancelled or
  rejected (4xx), or failed to connect while the server was down;
* the server kept serving (requests completed after the restart), and the restart
  loaded the saved bandit table;
* at the end Feather tracked nothing (every request that entered left, once), vLLM's
  metrics show no running or waiting request and an empty KV cache;
* the log has no traceback but vLLM's own logs of rejected requests and of its
  teardown (see ``unexplained_tracebacks``), and resident memory stayed flat (end
  within 25% of start, measured over the server's process group after warm-up).

With ``--data-parallel-size N`` the server runs N vLLM data-parallel engines, each with
its own Feather: each rank writes its own stats and bandit files (``stats.rank<r>.json``),
every rank must reload its own table after the restart and serve requests, and the counts
above are summed over the ranks.

Writes ``soak.json`` (the figures) and ``soak.md`` (``soak-dp<N>.*`` for N > 1) into the run
set's folder, ``results/NAME/`` (default: the commit), or ``--out``; the server's files
go to ``work/`` beside this script.  Recorded: ``results/b24f9e6/`` (one engine) and
``results/3a106cf/`` (two data-parallel ranks).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import psutil

from feather_sched.bench.study import Study, markdown_table
from feather_sched.bench.study import parser as study_parser

ROOT = Path(__file__).resolve().parents[2]
GROUP_PREFIX_TOKENS = 400
VOCAB = 32000
READY_TIMEOUT_S = 240
RSS_GROWTH_LIMIT = 1.25


@dataclass
class Tally:
    sent: int = 0
    completed: int = 0
    cancelled: int = 0
    rejected: int = 0
    """4xx answers: malformed or out-of-vocabulary requests."""
    down: int = 0
    """Connection refused or dropped while the server was restarting."""
    unexpected: list[str] = field(default_factory=list)

    @property
    def ended(self) -> int:
        return self.completed + self.cancelled + self.rejected + self.down + len(self.unexpected)


class Server:
    """``feather serve`` in its own process group, restartable on the same files."""

    def __init__(self, workdir: Path, port: int, data_parallel: int = 1) -> None:
        self.workdir, self.port, self.data_parallel = workdir, port, data_parallel
        self.url = f"http://127.0.0.1:{port}"
        self.state = workdir / "bandit.json"
        self.stats = workdir / "stats.json"
        self.logs: list[Path] = []
        self.process: subprocess.Popen | None = None
        self.model = ""
        self.preemptions = 0.0
        """Preemptions counted by vLLM over the server's lives (read before each stop)."""

    def start(self) -> None:
        options = json.dumps({"gate": "bandit", "state_file": str(self.state),
                              "stats_file": str(self.stats), "max_wait_s": 20})
        log = self.workdir / f"server-{len(self.logs)}.log"
        self.logs.append(log)
        # ~24 KV blocks of 128 tokens and outputs that cross a block boundary (prompts
        # 404-440 tokens, up to 160 out): running decodes need blocks the cache lacks.
        command = [sys.executable, "-m", "feather_sched.cli", "serve", "--enforce-eager",
                   "--kv-cache-gib", "0.012", "--max-num-seqs", "32", "--max-model-len", "1024",
                   "--feather-options", options, "--host", "127.0.0.1", "--port", str(self.port)]
        if self.data_parallel > 1:
            command += ["--data-parallel-size", str(self.data_parallel)]
        with open(log, "w") as handle:
            self.process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT,
                                            cwd=ROOT, start_new_session=True)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited: see {log}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    pass
                models = _get(f"{self.url}/v1/models")
                if models:
                    self.model = json.loads(models)["data"][0]["id"]
                    return
            except OSError:
                pass
            time.sleep(1)
        raise TimeoutError(f"server not ready after {READY_TIMEOUT_S} s")

    def stop(self) -> float:
        """SIGTERM; seconds until the process group is gone."""
        assert self.process is not None
        self.preemptions += self.metrics()["vllm:num_preemptions_total"]
        started = time.monotonic()
        os.killpg(self.process.pid, signal.SIGTERM)
        self.process.wait(timeout=120)
        return time.monotonic() - started

    def stats_files(self) -> list[Path]:
        """Each rank's stats file (Feather puts the rank in the name when there are several)."""
        if self.data_parallel == 1:
            return [self.stats]
        return [self.stats.with_name(f"{self.stats.stem}.rank{r}{self.stats.suffix}")
                for r in range(self.data_parallel)]

    def rss_bytes(self) -> int:
        assert self.process is not None
        processes = [psutil.Process(self.process.pid)]
        processes += processes[0].children(recursive=True)
        return sum(p.memory_info().rss for p in processes if p.is_running())

    def metrics(self) -> dict[str, float]:
        text = _get(f"{self.url}/metrics") or ""
        values: dict[str, float] = {}
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                     "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total"):
            found = re.findall(rf"^{re.escape(name)}\{{[^}}]*\}} ([0-9.e+-]+)$", text, re.M)
            values[name] = sum(float(v) for v in found)
        return values


def _get(url: str) -> str | None:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.read().decode()
    except OSError:
        return None


async def client(server: Server, tally: Tally, stop_at: float, seed: int,
                 prefixes: list[list[int]]) -> None:
    rng = random.Random(seed)
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < stop_at:
            tally.sent += 1
            kind = rng.random()
            try:
                if kind < 0.05:
                    await malformed(session, server, rng, tally)
                elif kind < 0.08:
                    await completion(session, server, [5, VOCAB + rng.randint(0, 99), 7], 4,
                                     None, tally)
                else:
                    prompt = rng.choice(prefixes) + [rng.randint(3, VOCAB - 1)
                                                    for _ in range(rng.randint(4, 40))]
                    cancel = rng.uniform(0.05, 2.0) if rng.random() < 0.3 else None
                    await completion(session, server, prompt, rng.randint(8, 160), cancel,
                                     tally)
            except (TimeoutError, aiohttp.ClientConnectionError):
                tally.down += 1
                await asyncio.sleep(0.5)
            await asyncio.sleep(rng.uniform(0, 0.2))


async def completion(session: aiohttp.ClientSession, server: Server, prompt: list[int],
                     max_tokens: int, cancel_after: float | None, tally: Tally) -> None:
    body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True}
    started = time.monotonic()
    async with session.post(f"{server.url}/v1/completions", json=body,
                            timeout=aiohttp.ClientTimeout(total=300)) as response:
        if 400 <= response.status < 500:
            await response.read()
            tally.rejected += 1
            return
        if response.status != 200:
            tally.unexpected.append(f"status {response.status}")
            return
        async for _ in response.content:
            if cancel_after is not None and time.monotonic() - started > cancel_after:
                response.close()  # the client disconnects mid-stream
                tally.cancelled += 1
                return
    tally.completed += 1


async def malformed(session: aiohttp.ClientSession, server: Server, rng: random.Random,
                    tally: Tally) -> None:
    bad = rng.choice([
        b"{not json",
        json.dumps({"model": server.model, "prompt": [1, 2, 3], "max_tokens": -5}).encode(),
        json.dumps({"model": "no-such-model", "prompt": "hi", "max_tokens": 3}).encode(),
    ])
    async with session.post(f"{server.url}/v1/completions", data=bad,
                            headers={"Content-Type": "application/json"}) as response:
        await response.read()
        if 400 <= response.status < 500:
            tally.rejected += 1
        else:
            tally.unexpected.append(f"malformed request answered {response.status}")


async def load(server: Server, tally: Tally, seconds: float, clients: int) -> None:
    rng = random.Random(0)
    prefixes = [[rng.randint(3, VOCAB - 1) for _ in range(GROUP_PREFIX_TOKENS)]
                for _ in range(4)]
    stop_at = time.monotonic() + seconds
    await asyncio.gather(*(client(server, tally, stop_at, seed, prefixes)
                           for seed in range(clients)))


def soak(seconds: float, clients: int, workdir: Path, data_parallel: int = 1) -> dict:
    workdir.mkdir(parents=True, exist_ok=True)
    for old in workdir.glob("*"):
        old.unlink()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = Server(workdir, port, data_parallel)
    server.start()
    tally = Tally()
    asyncio.run(load(server, tally, 5, clients))  # warm-up
    rss_start = server.rss_bytes()
    asyncio.run(load(server, tally, seconds / 2, clients))
    drain_s = server.stop()
    server.start()
    after_restart = tally.completed
    asyncio.run(load(server, tally, seconds / 2, clients))
    time.sleep(3)
    rss_end = server.rss_bytes()
    metrics = server.metrics()
    metrics.pop("vllm:num_preemptions_total")
    final_drain_s = server.stop()
    ranks = [json.loads(path.read_text()) for path in server.stats_files()]
    stats = {key: sum(rank[key] for rank in ranks)
             for key in ("requests_entered", "requests_left", "waiting", "running")}
    figures = {
        **asdict(tally), "unexpected": tally.unexpected[:10], "ended": tally.ended,
        "restarts": 1, "completed_after_restart": tally.completed - after_restart,
        "rss_start_mb": rss_start / 2**20, "rss_end_mb": rss_end / 2**20,
        "drain_s": drain_s, "final_drain_s": final_drain_s, "metrics_at_end": metrics,
        "feather_requests_entered": stats["requests_entered"],
        "feather_requests_left": stats["requests_left"],
        "feather_waiting_at_end": stats["waiting"], "feather_running_at_end": stats["running"],
        "preemptions": server.preemptions,
        "data_parallel": data_parallel,
        "requests_by_rank": [rank["requests_entered"] for rank in ranks],
        "tables_reloaded": server.logs[-1].read_text().count("bandit table loaded from"),
        "tracebacks": unexplained_tracebacks(server.logs),
        "seconds": seconds, "clients": clients,
    }
    figures["checks"] = checks(figures)
    return figures


def unexplained_tracebacks(logs: list[Path]) -> int:
    """Tracebacks that mean something failed: any through Feather's code, or any while
    serving except vLLM's own log of a request it rejected (an out-of-vocabulary id, a
    400 to the client). vLLM 0.32 also logs EngineDeadError after the engine core has
    drained and exited at shutdown; that part of each log is its teardown, not counted."""
    count = 0
    for log in logs:
        text = log.read_text()
        count += sum(1 for line in text.splitlines()
                     if 'File "' in line and "feather_sched" in line)
        serving = text.partition("starting resource teardown")[0]
        count += serving.count("Traceback") - serving.count("VLLMValidationError:")
    return count


def checks(f: dict) -> dict[str, bool]:
    return {
        "every request ended once": f["ended"] == f["sent"] and not f["unexpected"],
        "kept serving after the restart": f["completed_after_restart"] > 0,
        "KV pressure forced preemption": f["preemptions"] > 0,
        "restart reloaded every rank's table": f["tables_reloaded"] >= f["data_parallel"],
        "every rank served": all(f["requests_by_rank"]),
        "feather tracks nothing at the end": (
            f["feather_requests_entered"] == f["feather_requests_left"]
            and f["feather_waiting_at_end"] == f["feather_running_at_end"] == 0),
        "vllm idle, KV cache free": not any(f["metrics_at_end"].values()),
        "no traceback": f["tracebacks"] == 0,
        "memory flat": f["rss_end_mb"] <= RSS_GROWTH_LIMIT * f["rss_start_mb"],
    }


def main() -> None:
    parser = study_parser(__doc__)
    parser.add_argument("--seconds", type=float, default=180)
    parser.add_argument("--clients", type=int, default=24)
    parser.add_argument("--out", type=Path, help="write here instead of results/SET/")
    parser.add_argument("--data-parallel-size", type=int, default=1)
    args = parser.parse_args()
    dp = args.data_parallel_size
    name = "soak" if dp == 1 else f"soak-dp{dp}"
    study = Study(__file__, folder=args.out, set_name=args.set)
    figures = soak(args.seconds, args.clients, Path(__file__).parent / "work", dp)
    study.write_json(name, figures)
    study.write_markdown(name, markdown(figures))
    sys.exit(0 if all(figures["checks"].values()) else 1)


def markdown(figures: dict) -> str:
    """The figures, then whether each check passed."""
    return "\n".join([
        markdown_table(["figure", "value"],
                       ([k, str(v)] for k, v in figures.items() if k != "checks")), "",
        markdown_table(["check", "passed"], ([k, str(v)] for k, v in figures["checks"].items()))])


if __name__ == "__main__":
    main()
