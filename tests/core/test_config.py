"""Feather options: engine mapping over FEATHER_* variables over defaults, all validated,
and the files Feather will write checked before anything starts."""

from __future__ import annotations

import contextlib
import json
import re
import tempfile

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from feather_sched.core.config import (
    FILE_OPTIONS,
    REPLICA_VARIABLE,
    VALIDATORS,
    FeatherConfig,
    FeatherConfigError,
    Placement,
)
from feather_sched.gates import GATE_KINDS
from feather_sched.gates.bandit import UCBBanditGate
from feather_sched.gates.base import BatchLayout, Decision, GateContext
from feather_sched.gates.heuristic import ChunkLossGate
from feather_sched.gates.model import ModelGate
from feather_sched.gates.step_model import EngineShape, StepPrior


def test_defaults_make_a_model_gate_queue() -> None:
    config = FeatherConfig.from_sources(None, environ={})
    assert config.gate == "model" and config.max_overtakes == 32
    gate = config.make_queue().gate
    assert isinstance(gate, ModelGate) and gate.layout is BatchLayout.FEATHER and not gate.observes
    assert isinstance(FeatherConfig(gate="bandit").make_gate(), UCBBanditGate)
    assert isinstance(FeatherConfig(gate="chunk-loss").make_gate(), ChunkLossGate)


def test_the_model_gate_starts_from_the_engines_profile_unless_told_otherwise(caplog) -> None:
    h200 = EngineShape("NVIDIA H200", {"model_type": "llama", "hidden_size": 1024,
                                       "intermediate_size": 2048, "num_attention_heads": 8,
                                       "num_hidden_layers": 4, "vocab_size": 1000})
    expected, _ = StepPrior.for_engine(h200)
    with caplog.at_level("INFO", logger="feather_sched"):
        warm = FeatherConfig().make_queue(engine=h200).gate
    assert warm.model.prior == expected and warm.model.ready
    assert "model gate starts from the h200 profile" in caplog.text
    assert "it predicts only where batch ordering cannot act" in caplog.text
    assert FeatherConfig().make_gate().model.prior is None  # no engine described
    told = FeatherConfig(gate_options={"prior": "none"}).make_gate(engine=h200)
    assert told.model.prior is None and not told.model.ready
    named = FeatherConfig(gate_options={"prior": "h100-sxm/llama-3-8b"}).make_gate(engine=h200)
    assert named.model.prior == StepPrior.named("h100-sxm/llama-3-8b")


def test_engine_options_override_the_environment() -> None:
    environ = {"FEATHER_GATE": "always", "FEATHER_MAX_WAIT_S": "5", "FEATHER_CHUNK_TOKENS": "64"}
    config = FeatherConfig.from_sources({"gate": "bandit"}, environ=environ)
    assert (config.gate, config.max_wait_s, config.chunk_tokens) == ("bandit", 5.0, 64)


def test_environment_parses_every_option(tmp_path) -> None:
    config = FeatherConfig.from_sources(None, environ={
        "FEATHER_GATE": "bandit", "FEATHER_GATE_OPTIONS": '{"exploration": 50, "seed": 3}',
        "FEATHER_MAX_WAIT_S": "off", "FEATHER_ORDER_RUNNING": "no",
        "FEATHER_MAX_OVERTAKES": "off", "FEATHER_STATE_FILE": str(tmp_path / "x.json")})
    gate = config.make_gate()
    assert isinstance(gate, UCBBanditGate) and gate.exploration == 50
    assert config.max_wait_s is None and config.order_running is False
    assert config.max_overtakes is None


def test_shortest_when_all_fits_reaches_the_queue_and_its_tree() -> None:
    queue = FeatherConfig.from_sources({"shortest_when_all_fits": True}, environ={}) \
        .make_queue()
    assert queue.uncached_order and queue.tree.fewest_uncached() is None
    assert not FeatherConfig().make_queue().uncached_order


def test_min_passing_tokens_reach_the_tree() -> None:
    config = FeatherConfig.from_sources(None, environ={"FEATHER_MIN_PASSING_TOKENS": "512",
                                                       "FEATHER_CHUNK_TOKENS": "64"})
    assert config.make_queue().tree.min_rank_chunks == 8
    assert FeatherConfig().make_queue().tree.min_rank_chunks == 2


def test_fair_share_reaches_the_queue_with_its_weights_and_quantum() -> None:
    assert FeatherConfig().make_queue().share is None
    config = FeatherConfig.from_sources(
        {"fairness": "tenants", "tenant_weights": {"gold": 2}}, environ={
            "FEATHER_FAIR_QUANTUM_TOKENS": "512"})
    share = config.make_queue().share
    assert share is not None and share.quantum == 512
    assert (share.weight("gold"), share.weight("anyone")) == (2.0, 1.0)


