"""Tests for feather_sched.workloads: generators, arrivals, and trace round-trips."""

import itertools
import json
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from feather_sched.workloads.options import WorkloadArgs
from feather_sched.workloads.spec import (
    DEFAULT_TENANT,
    ArrivalSpec,
    RequestSpec,
    Workload,
    arrival_times,
    prioritized,
    tenanted,
)
from feather_sched.workloads.synthetic import (
    document_tenants,
    long_documents,
    minority_groups,
    multi_tenant,
    multi_turn_chat,
    no_sharing,
    shared_prefix_groups,
)
from feather_sched.workloads.traces import Replay, load_jsonl, load_mooncake, save_jsonl

POISSON = ArrivalSpec("poisson", rate=50.0)

GENERATORS: dict[str, Callable[..., Workload]] = {
    "shared": lambda **kw: shared_prefix_groups(
        groups=4, prompts_per_group=5, prefix_len=32, suffix_len=8, output_len=16, **kw
    ),
    "docs": lambda **kw: long_documents(
        documents=3, questions_per_document=4, doc_len_range=(64, 256), output_len=8, **kw
    ),
    "chat": lambda **kw: multi_turn_chat(
        conversations=3,
        turns=4,
        system_prompt_len=16,
        user_turn_len=8,
        assistant_turn_len=12,
        output_len=12,
        **kw,
    ),
    "none": lambda **kw: no_sharing(requests=20, prompt_len=64, output_len=8, **kw),
    "tenants": lambda **kw: multi_tenant(tenants=3, requests_per_tenant=4, prefix_len=64,
                                         suffix_len=8, output_len=4, short_prompt_len=16,
                                         **kw),
}


def by_group(workload: Workload) -> dict[int, list[RequestSpec]]:
    groups: dict[int, list[RequestSpec]] = defaultdict(list)
    for r in workload:
        groups[r.group].append(r)
    return groups


