"""Every ``feather`` command's help reads whole in an 80-column terminal."""

from __future__ import annotations

import re

import pytest
import typer
from typer.testing import CliRunner

from feather_sched.cli import app

GROUP = typer.main.get_command(app)


@pytest.mark.parametrize("command", [None, *GROUP.commands])
def test_help_fits_80_columns_with_every_option_name_whole(command: str | None) -> None:
    args = ["--help"] if command is None else [command, "--help"]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "80"}, terminal_width=80)
    assert result.exit_code == 0, result.output
    assert max(len(line) for line in result.output.splitlines()) <= 80
    assert "…" not in result.output
    params = GROUP.params if command is None else GROUP.commands[command].params
    for name in (n for p in params for n in p.opts + p.secondary_opts if n.startswith("-")):
        assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", result.output), name


def test_bench_and_sim_take_every_workload_option_with_the_same_help() -> None:
    """Each field of WorkloadArgs is one option of both commands, same name, same help and
    same checks; only the defaults of the generator's size differ (sim: the paper's 8 x 64
    of 4K-token prefixes)."""
    from dataclasses import fields

    from feather_sched.workloads.options import WorkloadArgs

    def options(command: str) -> dict:
        return {p.name: p for p in GROUP.commands[command].params}

    bench, sim = options("bench"), options("sim")
    names = [f.name for f in fields(WorkloadArgs)]
    for name in names:
        assert bench[name].opts == sim[name].opts
        assert bench[name].help == sim[name].help and bench[name].help
        assert (bench[name].type_descriptor.annotation, bench[name].min, bench[name].max) == (
            sim[name].type_descriptor.annotation, sim[name].min, sim[name].max)
    assert bench["kind"].opts == ["--workload"]
    defaults = {name: (bench[name].default, sim[name].default) for name in names
                if bench[name].default != sim[name].default}
    assert defaults == {"groups": (4, 8), "prompts_per_group": (16, 64),
                        "prefix_len": (8192, 4096), "output_len": (64, 50)}
    assert {f.name: f.default for f in fields(WorkloadArgs)} == {
        name: bench[name].default for name in names}


def test_a_bad_report_option_is_a_usage_error_before_any_run() -> None:
    from typer.testing import CliRunner

    for command in ("bench", "sim"):
        result = CliRunner().invoke(app, [command, "--metric-percentiles", "100"],
                                    env={"COLUMNS": "200"})
        assert result.exit_code == 2 and "--metric-percentiles" in result.output


def test_routing_keys_without_a_server_are_a_usage_error_before_any_run() -> None:
    from typer.testing import CliRunner

    result = CliRunner().invoke(app, ["bench", "--routing-keys"], env={"COLUMNS": "200"})
    assert result.exit_code == 2 and "--routing-keys is sent to a server" in result.output
