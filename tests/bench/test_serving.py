"""The workload knobs ``feather bench`` and ``feather sim`` share (``WorkloadArgs``)."""

from __future__ import annotations

import pytest

from feather_sched.bench.serving import WORKLOADS, WorkloadArgs
from feather_sched.workloads import prioritized, save_jsonl


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