def write_lines(path: Path, lines: list[str | dict]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


# --------------------------------------------------------------------------- all generators


@pytest.mark.parametrize("make", GENERATORS.values(), ids=GENERATORS.keys())
def test_same_seed_same_workload_other_seed_other_tokens(make: Callable[..., Workload]) -> None:
    a, b, c = make(seed=7, arrival=POISSON), make(seed=7, arrival=POISSON), make(seed=8)
    assert a == b
    assert [r.arrival_s for r in a] == [r.arrival_s for r in b]
    tokens = {r.prompt.tobytes() for r in a}
    assert tokens.isdisjoint(r.prompt.tobytes() for r in c)


@pytest.mark.parametrize("make", GENERATORS.values(), ids=GENERATORS.keys())
def test_generated_requests_are_well_formed(make: Callable[..., Workload]) -> None:
    w = make(seed=1, arrival=POISSON, vocab_size=100)
    arrivals = [r.arrival_s for r in w]
    assert arrivals == sorted(arrivals)
    assert len({r.request_id for r in w}) == len(w)
    assert all(r.request_id.startswith(f"{w.name}-") for r in w)
    for r in w:
        assert r.prompt.dtype == np.int32 and r.prompt.flags.c_contiguous
        assert not r.prompt.flags.writeable
        assert r.prompt.min() >= 1 and r.prompt.max() < 100
    assert w.total_prompt_tokens == sum(r.prompt.size for r in w)
    assert w.total_output_tokens == sum(r.output_len for r in w)
    assert w.describe().startswith(f"{w.name}: {len(w)} requests")


# --------------------------------------------------------------------------- shared_prefix_groups


def test_shared_prefix_groups_structure() -> None:
    prefix, suffix, out, jitter = 24, 10, 20, 0.3
    w = shared_prefix_groups(
        groups=5,
        prompts_per_group=6,
        prefix_len=prefix,
        suffix_len=suffix,
        output_len=out,
        jitter=jitter,
    )
    groups = by_group(w)
    assert sorted(groups) == list(range(5))
    assert all(len(members) == 6 for members in groups.values())
    first_chunks = set()
    for members in groups.values():
        head = members[0].prompt[:prefix]
        assert all(np.array_equal(r.prompt[:prefix], head) for r in members)
        assert all(r.shared_len == prefix for r in members)
        first_chunks.add(head[:16].tobytes())
    assert len(first_chunks) == 5
    suffixes = [r.prompt[prefix:].tobytes() for r in w]
    assert len(set(suffixes)) == len(suffixes)
    for r in w:
        assert suffix * (1 - jitter) <= r.prompt.size - prefix <= suffix * (1 + jitter)
        assert out * (1 - jitter) <= r.output_len <= out * (1 + jitter)
    assert len({r.output_len for r in w}) > 1  # jitter actually varies lengths


def test_shared_prefix_groups_no_jitter_gives_exact_lengths() -> None:
    w = shared_prefix_groups(
        groups=3, prompts_per_group=4, prefix_len=8, suffix_len=5, output_len=7
    )
    assert {r.prompt.size for r in w} == {13}
    assert {r.output_len for r in w} == {7}


def test_minority_groups_can_have_longer_prefixes_than_the_majority() -> None:
    kw = dict(majority=6, minorities=[1, 2], prefix_len=8, suffix_len=3, output_len=2)
    same = minority_groups(**kw)
    assert same.requests == minority_groups(**kw, minority_prefix_len=8).requests
    longer = minority_groups(**kw, minority_prefix_len=20)
    sizes = {r.group: (r.prompt.size, r.shared_len) for r in longer}
    assert sizes == {0: (11, 8), 1: (23, 20), 2: (23, 20)}
    with pytest.raises(ValueError, match="minority_prefix_len"):
        minority_groups(**kw, minority_prefix_len=0)

def test_grouped_and_shuffled_order() -> None:
    kw = dict(groups=6, prompts_per_group=8, prefix_len=4, suffix_len=4, output_len=4)
    grouped = [r.group for r in shared_prefix_groups(order="grouped", **kw)]
    shuffled = [r.group for r in shared_prefix_groups(order="shuffled", **kw)]
    assert grouped == sorted(grouped)
    assert shuffled != sorted(shuffled)
    assert Counter(shuffled) == Counter(grouped)


def test_zipf_popularity_is_skewed_and_conserves_count() -> None:
    w = shared_prefix_groups(
        groups=10,
        prompts_per_group=20,
        prefix_len=4,
        suffix_len=4,
        output_len=4,
        popularity="zipf",
        zipf_s=1.2,
    )
    sizes = Counter(r.group for r in w)
    assert len(w) == 200
    assert sorted(sizes) == list(range(10))  # every group has at least one prompt
    assert sizes[0] > 20 > sizes[9]
    assert max(sizes.values()) > 2 * min(sizes.values())


def test_single_token_suffixes_are_still_unique() -> None:
    w = shared_prefix_groups(
        groups=1, prompts_per_group=9, prefix_len=2, suffix_len=1, output_len=1, vocab_size=10
    )
    assert sorted(int(r.prompt[-1]) for r in w) == list(range(1, 10))
    with pytest.raises(ValueError, match="distinct"):
        shared_prefix_groups(
            groups=1, prompts_per_group=10, prefix_len=2, suffix_len=1, output_len=1, vocab_size=10
        )


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"groups": 0}, "groups"),
        ({"prompts_per_group": -1}, "prompts_per_group"),
        ({"prefix_len": 0}, "prefix_len"),
        ({"suffix_len": 2.5}, "suffix_len"),
        ({"output_len": 0}, "output_len"),
        ({"jitter": 1.0}, "jitter"),
        ({"jitter": -0.1}, "jitter"),
        ({"order": "random"}, "order"),
        ({"popularity": "pareto"}, "popularity"),
        ({"zipf_s": 0.0}, "zipf_s"),
        ({"vocab_size": 1}, "vocab_size"),
    ],
)
def test_shared_prefix_groups_rejects_bad_arguments(override: dict, message: str) -> None:
    kw = dict(groups=2, prompts_per_group=2, prefix_len=4, suffix_len=4, output_len=4)
    with pytest.raises(ValueError, match=message):
        shared_prefix_groups(**(kw | override))


# --------------------------------------------------------------------------- other generators


def test_long_documents_share_the_document_prefix() -> None:
    w = long_documents(
        documents=4,
        questions_per_document=3,
        doc_len_range=(100, 300),
        question_len=(5, 9),
        output_len=8,
        order="grouped",
    )
    assert [r.group for r in w] == sorted(r.group for r in w)
    groups = by_group(w)
    assert sorted(groups) == [0, 1, 2, 3]
    for members in groups.values():
        doc_len = members[0].shared_len
        assert 100 <= doc_len <= 300
        assert all(r.shared_len == doc_len for r in members)
        assert all(np.array_equal(r.prompt[:doc_len], members[0].prompt[:doc_len]) for r in members)
        assert all(5 <= r.prompt.size - doc_len <= 9 for r in members)
        assert len({r.prompt[doc_len:].tobytes() for r in members}) == 3
    assert len({members[0].prompt[:16].tobytes() for members in groups.values()}) == 4


def test_long_documents_rejects_inverted_range() -> None:
    with pytest.raises(ValueError, match="doc_len_range"):
        long_documents(documents=1, questions_per_document=1, doc_len_range=(9, 3), output_len=1)


