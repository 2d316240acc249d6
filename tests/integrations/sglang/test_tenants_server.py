"""Tenants, service and urgent preemption on SGLang's real server (CPU, torch_native, fp32),
one server for all: the tenant a request names (header, body, OpenAI's ``user``) reaches
Feather; the service Feather counts per request is what SGLang itself reports computing
and generating; an urgent request preempts Feather's victim when every seat is taken, at
most once per victim, never within a class, and the victim's greedy output is unchanged.

What Feather did is read in the server's scheduler process by a ``sitecustomize`` probe
(as ``test_attention_server``'s) around ``FeatherRuntime.served`` and ``urgent_victims``.
"""

from __future__ import annotations

import json
import os
import threading
import urllib.error
import urllib.request
from collections import defaultdict
from pathlib import Path

import pytest

from feather_sched.bench.cht.sglang_policy import sglang_installed
from feather_sched.telemetry import stats
from tests.helpers.servers import SGLANG_READY, serving, wait_for

if not sglang_installed():
    pytest.skip("SGLang is not installed (scripts/setup.sh --sglang)", allow_module_level=True)

from tests.integrations.sglang.test_attention_server import checkpoint

PROBE = '''\
import json, os
if os.environ.get("FEATHER_TEST_PROBE"):
    from feather_sched.core.runtime import FeatherRuntime
    _served, _urgent = FeatherRuntime.served, FeatherRuntime.urgent_victims
    def _write(*row):
        with open(os.environ["FEATHER_TEST_PROBE"], "a") as probe:
            probe.write(json.dumps(row) + "\\n")
    def served(self, request_id, computed, generated):
        tenant = self.queue.tenant(request_id) if request_id in self else None
        _write("served", request_id, tenant, computed, generated)
        return _served(self, request_id, computed, generated)
    def urgent_victims(self, running, request, room):
        victims = _urgent(self, running, request, room)
        _write("urgent", request.rid, [victim.rid for victim in victims])
        return victims
    FeatherRuntime.served, FeatherRuntime.urgent_victims = served, urgent_victims
'''
LOW, URGENT = 0, 10
"""Priorities (SGLang's default: higher values first; threshold 0)."""
LONG = 256
"""The low-priority requests' outputs: they run while the urgent ones come and go (long
enough that both still run when U3 comes, on a fast CPU too)."""


def post(url: str, path: str, body: dict, headers: dict[str, str] | None = None) -> dict:
    request = urllib.request.Request(f"{url}{path}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        return {"status": error.code, **json.loads(error.read())}


def generate(url: str, rid: str, prompt: list[int], max_new: int, priority: int = LOW,
             headers: dict[str, str] | None = None, custom: dict | None = None) -> dict:
    params = {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True}
    if custom is not None:
        params["custom_params"] = custom
    return post(url, "/generate", {"rid": rid, "input_ids": prompt, "sampling_params": params,
                                   "priority": priority}, headers)


def prompt(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + 13 * i) % 31000 + 3 for i in range(length)]


class Probe:
    def __init__(self, path: Path) -> None:
        self.path = path

    def rows(self, kind: str) -> list[list]:
        if not self.path.exists():
            return []
        return [row[1:] for row in map(json.loads, self.path.read_text().splitlines())
                if row[0] == kind]

    def generated(self, rid: str) -> int:
        return sum(g for r, _, _, g in self.rows("served") if r == rid)

    def prefills(self, rid: str) -> int:
        """The steps that computed prompt tokens for ``rid``: one per prefill chunk, more
        after a preemption (its recomputation)."""
        return sum(1 for r, _, c, _ in self.rows("served") if r == rid and c)