def test_vtc_is_the_share_without_prefix_order_gate_or_waiting_bound() -> None:
    config = FeatherConfig.from_sources(
        {"fairness": "vtc", "tenant_weights": {"gold": 2}, "gate": "bandit",
         "fair_hit_weight": 0, "fair_quantum_tokens": 512}, environ={})
    queue = config.make_queue()
    share = queue.share
    assert share is not None and not queue.prefix_order and queue.gate.always_adds
    assert (share.quantum, share.hit_weight, share.shares_seats) == (0, 1, False)
    assert share.weight("gold") == 2.0 and queue.bound is None and queue.max_wait_s is None
    assert config.batch_layout is BatchLayout.ENGINE and queue.layout is BatchLayout.ENGINE


def test_json_values_mean_what_the_documentation_says() -> None:
    """"off" turns a bound off in JSON as in the environment; "no" is false."""
    config = FeatherConfig.from_sources({"max_wait_s": "off", "order_running": "no",
                                         "max_overtakes": None}, environ={})
    assert config.max_wait_s is None and config.order_running is False
    assert config.max_overtakes is None


@pytest.mark.parametrize(
    ("options", "environ", "message"),
    [
        ({"gate": "greedy"}, {}, "option 'gate': must be one of"),
        ({"gait": "bandit"}, {}, r"unknown feather option\(s\) \['gait'\]"),
        ({"chunk_tokens": 0}, {}, "'chunk_tokens': must be a positive integer"),
        ({"chunk_tokens": True}, {}, "'chunk_tokens': must be an integer, got True"),
        ({"max_wait_s": -1}, {}, "'max_wait_s': must be a non-negative number"),
        ({"max_wait_s": True}, {}, "'max_wait_s': must be a number of seconds"),
        ({"max_wait_s": "soon"}, {}, "'max_wait_s'"),
        ({"order_running": "maybe"}, {}, "'order_running': must be true or false"),
        ({"order_running": 1}, {}, "'order_running': must be true or false"),
        ({"max_overtakes": -1}, {}, "'max_overtakes': must be a non-negative integer"),
        ({"min_passing_tokens": -1}, {}, "'min_passing_tokens': must be a non-negative int"),
        ({"min_passing_tokens": "off"}, {}, "'min_passing_tokens'"),
        ({"gate": "chunk-loss", "gate_options": {"max_loss": -3}}, {},
         "max_loss must be non-negative"),
        ({"gate": "always", "state_file": "t.json"}, {}, "needs gate 'bandit'"),
        ({}, {"FEATHER_CHUNK_TOKENS": "many"}, "FEATHER_CHUNK_TOKENS='many'"),
        ({}, {"FEATHER_GATE_OPTIONS": "[1]"}, "must be a JSON object"),
        ({}, {"FEATHER_ORDER_RUNNING": "maybe"}, "must be true or false"),
        ({"fairness": "clients"}, {}, "'fairness': must be one of off, tenants, vtc"),
        ({"tenant_weights": {"a": 0}}, {}, "'tenant_weights': tenant 'a': a weight must"),
        ({"tenant_weights": {"a": True}}, {}, "'tenant_weights': tenant 'a'"),
        ({"tenant_weights": [1]}, {}, "'tenant_weights': must be a JSON object"),
        ({"tenant_weights": {" a": 1}}, {}, "'tenant_weights': a tenant weight's name must be a "
         "non-empty string"),
        ({"fair_quantum_tokens": -1}, {}, "'fair_quantum_tokens': must be a non-negative"),
        ({"fair_hit_weight": 1.5}, {}, "'fair_hit_weight': must be a number from 0 to 1"),
        ({}, {"FEATHER_FAIR_HIT_WEIGHT": "nan"}, "must be a number from 0 to 1"),
    ],
)
def test_bad_options_name_themselves(options, environ, message) -> None:
    with pytest.raises(FeatherConfigError, match=message):
        FeatherConfig.from_sources(options, environ=environ)


def test_options_must_be_an_object() -> None:
    with pytest.raises(FeatherConfigError, match="must be a JSON object"):
        FeatherConfig.from_sources(["gate", "bandit"], environ={})  # type: ignore[arg-type]