@pytest.mark.parametrize("arrival", [None, ArrivalSpec("bursty", rate=5.0, burst_size=2)])
def test_multi_turn_chat_turns_extend_previous_turn(arrival: ArrivalSpec | None) -> None:
    system, user, assistant = 16, 8, 12
    w = multi_turn_chat(
        conversations=3,
        turns=4,
        system_prompt_len=system,
        user_turn_len=user,
        assistant_turn_len=assistant,
        output_len=5,
        think_s=0.5,
        arrival=arrival,
    )
    conversations = by_group(w)
    assert sorted(conversations) == [0, 1, 2]
    system_prompt = w.requests[0].prompt[:system]
    for turns in conversations.values():
        assert len(turns) == 4
        for t, r in enumerate(turns):
            assert np.array_equal(r.prompt[:system], system_prompt)
            assert r.prompt.size == system + t * (user + assistant) + user
            assert r.shared_len == r.prompt.size - user
        for prev, cur in itertools.pairwise(turns):
            assert np.array_equal(cur.prompt[: prev.prompt.size], prev.prompt)
            if arrival is None:
                assert cur.arrival_s == prev.arrival_s == 0.0
            else:
                assert cur.arrival_s == pytest.approx(prev.arrival_s + 0.5)


def test_no_sharing_prompts_share_no_prefix() -> None:
    w = no_sharing(requests=200, prompt_len=40, output_len=10, jitter=0.5)
    assert len(w) == 200
    assert all(r.group == -1 and r.shared_len == 0 for r in w)
    assert len({r.prompt[:16].tobytes() for r in w}) == 200
    assert all(20 <= r.prompt.size <= 60 and 5 <= r.output_len <= 15 for r in w)


# --------------------------------------------------------------------------- arrivals


def test_poisson_mean_gap_matches_rate() -> None:
    times = arrival_times(20_000, ArrivalSpec("poisson", rate=4.0), np.random.default_rng(0))
    gaps = np.diff(times)
    assert times[0] > 0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(0.25, rel=0.05)
    assert gaps.std() == pytest.approx(0.25, rel=0.1)  # exponential: std == mean


def test_bursty_arrivals_come_in_equal_time_bursts() -> None:
    spec = ArrivalSpec("bursty", rate=10.0, burst_size=8)
    times = arrival_times(8 * 2000 + 3, spec, np.random.default_rng(1))
    bursts = [times[i : i + 8] for i in range(0, times.size, 8)]
    assert all(np.all(b == b[0]) for b in bursts)
    assert bursts[-1].size == 3
    starts = np.array([b[0] for b in bursts])
    assert np.all(np.diff(starts) > 0)
    assert np.diff(starts).mean() == pytest.approx(0.8, rel=0.08)


@pytest.mark.parametrize("spec", [None, ArrivalSpec()])
def test_all_at_once_arrivals_are_zero(spec: ArrivalSpec | None) -> None:
    assert np.array_equal(arrival_times(5, spec, np.random.default_rng(0)), np.zeros(5))
    assert arrival_times(0, POISSON, np.random.default_rng(0)).size == 0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"kind": "uniform", "rate": 1.0},
        {"kind": "poisson"},
        {"kind": "bursty", "rate": -1.0},
        {"kind": "poisson", "rate": float("inf")},
        {"kind": "bursty", "rate": 1.0, "burst_size": 0},
    ],
)
def test_arrival_spec_rejects_bad_values(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        ArrivalSpec(**kwargs)


# --------------------------------------------------------------------------- datatypes


def test_request_spec_copies_prompt_and_compares_by_value() -> None:
    source = np.array([5, 6, 7], dtype=np.int64)
    r = RequestSpec("r", source, 3, 0.5, 2, 2)
    source[0] = 99
    assert r.prompt.tolist() == [5, 6, 7] and r.prompt.dtype == np.int32
    assert r == RequestSpec("r", [5, 6, 7], 3, 0.5, 2, 2)
    assert r != RequestSpec("r", [5, 6, 8], 3, 0.5, 2, 2)
    assert r != RequestSpec("r", [5, 6, 7], 3, 0.5, 2, 2, priority=1)
    assert RequestSpec("r", [5], 3, 0.5, priority=np.int64(-2)).priority == -2
    assert len({r, RequestSpec("r", [5, 6, 7], 3, 0.5, 2, 2)}) == 1


@pytest.mark.parametrize(
    "bad",
    [
        {"prompt": []},
        {"prompt": [[1, 2]]},
        {"prompt": [1.5]},
        {"prompt": [-1]},
        {"prompt": [2**31]},
        {"shared_len": 4},
        {"output_len": -1},
        {"output_len": 1.0},
        {"arrival_s": float("nan")},
        {"arrival_s": -0.5},
        {"group": -2},
        {"request_id": ""},
        {"priority": 0.5},
        {"priority": "1"},
    ],
)
def test_request_spec_rejects_bad_fields(bad: dict) -> None:
    good = {"request_id": "r", "prompt": [1, 2, 3], "output_len": 1, "arrival_s": 0.0}
    with pytest.raises(ValueError):
        RequestSpec(**(good | bad))


def test_workload_sorts_stably_and_rejects_duplicate_ids() -> None:
    reqs = [RequestSpec(f"r{i}", [1], 1, t) for i, t in enumerate([2.0, 0.0, 2.0, 1.0])]
    assert [r.request_id for r in Workload("w", reqs)] == ["r1", "r3", "r0", "r2"]
    with pytest.raises(ValueError, match="duplicate"):
        Workload("w", [reqs[0], reqs[0]])


# --------------------------------------------------------------------------- JSONL traces

request_specs = st.builds(
    RequestSpec,
    request_id=st.text(min_size=1, max_size=8),
    prompt=st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=20),
    output_len=st.integers(0, 10_000),
    arrival_s=st.floats(0, 1e6, allow_nan=False),
    group=st.integers(-1, 50),
    shared_len=st.just(0),
    priority=st.integers(-5, 5),
)


