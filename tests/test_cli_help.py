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
