"""Feather options: engine mapping over FEATHER_* variables over defaults, all validated."""

from __future__ import annotations

import pytest

from feather_sched.config import FeatherConfig, FeatherConfigError
from feather_sched.gate import ChunkLossGate, UCBBanditGate


def test_defaults_make_a_bandit_queue() -> None:
    config = FeatherConfig.from_sources(None, environ={})
    assert config.gate == "bandit"
    assert isinstance(config.make_queue().gate, UCBBanditGate)
    assert isinstance(FeatherConfig(gate="chunk-loss").make_gate(), ChunkLossGate)


def test_engine_options_override_the_environment() -> None:
    environ = {"FEATHER_GATE": "always", "FEATHER_MAX_WAIT_S": "5", "FEATHER_CHUNK_TOKENS": "64"}
    config = FeatherConfig.from_sources({"gate": "bandit"}, environ=environ)
    assert (config.gate, config.max_wait_s, config.chunk_tokens) == ("bandit", 5.0, 64)


def test_environment_parses_every_option() -> None:
    config = FeatherConfig.from_sources(None, environ={
        "FEATHER_GATE": "bandit", "FEATHER_GATE_OPTIONS": '{"exploration": 50, "seed": 3}',
        "FEATHER_MAX_WAIT_S": "off", "FEATHER_ORDER_RUNNING": "no",
        "FEATHER_STATE_FILE": "/tmp/x.json"})
    gate = config.make_gate()
    assert isinstance(gate, UCBBanditGate) and gate.exploration == 50
    assert config.max_wait_s is None and config.order_running is False


@pytest.mark.parametrize(
    ("options", "environ", "message"),
    [
        ({"gate": "greedy"}, {}, "option 'gate' must be one of"),
        ({"gait": "bandit"}, {}, r"unknown feather option\(s\) \['gait'\]"),
        ({"chunk_tokens": 0}, {}, "'chunk_tokens' must be a positive integer"),
        ({"max_wait_s": -1}, {}, "'max_wait_s' must be non-negative"),
        ({"gate": "chunk-loss", "gate_options": {"max_loss": -3}}, {},
         "max_loss must be non-negative"),
        ({"gate": "always", "state_file": "t.json"}, {}, "needs gate 'bandit'"),
        ({}, {"FEATHER_CHUNK_TOKENS": "many"}, "FEATHER_CHUNK_TOKENS='many'"),
        ({}, {"FEATHER_GATE_OPTIONS": "[1]"}, "expected a JSON object"),
        ({}, {"FEATHER_ORDER_RUNNING": "maybe"}, "expected true or false"),
    ],
)
def test_bad_options_name_themselves(options, environ, message) -> None:
    with pytest.raises(FeatherConfigError, match=message):
        FeatherConfig.from_sources(options, environ=environ)