@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    name=st.text(max_size=10),
    requests=st.lists(request_specs, max_size=6, unique_by=lambda r: r.request_id),
)
def test_jsonl_round_trip_is_exact(tmp_path: Path, name: str, requests: list) -> None:
    workload = Workload(name, requests)
    path = tmp_path / "trace.jsonl"
    save_jsonl(workload, path)
    loaded = load_jsonl(path)
    assert loaded == workload
    assert [r.arrival_s for r in loaded] == [r.arrival_s for r in workload]


@pytest.mark.parametrize("make", GENERATORS.values(), ids=GENERATORS.keys())
def test_generated_workload_round_trips(tmp_path: Path, make: Callable[..., Workload]) -> None:
    workload = prioritized(make(arrival=POISSON), 0.25)
    save_jsonl(workload, tmp_path / "w.jsonl")
    loaded = load_jsonl(tmp_path / "w.jsonl")
    assert loaded == workload
    assert loaded.priority_classes == workload.priority_classes and len(
        loaded.priority_classes) == 2


def test_a_trace_without_priorities_loads_as_one_class(tmp_path: Path) -> None:
    good = {k: v for k, v in GOOD.items() if k != "priority"}
    loaded = load_jsonl(write_lines(tmp_path / "old.jsonl", [HEADER, good]))
    assert loaded.priority_classes == {0: 1}
    urgent = load_jsonl(write_lines(tmp_path / "new.jsonl", [HEADER, good | {"priority": -3}]))
    assert urgent.priority_classes == {-3: 1}


# --------------------------------------------------------------------------- priorities


@pytest.mark.parametrize("make", GENERATORS.values(), ids=GENERATORS.keys())
def test_a_share_of_requests_gets_the_urgent_class(make: Callable[..., Workload]) -> None:
    workload = make(arrival=POISSON)
    mixed = prioritized(workload, 0.25, seed=3)
    n = len(workload)
    assert mixed.priority_classes == {0: round(0.25 * n), 1: n - round(0.25 * n)}
    assert [(r.request_id, r.arrival_s, r.group) for r in mixed] == [
        (r.request_id, r.arrival_s, r.group) for r in workload]
    assert all(np.array_equal(a.prompt, b.prompt) for a, b in zip(mixed, workload, strict=True))
    assert prioritized(workload, 0.25, seed=3) == mixed
    assert prioritized(workload, 0.25, seed=4) != mixed
    assert prioritized(mixed, 0.0).priority_classes == {0: n}
    assert prioritized(workload, 1.0).priority_classes == {0: n}
    assert "priority classes 0: " in mixed.describe()
    assert "priority" not in workload.describe()


def test_the_urgent_class_spans_prefix_groups() -> None:
    workload = shared_prefix_groups(groups=4, prompts_per_group=50, prefix_len=32,
                                    suffix_len=8, output_len=4)
    mixed = prioritized(workload, 0.1)
    urgent_groups = {r.group for r in mixed if r.priority == 0}
    assert len(urgent_groups) >= 3
    assert prioritized(workload, 0.001).priority_classes == {0: 1, 1: 199}


@pytest.mark.parametrize("share", [-0.1, 1.5, float("nan")])
def test_a_share_outside_0_to_1_is_refused(share: float) -> None:
    with pytest.raises(ValueError, match="high_priority_share must be in"):
        prioritized(GENERATORS["none"](), share)