def test_tenants_service_and_urgent_preemption_on_the_real_server(tmp_path) -> None:
    model = checkpoint(tmp_path / "model")
    site, probe_file = tmp_path / "site", tmp_path / "probe.jsonl"
    site.mkdir()
    (site / "sitecustomize.py").write_text(PROBE)
    stats_file = tmp_path / "stats.json"
    options = json.dumps({"gate": "always", "fairness": "tenants",
                          "stats_file": str(stats_file), "save_every_s": 0.5})
    command = ["feather_sched.integrations.sglang.launch", "--model-path", str(model),
               "--device", "cpu", "--dtype", "float32", "--attention-backend", "torch_native",
               "--schedule-policy", "feather", "--feather-options", options,
               "--enable-priority-scheduling", "--priority-scheduling-preemption-threshold", "0",
               "--max-running-requests", "2", "--chunked-prefill-size", "64",
               "--enable-mixed-chunk", "--enable-cache-report", "--max-total-tokens", "8192",
               "--random-seed", "0"]
    paths = [str(site), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {"FEATHER_TEST_PROBE": str(probe_file), "PYTHONPATH": os.pathsep.join(paths)}
    probe = Probe(probe_file)
    with serving(command, tmp_path / "server.log", env, SGLANG_READY) as url:
        # ---- tenants and service: what SGLang reports computing is what Feather counts
        shared = prompt(1, 150)  # chunked at 64; the second request hits its prefix
        native = {
            "hdr": generate(url, "hdr", [*shared, 5, 6], 3, headers={"x-tenant-id": "team-h"},
                            custom={"tenant": "overridden"}),
            "num": generate(url, "num", [*shared, 7, 8, 9], 4, custom={"tenant": 7}),
            "none": generate(url, "none", prompt(2, 40), 2),
        }
        usage = {rid: reported(reply) for rid, reply in native.items()}
        for rid, body in {"user": {"user": "alice"},
                          "both": {"user": "alice", "custom_params": {"tenant": "bob"}}}.items():
            reply = post(url, "/v1/completions", {"rid": rid, "model": "m", "max_tokens": 3,
                                                  "prompt": prompt(3, 30), "temperature": 0,
                                                  "ignore_eos": True, **body})
            tokens = reply["usage"]
            cached = tokens["prompt_tokens_details"]["cached_tokens"]
            usage[rid] = (tokens["prompt_tokens"] - cached, tokens["completion_tokens"])
        assert usage["num"][0] < 150  # a radix-cache hit, not counted
        refused = generate(url, "bad", prompt(4, 20), 2, custom={"tenant": ["x"]})
        assert refused["status"] == 400 and "tenant must be" in refused["error"]["message"]
        front = generate(url, "bad2", prompt(4, 20), 2, headers={"x-tenant-id": "x" * 300})
        assert front["status"] == 400 and "at most 256" in front["error"]["message"]

        # ---- urgent preemption: two seats, two long low-priority requests running
        low = {"L1": prompt(5, 48), "L2": prompt(6, 48)}
        reference = run_together(url, low, LONG, probe)  # no preemption; L2 beside L1's decode
        usage |= {rid: reported(reply) for rid, reply in reference.items()}
        replies = run_together(url, {f"{r}x": p for r, p in low.items()}, LONG, probe,
                               lambda: urgent_scenario(url, probe))
        wait_for(lambda: stats_file.exists() and  # every request left Feather: served first
                 stats.SchedulerStats.read(stats_file).requests_left ==
                 stats.SchedulerStats.read(stats_file).requests_entered, "every request left")
        urgent = probe.rows("urgent")
    served: dict[str, list] = defaultdict(lambda: [None, 0, 0])
    for rid, tenant, computed, generated in probe.rows("served"):
        served[rid][0] = tenant
        served[rid][1] += computed
        served[rid][2] += generated
    tenants = {"hdr": "team-h", "num": "7", "none": "default", "user": "alice", "both": "bob",
               "L1": "default", "L2": "default"}
    assert {rid: tuple(served[rid]) for rid in tenants} == {
        rid: (tenant, *usage[rid]) for rid, tenant in tenants.items()}

    assert [replies[f"{r}x"]["output_ids"] for r in low] == \
        [reference[r]["output_ids"] for r in low]  # greedy, unchanged
    victims = [victims for _, victims in urgent if victims]
    assert victims == [["L2x"], ["L1x"]]  # the youngest group's newest first; each once
    by_request = {rid: [v for r, v in urgent if r == rid] for rid in ("U1", "U2", "U3", "S")}
    assert by_request["U1"] == [["L2x"]] and by_request["U2"] == [["L1x"]]
    assert by_request["U3"] and not any(by_request["U3"])  # both preempted once: the bound
    assert not any(by_request["S"])  # its own class: never
    assert [probe.generated(rid) for rid in ("L1x", "L2x", "S")] == [LONG, LONG, 2]  # once
    assert stats.SchedulerStats.read(stats_file).preemptions == 2


def reported(reply: dict) -> tuple[int, int]:
    """The prompt tokens SGLang computed (its own count, less its cache hits) and the
    tokens it generated for a native request."""
    meta = reply["meta_info"]
    return meta["prompt_tokens"] - meta["cached_tokens"], meta["completion_tokens"]


def run_together(url: str, prompts: dict[str, list[int]], max_new: int, probe: Probe,
                 meanwhile=None) -> dict[str, dict]:
    """The replies to greedy ``prompts`` (two: ``max_running_requests``), each sent once
    the one before generates; ``meanwhile`` runs once both do."""
    outputs: dict[str, dict] = {}

    def send(rid: str) -> None:
        outputs[rid] = generate(url, rid, prompts[rid], max_new)

    threads = [threading.Thread(target=send, args=(rid,)) for rid in prompts]
    for rid, thread in zip(prompts, threads, strict=True):
        thread.start()
        wait_for(lambda rid=rid: probe.generated(rid), f"{rid} running")
    if meanwhile is not None:
        meanwhile()
    for thread in threads:
        thread.join(timeout=300)
    assert set(outputs) == set(prompts)
    return outputs


def urgent_scenario(url: str, probe: Probe) -> None:
    """While L1x and L2x take both seats: S (their class) waits; U1 preempts L2x (the
    youngest group); once L2x runs again, U2 preempts L1x; once L1x runs again, U3 finds
    none it may preempt (each was preempted once: ``max_urgent_preemptions``) and waits."""
    waiting = threading.Thread(target=generate, args=(url, "S", prompt(7, 20), 2, LOW))
    waiting.start()
    wait_for(lambda: any(r == "S" for r, _ in probe.rows("urgent")), "S offered")
    for rid, victim in (("U1", "L2x"), ("U2", "L1x")):
        assert "output_ids" in generate(url, rid, prompt(8, 16), 2, URGENT)
        wait_for(lambda victim=victim: probe.prefills(victim) > 1, f"{victim} running again")
    assert "output_ids" in generate(url, "U3", prompt(9, 16), 2, URGENT)
    waiting.join(timeout=300)
