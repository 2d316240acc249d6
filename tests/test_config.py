"""Feather options: engine mapping over FEATHER_* variables over defaults, all validated,
and the files Feather will write checked before anything starts."""

from __future__ import annotations

import json

import pytest

from feather_sched.config import FeatherConfig, FeatherConfigError
from feather_sched.gate import ChunkLossGate, Decision, GateContext, UCBBanditGate
from feather_sched.model_gate import ModelGate
from feather_sched.step_model import EngineShape, StepPrior


def test_defaults_make_a_model_gate_queue() -> None:
    config = FeatherConfig.from_sources(None, environ={})
    assert config.gate == "model" and config.max_overtakes == 32
    gate = config.make_queue().gate
    assert isinstance(gate, ModelGate) and gate.ordered and not gate.observes
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
        ({"gate": "chunk-loss", "gate_options": {"max_loss": -3}}, {},
         "max_loss must be non-negative"),
        ({"gate": "always", "state_file": "t.json"}, {}, "needs gate 'bandit'"),
        ({}, {"FEATHER_CHUNK_TOKENS": "many"}, "FEATHER_CHUNK_TOKENS='many'"),
        ({}, {"FEATHER_GATE_OPTIONS": "[1]"}, "must be a JSON object"),
        ({}, {"FEATHER_ORDER_RUNNING": "maybe"}, "must be true or false"),
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