@pytest.mark.parametrize("option", ["state_file", "stats_file", "step_log"])
def test_files_feather_cannot_write_fail_at_startup(tmp_path, option) -> None:
    extra = {"gate": "bandit"} if option == "state_file" else {}
    missing = tmp_path / "missing" / "f.json"
    with pytest.raises(FeatherConfigError, match=rf"'{option}' \({missing}\): directory"):
        FeatherConfig.from_sources({option: str(missing), **extra}, environ={})
    with pytest.raises(FeatherConfigError, match=rf"'{option}' \({tmp_path}\): is a directory"):
        FeatherConfig.from_sources({option: str(tmp_path), **extra}, environ={})
    # a directory no process may write in, root included
    with pytest.raises(FeatherConfigError, match="cannot write in /proc/1"):
        FeatherConfig.from_sources({option: "/proc/1/feather.json", **extra}, environ={})


@pytest.mark.parametrize(("content", "message"), [
    ("{not json", "not JSON"),
    ("[1, 2]", "not a feather bandit table"),
    ('{"format": "feather-bandit", "version": 1}', "binning"),
    (None, "malformed"),
])
def test_a_bad_state_file_names_the_option_and_the_path(tmp_path, content, message) -> None:
    path = tmp_path / "bandit.json"
    if content is None:
        gate = UCBBanditGate()
        gate.save(path)
        data = json.loads(path.read_text())
        data["table"] = [{"context": [1, 2], "action": "add"}]
        content = json.dumps(data)
    path.write_text(content)
    with pytest.raises(FeatherConfigError, match=rf"'state_file' \({path}\): .*{message}"):
        FeatherConfig.from_sources({"gate": "bandit", "state_file": str(path)}, environ={})


def test_a_saved_table_is_loaded_and_the_load_is_logged(tmp_path, caplog) -> None:
    path = tmp_path / "bandit.json"
    gate = UCBBanditGate()
    context = GateContext(batch_size=5, chunk_loss=2, sharing_waiters=0, num_waiting=3)
    gate.reward([(context, Decision.STOP)], batch_size=5, seconds=0.5)
    gate.save(path)
    with caplog.at_level("INFO", logger="feather_sched"):
        loaded = FeatherConfig.from_sources({"gate": "bandit", "state_file": str(path)},
                                            environ={}).make_gate()
    assert loaded.table == gate.table
    assert caplog.text.count(f"bandit table loaded from {path} (1 learned decisions)") == 1


# ---- files in deployments of several scheduler processes ------------------------------


@pytest.mark.parametrize(("given", "placement", "path"), [
    ("stats.json", Placement(0, 1), "stats.json"),
    ("stats.json", Placement(0, 2), "stats.rank0.json"),
    ("d/stats.json", Placement(1, 2), "d/stats.rank1.json"),
    ("d/steps", Placement(3, 4), "d/steps.rank3"),
    ("d/{rank}/stats.json", Placement(0, 1), "d/0/stats.json"),
    ("stats-{rank:02d}.json", Placement(1, 2), "stats-01.json"),
    ("{{x}}-{rank}.json", Placement(1, 2), "{x}-1.json"),
    ("{{x}}.json", Placement(1, 2), "{x}.rank1.json"),
])
def test_each_process_gets_its_own_file(given: str, placement: Placement, path: str) -> None:
    assert placement.path(given) == path


def test_ranks_count_replicas_and_data_parallel_ranks_in_them() -> None:
    assert Placement.of(environ={}) == Placement(0, 1)
    assert Placement.of(1, 2, environ={}) == Placement(1, 2)
    assert Placement.of(1, 2, environ={REPLICA_VARIABLE: "1/2"}) == Placement(3, 4)
    assert Placement.of(environ={REPLICA_VARIABLE: "2/2"}) == Placement(2, 3)  # a surge
    for bad in ("2", "-1/2", "0/0", "a/b", "1/2/3", ""):
        with pytest.raises(FeatherConfigError, match=rf"FEATHER_REPLICA={bad!r}: must be r/n"):
            Placement.of(environ={REPLICA_VARIABLE: bad})


def test_several_processes_write_their_own_files_and_say_which(tmp_path, caplog) -> None:
    given = {option: str(tmp_path / name) for option, name in
             [("state_file", "bandit.json"), ("stats_file", "stats.json"),
              ("step_log", "steps.csv")]}
    lone = FeatherConfig.from_sources({"gate": "bandit", **given}, environ={})
    assert [getattr(lone, o) for o in given] == list(given.values())
    assert lone.shared_state_file is None
    with caplog.at_level("INFO", logger="feather_sched"):
        second = FeatherConfig.from_sources({"gate": "bandit", **given}, environ={},
                                            dp_rank=1, dp_ranks=2)
    assert (second.state_file, second.stats_file, second.step_log) == tuple(
        str(tmp_path / name) for name in ("bandit.rank1.json", "stats.rank1.json",
                                          "steps.rank1.csv"))
    assert second.shared_state_file == given["state_file"]
    assert f"scheduler rank 1 of 2 writes state_file {second.state_file}, stats_file " \
        f"{second.stats_file}, step_log {second.step_log}" in caplog.text
    templated = FeatherConfig.from_sources(
        {"stats_file": str(tmp_path / "s{rank}.json")}, environ={REPLICA_VARIABLE: "1/2"})
    assert templated.stats_file == str(tmp_path / "s1.json")


