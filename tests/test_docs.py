"""The documentation against the code (``feather_sched.docs`` and the pages in ``docs/``).

The options page must be what the generator produces from the code now: a new option, a
changed default or docstring fails here until the page is regenerated with
``python -m feather_sched.docs --out docs/options.md`` (or ``make docs``); so does
docs/architecture.md's table of the runtime contract (``core.contract``).  Every path and
``feather_sched`` module the README and the pages in ``docs/`` name must exist, the package
map and the metrics page must name everything there is, and the README keeps its shape.
Links between pages and their anchors are checked by ``mkdocs build --strict``, which
``make test`` runs.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from feather_sched import docs
from feather_sched.core import config, contract
from feather_sched.core.config import FeatherConfig, FeatherConfigError
from feather_sched.gates import GATE_KINDS, make_gate
from feather_sched.telemetry import prometheus, steplog
from feather_sched.telemetry.stats import AdmissionCounts, SchedulerStats

ROOT = Path(__file__).parents[1]
SRC = ROOT / "src"
DOCS = ROOT / "docs"
README = ROOT / "README.md"
PAGES = [README, *sorted(DOCS.rglob("*.md"))]
REGENERATE = "python -m feather_sched.docs --out docs/options.md --contract docs/architecture.md"


def text(path: Path) -> str:
    return path.read_text()


# ---- the generated options page ------------------------------------------------------


def test_the_committed_options_page_is_what_the_code_produces_now() -> None:
    assert text(DOCS / "options.md") == docs.options_page(), \
        f"docs/options.md is stale: regenerate it with `{REGENERATE}` (or `make docs`)"


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
    out, page = tmp_path / "options.md", tmp_path / "architecture.md"
    page.write_text(f"before\n{docs.CONTRACT_BEGIN}\nstale\n{docs.CONTRACT_END}\nafter\n")
    docs.main(["--out", str(out), "--contract", str(page)])
    assert text(out) == docs.options_page()
    assert text(page) == f"before\n{docs.contract_table()}\nafter\n"


# ---- the generated contract table ----------------------------------------------------


def test_the_committed_contract_table_is_what_the_contract_says_now() -> None:
    page = text(DOCS / "architecture.md")
    assert page == docs.with_contract(page), \
        f"docs/architecture.md's contract table is stale: regenerate it with `{REGENERATE}`"


def test_the_contract_table_has_a_row_per_member_with_its_docstring() -> None:
    table = docs.contract_table()
    rows = [row for row in table.splitlines() if row.startswith("| `")]
    assert len(rows) == len(contract.members())
    assert "| `begin_pass(running, waiting=None, held=())` | A pass starts" in table
    assert "| `len(runtime)` | Requests waiting in Feather's queue. |" in table
    assert "| `counts` | The admission decisions counted so far (read only). |" in table
    with pytest.raises(ValueError, match="no generated contract table"):
        docs.with_contract("a page without the markers")


# ---- paths and modules the pages name ------------------------------------------------

PATH = re.compile(r"(?<![\w./~-])((?:src|tests|scripts|benchmarks|requirements|docs|\.ci)/"
                  r"[\w./*{},-]*)")
MODULE = re.compile(r"\bfeather_sched(?:[.:]\w+)+")
DEFINED = (r"^\s*(?:def|class)\s+{name}\b|^\s*{name}\s*[:=]|^\s*(?:from\s.*)?import\s.*\b{name}\b"
           r"|[\"']{name}[\"']")
"""How a module defines a name: a def, a class, an assignment, an import, or the string a
lazy ``__getattr__`` answers to."""


def path_exists(path: str) -> bool:
    """Whether a repository path the docs name exists; under ``benchmarks/`` only its study
    folder is checked (result files move between runs' folders)."""
    path = path.rstrip(".,:;)")
    parts = path.split("/")
    if parts[0] == "benchmarks":
        return (ROOT / "benchmarks" / (parts[1] if len(parts) > 1 else "")).is_dir()
    if any(c in path for c in "*{"):
        pattern = re.sub(r"\{[^}]*\}", "*", path)
        return any(ROOT.glob(pattern))
    return (ROOT / path).exists()


def module_exists(dotted: str) -> bool:
    """Whether ``feather_sched.a.b.Name`` (or ``...:name``) names a module of the package
    and, past the module, names its source defines or mentions."""
    parts = re.split(r"[.:]", dotted)
    path, rest = SRC / parts[0], parts[1:]
    while rest:
        if (path / rest[0] / "__init__.py").is_file():
            path, rest = path / rest[0], rest[1:]
        elif (path / f"{rest[0]}.py").is_file():
            path, rest = path / f"{rest[0]}.py", rest[1:]
            break
        else:
            break
    module = path / "__init__.py" if path.is_dir() else path
    source = text(module)
    return all(re.search(DEFINED.format(name=re.escape(name)), source, flags=re.MULTILINE)
               for name in rest)


def test_the_checks_tell_a_moved_path_or_module() -> None:
    assert path_exists("src/feather_sched/core/config.py")
    assert path_exists("benchmarks/vllm/some-result-moved-into-a-run-folder.json")
    assert not path_exists("benchmarks/no-such-study/")
    assert not path_exists("src/feather_sched/runtime.py")
    assert module_exists("feather_sched.core.runtime.FeatherRuntime")
    assert module_exists("feather_sched.integrations.vllm.FeatherScheduler")
    assert module_exists("feather_sched.integrations.sglang:register")
    assert not module_exists("feather_sched.runtime")  # before the reorganisation
    assert not module_exists("feather_sched.core.runtime.NoSuchName")


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_path_and_module_a_page_names_exists(page: Path) -> None:
    content = text(page)
    missing = [path for path in PATH.findall(content) if not path_exists(path)]
    assert not missing, f"{page.name} names paths that do not exist: {missing}"
    unknown = [name for name in MODULE.findall(content) if not module_exists(name)]
    assert not unknown, f"{page.name} names modules that do not exist: {unknown}"


def test_the_readme_links_only_to_what_exists() -> None:
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text(README))
    relative = [target for target in targets if "://" not in target]
    assert relative
    assert [target for target in relative if not (ROOT / target).exists()] == []


