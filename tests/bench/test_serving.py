"""The workload knobs ``feather bench`` and ``feather sim`` share (``WorkloadArgs``)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from feather_sched.cli import app
from feather_sched.workloads.options import WORKLOADS, WorkloadArgs
from feather_sched.workloads.spec import prioritized
from feather_sched.workloads.traces import save_jsonl


@pytest.mark.parametrize("kind", WORKLOADS)
def test_every_generator_takes_a_high_priority_share(kind: str) -> None:
    args = dict(kind=kind, groups=3, prompts_per_group=4, prefix_len=32, suffix_len=4,
                output_len=4, seed=2)
    plain = WorkloadArgs(**args).build()
    mixed = WorkloadArgs(**args, high_priority_share=0.25).build()
    n = len(plain)
    assert plain.priority_classes == {0: n}
    assert mixed.priority_classes == {0: round(n / 4), 1: n - round(n / 4)}
    assert [r.request_id for r in mixed] == [r.request_id for r in plain]


def test_a_trace_keeps_its_classes_unless_a_share_is_given(tmp_path) -> None:
    trace = tmp_path / "trace.jsonl"
    save_jsonl(prioritized(WorkloadArgs(groups=2, prompts_per_group=5, prefix_len=16,
                                        suffix_len=4, output_len=2).build(), 0.5), trace)
    assert WorkloadArgs(trace=trace).build().priority_classes == {0: 5, 1: 5}
    assert WorkloadArgs(trace=trace, high_priority_share=0.1).build().priority_classes == {
        0: 1, 1: 9}
    with pytest.raises(ValueError, match="high_priority_share"):
        WorkloadArgs(trace=trace, high_priority_share=-1).build()


def mooncake_trace(path, requests: int = 6):
    """``requests`` Mooncake lines 1 s apart, in two prefix groups of 512-token blocks."""
    lines = [{"timestamp": 1000 * i, "input_length": 1024, "output_length": 3,
              "hash_ids": [i % 2, 10 + i]} for i in range(requests)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_a_mooncake_trace_is_replayed_in_a_window_faster_and_smaller(tmp_path) -> None:
    trace = mooncake_trace(tmp_path / "mc.jsonl")
    built = WorkloadArgs(trace=trace, start=1, max_requests=4, trace_speed=2,
                         token_scale=0.125, dataset_output_len=5).build()
    assert [r.request_id for r in built] == [f"mc-{i}" for i in range(1, 5)]
    assert [r.arrival_s for r in built] == [0.0, 0.5, 1.0, 1.5]
    assert {r.prompt.size for r in built} == {128} and {r.output_len for r in built} == {5}
    assert [r.shared_len for r in built] == [0, 0, 64, 64]


def test_a_jsonl_trace_takes_a_window_but_no_token_scale(tmp_path) -> None:
    trace = tmp_path / "trace.jsonl"
    save_jsonl(WorkloadArgs(groups=2, prompts_per_group=5, prefix_len=16, suffix_len=4,
                            output_len=2, request_rate=10.0).build(), trace)
    assert len(WorkloadArgs(trace=trace, start=7).build()) == 3
    with pytest.raises(ValueError, match="token_scale"):
        WorkloadArgs(trace=trace, token_scale=0.5).build()


def test_feather_sim_replays_a_slice_of_a_trace(tmp_path) -> None:
    out = tmp_path / "sim.json"
    result = CliRunner().invoke(app, [
        "sim", "--trace", str(mooncake_trace(tmp_path / "mc.jsonl", 12)), "--start", "2",
        "--max-requests", "8", "--trace-speed", "4", "--token-scale", "0.25",
        "--schedulers", "fcfs,feather-model", "--json", str(out)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    runs = json.loads(out.read_text())["runs"]
    assert [r["completed"] for r in runs.values()] == [8, 8]
    assert {r["total_input_tokens"] for r in runs.values()} == {8 * 256}


ARRIVALS = ["--groups", "3", "--prompts-per-group", "8", "--prefix-len", "256",
            "--suffix-len", "16", "--output-len", "4", "--request-rate", "20"]


def simulated(monkeypatch, flags: list[str]):
    """``feather sim FLAGS``'s workload and its fcfs run's records by request id."""
    from feather_sched.sim import runner

    seen = {}

    def simulate(plan, name, on_done=None):
        seen["workload"] = plan.workload
        seen["run"] = real(plan, name, on_done)
        return seen["run"]

    real = runner.simulate
    monkeypatch.setattr(runner, "simulate", simulate)
    result = CliRunner().invoke(app, ["sim", *ARRIVALS, *flags, "--schedulers", "fcfs"],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return seen["workload"], {r.request_id: r for r in seen["run"].records}


@pytest.mark.parametrize("flags, args", [
    (["--jitter", "0.5"], {"jitter": 0.5}),
    (["--order", "grouped"], {"order": "grouped"}),
    (["--burstiness", "2"], {"burstiness": 2.0}),
])
def test_feather_sim_runs_the_workload_bench_options_describe(monkeypatch, flags,
                                                               args) -> None:
    """--jitter, --order and --burstiness (once feather bench's alone) reach the simulated
    engine: each request is submitted at its arrival with its own prompt length, and the
    workload is the one WorkloadArgs builds, not the default's."""
    workload, records = simulated(monkeypatch, flags)
    knobs = dict(groups=3, prompts_per_group=8, prefix_len=256, suffix_len=16,
                 output_len=4, request_rate=20.0)
    expected = WorkloadArgs(**knobs, **args).build()
    default = WorkloadArgs(**knobs).build()

    def shape(w):
        return [(r.request_id, r.prompt.size, r.arrival_s) for r in w]

    assert shape(workload) == shape(expected) != shape(default)
    assert {rid: (r.prompt_len, r.submitted_s) for rid, r in records.items()} == {
        rid: (size, arrival) for rid, size, arrival in shape(expected)}
    if "burstiness" in args:  # bursts of 32: every request at the first burst's time
        assert len({r.arrival_s for r in workload}) == 1 < len({r.arrival_s for r in default})