HEADER = {"format": "feather-trace", "version": 1, "name": "t"}
GOOD = {
    "request_id": "a",
    "arrival_s": 0.0,
    "output_len": 1,
    "group": -1,
    "shared_len": 0,
    "prompt": [1, 2],
}


@pytest.mark.parametrize(
    ("lines", "line"),
    [
        ([], 1),
        (["not json"], 1),
        ([{"format": "other", "version": 1, "name": "t"}], 1),
        ([HEADER | {"version": 2}], 1),
        ([HEADER, GOOD, "{broken"], 3),
        ([HEADER, GOOD, "[1, 2]"], 3),
        ([HEADER, {k: v for k, v in GOOD.items() if k != "prompt"}], 2),
        ([HEADER, GOOD, GOOD | {"request_id": "b", "prompt": []}], 3),
        ([HEADER, GOOD | {"output_len": -1}], 2),
        ([HEADER, GOOD | {"output_len": "3"}], 2),
        ([HEADER, GOOD | {"prompt": [1, "x"]}], 2),
        ([HEADER, GOOD | {"shared_len": 5}], 2),
        ([HEADER, GOOD | {"priority": "high"}], 2),
    ],
)
def test_load_jsonl_reports_bad_line(tmp_path: Path, lines: list, line: int) -> None:
    path = write_lines(tmp_path / "bad.jsonl", lines)
    with pytest.raises(ValueError, match=f"line {line}:"):
        load_jsonl(path)


# --------------------------------------------------------------------------- Mooncake traces


def mooncake_line(ts: float, length: int, hash_ids: list[int], out: int = 4) -> dict:
    return {"timestamp": ts, "input_length": length, "output_length": out, "hash_ids": hash_ids}


def test_mooncake_shared_hash_ids_give_shared_prefixes(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "mc.jsonl",
        [
            mooncake_line(1000, 30, [1, 2, 3]),  # blocks of 12: 2*12 < 30 <= 36
            mooncake_line(1500, 36, [1, 2, 4]),
            mooncake_line(1500, 10, [5]),
            mooncake_line(2250, 35, [1, 2, 3]),  # block 3 seen with only 6 tokens so far
            mooncake_line(3000, 26, [1, 2, 3]),  # entirely inside earlier prompts
            mooncake_line(3000, 20, [5, 6]),  # block 5 seen with only 10 tokens
            mooncake_line(3500, 36, [1, 2, 3]),  # the longest earlier use of block 3 counts
        ],
    )
    w = load_mooncake(path, block_tokens=12)
    a, b, c, d, e, f, g = w.requests
    assert [r.prompt.size for r in w] == [30, 36, 10, 35, 26, 20, 36]
    assert [r.arrival_s for r in w] == [0.0, 0.5, 0.5, 1.25, 2.0, 2.0, 2.5]
    assert [r.group for r in w] == [1, 1, 5, 1, 1, 5, 1]
    assert [r.request_id for r in w] == [f"mc-{i}" for i in range(7)]
    assert [r.shared_len for r in w] == [0, 24, 0, 30, 26, 10, 35]
    assert np.array_equal(a.prompt[:24], b.prompt[:24])
    assert not np.array_equal(a.prompt[24:30], b.prompt[24:30])
    assert np.array_equal(d.prompt[:30], a.prompt)
    assert np.array_equal(e.prompt, a.prompt[:26])
    assert np.array_equal(f.prompt[:10], c.prompt)
    assert np.array_equal(g.prompt[:35], d.prompt)
    assert not np.array_equal(c.prompt, a.prompt[:10])
    assert {r.output_len for r in w} == {4}


def test_mooncake_blocks_depend_only_on_seed_and_hash_id(tmp_path: Path) -> None:
    one = write_lines(tmp_path / "one.jsonl", [mooncake_line(0, 1000, [7, 9])])
    two = write_lines(tmp_path / "two.jsonl", [mooncake_line(5, 300, [9])])
    block_9 = load_mooncake(one).requests[0].prompt[512:]
    assert block_9.size == 1000 - 512
    assert np.array_equal(load_mooncake(two).requests[0].prompt, block_9[:300])
    assert not np.array_equal(load_mooncake(two, seed=1).requests[0].prompt, block_9[:300])


def test_mooncake_reads_an_optional_priority(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "mc.jsonl", [mooncake_line(0, 5, [1]),
                                               mooncake_line(1, 5, [1]) | {"priority": 2}])
    assert [r.priority for r in load_mooncake(path, block_tokens=12)] == [0, 2]