def pretrained(path, decisions: int) -> UCBBanditGate:
    """A bandit table with ``decisions`` rewarded decisions, saved to ``path``."""
    gate = UCBBanditGate()
    context = GateContext(batch_size=5, chunk_loss=2, sharing_waiters=0, num_waiting=3)
    gate.reward([(context, Decision.STOP)] * decisions, batch_size=5, seconds=0.5)
    gate.save(path)
    return gate


def test_every_rank_starts_from_the_shared_table_until_it_has_its_own(tmp_path,
                                                                      caplog) -> None:
    shared = tmp_path / "bandit.json"
    pretrained(shared, 3)
    options = {"gate": "bandit", "state_file": str(shared)}
    for rank in (0, 1):
        config = FeatherConfig.from_sources(options, environ={}, dp_rank=rank, dp_ranks=2)
        assert config.warm_start_file() == str(shared)
        with caplog.at_level("INFO", logger="feather_sched"):
            assert config.make_gate().learned_decisions == 3
        assert f"loaded from {shared} (3 learned decisions); saved to " \
            f"{tmp_path / f'bandit.rank{rank}.json'}" in caplog.text
    pretrained(tmp_path / "bandit.rank1.json", 5)  # rank 1 has saved its own since
    ranks = [FeatherConfig.from_sources(options, environ={}, dp_rank=r, dp_ranks=2)
             for r in (0, 1)]
    assert [c.make_gate().learned_decisions for c in ranks] == [3, 5]
    templated = FeatherConfig.from_sources(  # a name with {rank}: each rank's own only
        {"gate": "bandit", "state_file": str(tmp_path / "bandit{rank}.json")}, environ={})
    assert templated.warm_start_file() is None
    (tmp_path / "bandit.rank0.json").write_text("{torn")  # its own table is read, and fails
    with pytest.raises(FeatherConfigError, match=r"'state_file' \(.*bandit.rank0.json\)"):
        FeatherConfig.from_sources(options, environ={}, dp_rank=0, dp_ranks=2)


@pytest.mark.parametrize(("path", "message"), [
    ("s-{replica}.json", "only the placeholder {rank}"),
    ("s-{}.json", "only the placeholder {rank}"),
    ("s-{rank[0]}.json", "only the placeholder {rank}"),
    ("s-{rank:s}.json", "Unknown format code 's'"),
    ("s-{rank.json", "expected '}'"),
    ("s\0.json", "must be a file path"),
])
def test_bad_file_names_name_the_option(path: str, message: str) -> None:
    with pytest.raises(FeatherConfigError, match=rf"'stats_file': .*{re.escape(message)}"):
        FeatherConfig.from_sources({"stats_file": path}, environ={})


def test_one_option_is_read_without_checking_the_others(tmp_path) -> None:
    """What a worker on another node reads: the scheduler's files need not exist there."""
    elsewhere = {"gate": "bandit", "order_running": False,
                 **{o: str(tmp_path / "head-node-only" / "f") for o in FILE_OPTIONS}}
    with pytest.raises(FeatherConfigError, match="directory"):
        FeatherConfig.from_sources(elsewhere, environ={})
    assert FeatherConfig.option("order_running", elsewhere, environ={}) is False
    assert FeatherConfig.option("order_running", None, environ={}) is True
    assert FeatherConfig.option("order_running", None, {"FEATHER_ORDER_RUNNING": "no"}) is False
    assert FeatherConfig.option("gate_options", None, environ={}) == {}
    with pytest.raises(FeatherConfigError, match="'order_running': must be true or false"):
        FeatherConfig.option("order_running", {"order_running": "maybe"}, environ={})


# ---- no input makes the parser fail but with FeatherConfigError naming the option -----

GATE_OPTION_NAMES = ("exploration", "seed", "batch_bin", "max_loss", "floor_start", "prior",
                     "lookahead", "margin", "window", "ordered", "forgetting")
