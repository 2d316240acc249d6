"""The documentation against the code (``feather_sched.docs``).

The options page must be what the generator produces from the code now: a new option, a
changed default or docstring fails here until the page is regenerated with
``python -m feather_sched.docs --out docs/options.md``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from feather_sched import docs
from feather_sched.core import config
from feather_sched.core.config import FeatherConfig, FeatherConfigError
from feather_sched.gates import GATE_KINDS, make_gate

ROOT = Path(__file__).parents[1]
DOCS = ROOT / "docs"
REGENERATE = "python -m feather_sched.docs --out docs/options.md"


def text(path: Path) -> str:
    return path.read_text()


# ---- the generated options page ------------------------------------------------------


def test_the_committed_options_page_is_what_the_code_produces_now() -> None:
    assert text(DOCS / "options.md") == docs.options_page(), \
        f"docs/options.md is stale: regenerate it with `{REGENERATE}`"


def sections(page: str) -> dict[str, str]:
    """The options page's ``## `name``` sections, by option name."""
    parts = re.split(r"^## `(\w+)`$", page, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_every_option_has_its_section_with_its_description() -> None:
    found = sections(docs.options_page())
    assert list(found) == list(config.VALIDATORS)
    described = docs.attribute_docstrings(FeatherConfig)
    for name, section in found.items():
        assert docs.markdown(described[name]) in section
        assert f"`{docs.option_variable(name)}`" in section


def test_each_documented_variable_is_the_one_feather_reads() -> None:
    for name in config.VALIDATORS:
        variable = docs.option_variable(name)
        with pytest.raises(FeatherConfigError, match=f"^{variable}="):
            FeatherConfig.option(name, None, {variable: "\0"})  # no option accepts it


def test_each_documented_default_is_the_configs_and_passes_its_validator() -> None:
    defaults = FeatherConfig()
    for name, section in sections(docs.options_page()).items():
        shown = re.search(r"^- \*\*Default:\*\* `(.*)`$", section, flags=re.MULTILINE)
        assert shown, name
        value = getattr(defaults, name)
        assert json.loads(shown.group(1)) == value, name
        assert config.VALIDATORS[name](value) == value, name


def test_an_option_without_a_docstring_fails_the_generator(monkeypatch) -> None:
    monkeypatch.setitem(config.VALIDATORS, "undocumented", lambda value: value)
    with pytest.raises(ValueError, match="undocumented"):
        docs.options_page()


def test_every_gate_option_listed_is_one_its_gate_takes_with_that_default() -> None:
    assert set(docs.GATE_FACTORIES) == set(GATE_KINDS)
    for kind in GATE_KINDS:
        listed = docs.gate_options(kind)
        built = make_gate(kind, **dict(listed))
        plain = make_gate(kind)
        assert type(built) is type(plain)
        for name, default in listed:
            if hasattr(plain, name):
                assert getattr(plain, name) == default, (kind, name)
    assert docs.gate_options("always") == []
    with pytest.raises(ValueError):
        make_gate("always", max_loss=1)  # "No options." is true
    assert dict(docs.gate_options("chunk-loss"))["max_loss"] == 5


def test_the_generator_runs_as_one_command(tmp_path) -> None:
    out = tmp_path / "options.md"
    docs.main(["--out", str(out)])
    assert text(out) == docs.options_page()