@pytest.mark.parametrize(
    "bad",
    [
        mooncake_line(0, 5, [1]) | {"priority": 1.5},
        mooncake_line(0, 37, [1, 2, 3]),  # longer than 3 blocks
        mooncake_line(0, 24, [1, 2, 3]),  # fits in 2 blocks: the third id is unused
        mooncake_line(0, 5, []),
        mooncake_line(0, 5, [-1]),
        {"timestamp": 0, "input_length": 5, "hash_ids": [1]},
        mooncake_line(0, 5, [1], out=-2),
        "{oops",
    ],
)
def test_mooncake_rejects_bad_lines_with_line_number(tmp_path: Path, bad: dict | str) -> None:
    path = write_lines(tmp_path / "mc.jsonl", [mooncake_line(0, 5, [1]), "", bad])
    with pytest.raises(ValueError, match="line 3:"):
        load_mooncake(path, block_tokens=12)


def test_a_singleton_arrives_before_the_stream_of_one_group() -> None:
    from feather_sched.workloads.spec import ArrivalSpec
    from feather_sched.workloads.synthetic import singleton_before_a_stream

    workload = singleton_before_a_stream(stream=50, prefix_len=64, suffix_len=8, output_len=5,
                                         singleton_output_len=30,
                                         arrival=ArrivalSpec(kind="poisson", rate=10))
    first, *stream = workload.requests
    assert (first.group, first.shared_len, first.output_len, first.arrival_s) == (-1, 0, 30, 0)
    assert all(r.group == 0 and r.shared_len == 64 and r.arrival_s > 0 for r in stream)
    assert len({r.prompt[:64].tobytes() for r in stream}) == 1
    assert first.prompt[:64].tobytes() != stream[0].prompt[:64].tobytes()
    with pytest.raises(ValueError, match="stream"):
        singleton_before_a_stream(stream=0, prefix_len=64, suffix_len=8, output_len=5,
                                  singleton_output_len=30,
                                  arrival=ArrivalSpec(kind="poisson", rate=10))


def test_a_replay_window_keeps_the_trace_order_and_rebases_time(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "mc.jsonl", [
        mooncake_line(3000, 12, [1]), mooncake_line(1000, 24, [1, 2]),
        mooncake_line(2000, 24, [1, 3]), mooncake_line(5000, 12, [4])])
    w = load_mooncake(path, block_tokens=12, replay=Replay(start=1, max_requests=2, speed=4))
    assert [r.request_id for r in w] == ["mc-1", "mc-2"]  # lines 3 and 1 by timestamp
    assert [r.arrival_s for r in w] == [0.0, 0.25]
    assert [r.shared_len for r in w] == [0, 12]  # the window's first request is cold
    with pytest.raises(ValueError, match="leaves none"):
        load_mooncake(path, block_tokens=12, replay=Replay(start=4))


def test_a_token_scale_keeps_who_shares_what_at_fewer_tokens(tmp_path: Path) -> None:
    lines = [mooncake_line(0, 1024, [1, 2]), mooncake_line(1, 1100, [1, 2, 3]),
             mooncake_line(2, 700, [1, 4])]
    path = write_lines(tmp_path / "mc.jsonl", lines)
    full = load_mooncake(path)
    quarter = load_mooncake(path, replay=Replay(token_scale=0.25))
    assert [r.prompt.size for r in quarter] == [256, 256 + 19, 128 + 47]  # 76/4, 188/4 up
    assert [r.shared_len for r in quarter] == [0, 256, 128]
    assert [r.shared_len for r in full] == [0, 1024, 512]
    a, b, c = quarter.requests
    assert np.array_equal(b.prompt[:256], a.prompt)
    assert np.array_equal(c.prompt[:128], a.prompt[:128])
    assert not np.array_equal(c.prompt[128:], a.prompt[128:128 + 47])
    with pytest.raises(ValueError, match="whole tokens"):
        load_mooncake(path, replay=Replay(token_scale=0.3))


def test_a_replay_of_token_ids_takes_a_window_and_a_speed_but_no_scale(tmp_path: Path) -> None:
    workload = shared_prefix_groups(groups=2, prompts_per_group=3, prefix_len=8, suffix_len=2,
                                    output_len=2, arrival=ArrivalSpec("poisson", 10), seed=1)
    window = Replay(start=2, max_requests=3, speed=2).apply(workload)
    kept = workload.requests[2:5]
    assert [r.request_id for r in window] == [r.request_id for r in kept]
    assert [r.arrival_s for r in window] == pytest.approx(
        [(r.arrival_s - kept[0].arrival_s) / 2 for r in kept])
    with pytest.raises(ValueError, match="token_scale"):
        Replay(token_scale=0.5).apply(workload)


@pytest.mark.parametrize("bad", [dict(start=-1), dict(max_requests=0), dict(speed=0),
                                 dict(token_scale=float("inf"))])
def test_a_bad_replay_is_refused(bad: dict) -> None:
    with pytest.raises(ValueError):
        Replay(**bad)