# ---- pages that must name everything there is ----------------------------------------


def test_the_package_map_names_every_subpackage_and_module() -> None:
    page = text(DOCS / "architecture.md")
    package = SRC / "feather_sched"
    mapped = re.findall(r"``(\w+)``", (package / "__init__.py").read_text())
    assert mapped and all(f"`{name}`" in page for name in mapped)
    for entry in sorted(package.iterdir()):
        name = entry.stem
        if name.startswith("_") or not (entry.suffix == ".py" or
                                        (entry / "__init__.py").is_file()):
            continue
        assert f"`{name}`" in page or f"feather_sched.{name}" in page, name
        if entry.is_dir():
            for inner in sorted(entry.iterdir()):
                if inner.stem.startswith("_") or not (inner.suffix == ".py" or
                                                      (inner / "__init__.py").is_file()):
                    continue
                assert re.search(rf"[`.]{inner.stem}\b", page), f"{name}.{inner.stem}"


def exported_names() -> list[str]:
    """Each ``feather:`` metric as a server exports it (a counter with ``_total``)."""
    metrics = prometheus._registered()
    names = []
    for field in dataclasses.fields(metrics):
        metric = getattr(metrics, field.name)
        (family,) = metric.describe()
        names.append(family.name + ("_total" if family.type == "counter" else ""))
    return names


def test_the_metrics_page_names_every_series_stats_field_and_step_log_column() -> None:
    page = text(DOCS / "metrics.md")
    names = exported_names()
    assert "feather:gate_decisions_total" in names
    assert [name for name in names if f"`{name}`" not in page] == []
    fields = [f.name for f in dataclasses.fields(SchedulerStats)] + \
        [f.name for f in dataclasses.fields(AdmissionCounts)]
    assert [name for name in fields if f"`{name}`" not in page] == []
    assert steplog.header().strip() in page


# ---- make test builds the site ------------------------------------------------------


def makefile_targets() -> dict[str, list[str]]:
    targets: dict[str, list[str]] = {}
    current = None
    for line in text(ROOT / "Makefile").splitlines():
        if match := re.match(r"^([\w-]+):", line):
            current = match.group(1)
            targets[current] = []
        elif line.startswith("\t") and current:
            targets[current].append(line.strip())
    return targets


def test_make_test_builds_the_site_in_strict_mode_without_hiding_warnings() -> None:
    build = [line for line in makefile_targets()["test"] if "mkdocs" in line or
             "MKDOCS" in line]
    assert build and "build --strict" in build[0]
    assert "--quiet" not in build[0] and "-q" not in build[0].split()  # hides the warnings


# ---- the README's shape ------------------------------------------------------------


def test_the_readme_is_short_and_opens_with_the_two_commands() -> None:
    lines = text(README).splitlines()
    assert len(lines) <= 150
    assert lines[3].startswith("make run    # ") and lines[4].startswith("make test   # ")
    targets = makefile_targets()
    named = set(re.findall(r"`make ([\w-]+)`", text(README))) | {"run", "test"}
    assert named <= set(targets), named - set(targets)


def test_the_readmes_set_up_line_is_what_make_test_runs() -> None:
    setup = makefile_targets()["test"][0]
    assert setup.startswith("scripts/setup.sh")
    assert f"`{setup}`" in text(README)
    assert f"`{setup}`" in text(DOCS / "development.md")