WORDS = ("off", "none", "inf", "nan", "-1", "0", "1", "1e999", "true", "no", "maybe", "auto",
         "{}", '{"exploration": 5}', "[1]", "{torn", "1/2", "3/2", "h100-sxm/llama-3-8b")
PATHS = ("stats.json", "d/{rank}.json", "{replica}.json", "{rank:s}", "missing/x.json", ".",
         "/", "/proc/1/f.json", "{{}}.json", "s\0.json")
SCALARS = (st.none() | st.booleans() | st.integers() | st.integers(min_value=10**310)
           | st.floats() | st.text(max_size=12) | st.sampled_from(WORDS + PATHS))
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.sampled_from(GATE_OPTION_NAMES) | st.text(max_size=6), inner, max_size=3),
    max_leaves=6)
COUNTS = st.integers(0, 64) | st.just("off")
VALID = {
    "gate": st.sampled_from(GATE_KINDS),
    "gate_options": st.dictionaries(st.sampled_from(GATE_OPTION_NAMES), SCALARS, max_size=2),
    "chunk_tokens": st.integers(1, 4096),
    "max_overtakes": COUNTS,
    "max_stops": COUNTS,
    "max_wait_s": st.floats(0, 60) | st.just("off"),
    "min_passing_tokens": st.integers(0, 4096),
    "order_running": st.booleans(),
    "shared_prefix_attention": st.sampled_from(["auto", "on", "off"]),
    "shared_prefix_min_tokens": st.none() | st.integers(1, 65536),
    "fairness": st.sampled_from(["off", "tenants", "vtc"]),
    "tenant_weights": st.dictionaries(st.text("abc", min_size=1, max_size=4),
                                      st.floats(0.1, 10), max_size=2),
    "fair_quantum_tokens": st.integers(0, 10**6),
    "fair_hit_weight": st.floats(0, 1),
    **dict.fromkeys(FILE_OPTIONS, st.none() | st.sampled_from(["f.json", "f{rank}.json"])),
}
"""Mostly valid values (gate options anything), so that examples get past the first
check; then at most one option is replaced by anything at all."""
OPTIONS = st.builds(
    lambda valid, anything: {**valid, **anything},
    st.fixed_dictionaries({}, optional=VALID),
    st.dictionaries(st.sampled_from(sorted(VALIDATORS)) | st.text(max_size=8), JSON,
                    max_size=1))
ENVIRON = st.dictionaries(
    st.sampled_from([f"FEATHER_{name.upper()}" for name in VALIDATORS] + [REPLICA_VARIABLE]),
    st.text(max_size=12) | st.sampled_from(WORDS + PATHS + GATE_KINDS), max_size=1)


def names_given(options: dict, environ: dict) -> set[str]:
    """How a message may name what it rejects: an option (quoted, or its repr if unknown)
    or a variable."""
    return {f"'{n}'" for n in options} | {repr(n) for n in options} | set(environ) | {
        f"'{v.removeprefix('FEATHER_').lower()}'" for v in environ}


@settings(max_examples=400, deadline=None)
@given(OPTIONS, ENVIRON)
@example({"gate_options": {"prior": 5}}, {})  # was an AttributeError
@example({"max_wait_s": 10**310}, {})  # was an OverflowError
def test_any_options_give_a_config_or_an_error_naming_the_option(options, environ) -> None:
    with tempfile.TemporaryDirectory() as scratch, contextlib.chdir(scratch):
        try:
            FeatherConfig.from_sources(options, environ=environ)
        except FeatherConfigError as error:
            assert any(name in str(error) for name in names_given(options, environ)), error


@given(JSON.filter(lambda value: not isinstance(value, dict)))
def test_options_that_are_no_mapping_are_refused_as_such(options) -> None:
    if options is None:
        return  # no options at all: the defaults
    with pytest.raises(FeatherConfigError, match="feather options must be a JSON object"):
        FeatherConfig.from_sources(options, environ={})


@pytest.mark.parametrize(("text", "message"), [("{not json", "not a JSON object"),
                                               ("[1, 2]", "not a JSON object")])
def test_options_as_json_text_name_their_source(text: str, message: str) -> None:
    assert FeatherConfig.from_sources(None, environ={}, json_text='{"gate": "bandit"}'
                                      ).gate == "bandit"
    with pytest.raises(FeatherConfigError, match=f"FEATHER_SGLANG_OPTIONS: {message}"):
        FeatherConfig.from_sources(None, environ={}, json_text=text,
                                   source="FEATHER_SGLANG_OPTIONS")
    with pytest.raises(ValueError, match="not both"):
        FeatherConfig.from_sources({}, environ={}, json_text="{}")