# --------------------------------------------------------------------------- tenants


def test_multi_tenant_floods_from_one_shared_prefix() -> None:
    workload = GENERATORS["tenants"](arrival=POISSON)
    assert workload.tenants == {"t0": 16, "t1": 4, "t2": 4}
    flood = [r for r in workload if r.tenant == "t0"]
    assert {r.group for r in flood} == {0} and all(r.shared_len == 64 for r in flood)
    assert len({r.prompt[:64].tobytes() for r in flood}) == 1
    unshared = [r for r in workload if r.tenant == "t1"]
    assert all(r.group == -1 and r.prompt.size == 72 and r.output_len == 4 for r in unshared)
    long_output = [r for r in workload if r.tenant == "t2"]
    assert all(r.prompt.size == 16 and r.output_len == 32 for r in long_output)
    assert "3 tenants" in workload.describe()
    with pytest.raises(ValueError, match="2 or more tenants"):
        multi_tenant(tenants=1, requests_per_tenant=4, prefix_len=8, suffix_len=2,
                     output_len=1)


def test_multi_tenant_can_give_the_other_tenants_prefixes_of_their_own() -> None:
    """``prefixes_per_tenant``: the odd tenants' prompts sit behind one of their own long
    prefixes; the default workload is unchanged by the option."""
    options = dict(tenants=4, requests_per_tenant=12, prefix_len=32, suffix_len=4,
                   output_len=2, seed=3)
    plain, grouped = multi_tenant(**options), multi_tenant(**options, prefixes_per_tenant=3)
    assert [r.prompt.tobytes() for r in plain] == \
        [r.prompt.tobytes() for r in multi_tenant(**options, prefixes_per_tenant=0)]
    groups = {t: {r.group for r in grouped if r.tenant == t} for t in ("t1", "t3")}
    assert groups["t1"] <= {1, 2, 3} and groups["t3"] <= {4, 5, 6} and len(groups["t1"]) > 1
    for request in (r for r in grouped if r.tenant in groups):
        assert request.shared_len == 32 and request.prompt.size == 36
        siblings = [r for r in grouped if r.group == request.group]
        assert len({r.prompt[:32].tobytes() for r in siblings}) == 1
    assert [r.tenant for r in grouped] == [r.tenant for r in plain]
    assert all(r.group == -1 for r in grouped if r.tenant == "t2")
    with pytest.raises(ValueError, match="prefixes_per_tenant must be non-negative"):
        multi_tenant(**options, prefixes_per_tenant=-1)


def test_document_tenants_ask_about_private_documents_beside_a_light_interactive_one(
        ) -> None:
    """Each document tenant's questions sit behind one of its own documents (a group, its
    prefix shared only within it); the interactive tenant's prompts share nothing and
    have the long outputs; each stream at its own rate, merged in arrival order."""
    workload = document_tenants(documents_per_tenant=3, doc_len=32, question_len=(2, 4),
                                doc_output_len=4, doc_rate=20.0, chat_prompt_len=8,
                                chat_output_len=40, chat_rate=2.0, duration_s=5.0, seed=1)
    assert workload.tenants == {"docs0": 100, "docs1": 100, "chat": 10}
    arrivals = [r.arrival_s for r in workload]
    assert arrivals == sorted(arrivals)
    groups = {t: {r.group for r in workload if r.tenant == t} for t in ("docs0", "docs1")}
    assert groups["docs0"] <= {0, 1, 2} and groups["docs1"] <= {3, 4, 5}
    for request in (r for r in workload if r.tenant != "chat"):
        assert request.shared_len == 32 and 34 <= request.prompt.size <= 36
        assert request.output_len == 4
        siblings = [r for r in workload if r.group == request.group]
        assert len({r.prompt[:32].tobytes() for r in siblings}) == 1
    chat = [r for r in workload if r.tenant == "chat"]
    assert all(r.group == -1 and r.prompt.size == 8 and r.output_len == 40 for r in chat)
    with pytest.raises(ValueError, match="chat_rate and light_users must be >= 0"):
        document_tenants(documents_per_tenant=1, doc_len=8, doc_output_len=1, doc_rate=1.0,
                         chat_prompt_len=1, chat_output_len=1, chat_rate=-1.0, duration_s=1.0)


def test_light_users_each_send_a_few_unshared_prompts_from_a_moment_of_their_own() -> None:
    """Without a chat tenant (``chat_rate`` 0), ``light_users`` tenants each send 1 to
    ``light_requests`` unshared prompts; the document streams are those of the same seed
    without them (the light users are drawn after)."""
    options = dict(documents_per_tenant=2, doc_len=32, doc_output_len=4, doc_rate=10.0,
                   chat_prompt_len=8, chat_output_len=8, chat_rate=0.0, duration_s=20.0,
                   seed=3)
    plain = document_tenants(**options)
    workload = document_tenants(**options, light_users=50, light_requests=3,
                                light_prompt_len=16, light_output_len=5)
    users = {t: n for t, n in workload.tenants.items() if t.startswith("user")}
    assert len(users) == 50 and set(users.values()) == {1, 2, 3} and "chat" not in users
    light = [r for r in workload if r.tenant.startswith("user")]
    assert all(r.group == -1 and r.prompt.size == 16 and r.output_len == 5 for r in light)
    assert len({r.prompt.tobytes() for r in light}) == len(light)
    starts = sorted(min(r.arrival_s for r in light if r.tenant == t) for t in users)
    assert starts[0] < 5.0 and starts[-1] > 15.0  # spread over the stream
    docs = [(r.arrival_s, r.prompt.tobytes()) for r in workload if r.tenant.startswith("docs")]
    assert docs == [(r.arrival_s, r.prompt.tobytes()) for r in plain]


def test_tenanted_keeps_a_prefix_group_in_one_tenant() -> None:
    workload = tenanted(GENERATORS["shared"](), 3)
    by_tenant = {g: {r.tenant for r in members} for g, members in by_group(workload).items()}
    assert by_tenant == {0: {"t0"}, 1: {"t1"}, 2: {"t2"}, 3: {"t0"}}
    assert tenanted(workload, 1) is workload
    alone = tenanted(GENERATORS["none"](), 4)
    assert [r.tenant for r in alone][:5] == ["t0", "t1", "t2", "t3", "t0"]
    with pytest.raises(ValueError, match="tenants must be a positive integer"):
        tenanted(workload, 0)


def test_tenants_round_trip_and_default_when_absent(tmp_path: Path) -> None:
    workload = GENERATORS["tenants"]()
    save_jsonl(workload, tmp_path / "w.jsonl")
    assert load_jsonl(tmp_path / "w.jsonl").tenants == workload.tenants
    good = {k: v for k, v in GOOD.items() if k != "tenant"}
    assert load_jsonl(write_lines(tmp_path / "old.jsonl", [HEADER, good])).tenants == {
        DEFAULT_TENANT: 1}
    assert load_jsonl(write_lines(tmp_path / "id.jsonl", [HEADER, good | {"tenant": 3}])
                      ).tenants == {"3": 1}  # a numeric id, as every front takes it
    with pytest.raises(ValueError, match="line 2: field 'tenant' must be a non-empty string"):
        load_jsonl(write_lines(tmp_path / "bad.jsonl", [HEADER, good | {"tenant": True}]))
    with pytest.raises(ValueError, match="tenant must be a non-empty string"):
        RequestSpec("r", [5], 3, 0.5, tenant="")
    assert RequestSpec("r", [5], 3, 0.5, tenant="a") != RequestSpec("r", [5], 3, 0.5)


def test_mooncake_reads_an_optional_tenant(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "mc.jsonl", [mooncake_line(0, 5, [1]),
                                               mooncake_line(1, 5, [1]) | {"tenant": "acme"}])
    assert [r.tenant for r in load_mooncake(path, block_tokens=12)] == [DEFAULT_TENANT, "acme"]


def test_workload_options_spread_tenants() -> None:
    built = WorkloadArgs(groups=4, prompts_per_group=2, prefix_len=16, suffix_len=4,
                         output_len=2, tenants=2).build()
    assert built.tenants == {"t0": 4, "t1": 4}
    flood = WorkloadArgs(kind="multi-tenant", groups=3, prompts_per_group=2, prefix_len=16,
                         suffix_len=4, output_len=2).build()
    assert flood.tenants == {"t0": 8, "t1": 2, "t2": 2}
    with pytest.raises(ValueError, match="leave --tenants at 1"):
        WorkloadArgs(kind="multi-tenant", tenants=2).build()


def test_workload_options_give_the_odd_tenants_prefixes_of_their_own() -> None:
    """``--prefixes-per-tenant``: t1's prompts start with one of its own 2 prefixes, a
    group each; a knob of multi-tenant only."""
    args = dict(kind="multi-tenant", groups=2, prompts_per_group=8, prefix_len=16,
                suffix_len=4, output_len=2)
    own = WorkloadArgs(**args, prefixes_per_tenant=2).build()
    groups = {r.group for r in own if r.tenant == "t1"}
    assert len(groups) == 2 and -1 not in groups
    assert {r.group for r in WorkloadArgs(**args).build() if r.tenant == "t1"} == {-1}
    with pytest.raises(ValueError, match="prefixes per tenant are multi-tenant's"):
        WorkloadArgs(prefixes_per_tenant=2).build()
