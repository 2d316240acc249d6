"""Every relative link in ``benchmarks/**/*.md``, and every ``benchmarks/...`` path in
inline code there, names a file or folder that exists (globs and ``{a,b}`` alternatives:
at least one match each), so a moved result cannot leave a README pointing nowhere."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^\s*```.*?^\s*```", re.DOTALL | re.MULTILINE)
PATH = re.compile(r"(?<![\w./-])benchmarks/[\w./*{},+-]*")


def markdown_files() -> list[Path]:
    return sorted(BENCHMARKS.rglob("*.md"))


def prose(path: Path) -> str:
    """The file without its fenced code blocks (commands, which may name what they write)."""
    return FENCE.sub("", path.read_text())


def alternatives(pattern: str) -> list[str]:
    """``a/{b,c}.json`` -> ``a/b.json``, ``a/c.json`` (nested braces too)."""
    match = re.search(r"\{([^{}]*)\}", pattern)
    if match is None:
        return [pattern]
    return [spelled for option in match[1].split(",")
            for spelled in alternatives(pattern[:match.start()] + option + pattern[match.end():])]


def exists(base: Path, target: str) -> bool:
    """Whether ``target`` (relative to ``base``; a glob or brace pattern allowed) names
    something on disk, each alternative at least once."""
    for spelled in alternatives(target):
        if any(c in spelled for c in "*?["):
            if not any(base.glob(spelled)):
                return False
        elif not (base / spelled).exists():
            return False
    return True


def links(path: Path) -> list[str]:
    targets = []
    for target in LINK.findall(prose(path)):
        target = target.split("#")[0]
        if target and not re.match(r"^[a-z][a-z+.-]*:", target):  # not http:, mailto:
            targets.append(target)
    return targets


def code_paths(path: Path) -> list[str]:
    found = []
    for span in CODE.findall(prose(path)):
        for match in PATH.findall(span):
            found.append(match.rstrip(".,:;"))
    return found


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path: Path) -> None:
    broken = [target for target in links(path) if not exists(path.parent, target)]
    assert not broken, f"{path.relative_to(ROOT)} links to missing {broken}"


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_benchmarks_path_in_code_exists(path: Path) -> None:
    broken = [target for target in code_paths(path) if not exists(ROOT, target)]
    assert not broken, f"{path.relative_to(ROOT)} names missing {broken}"


def test_the_checks_catch_a_missing_target(tmp_path) -> None:
    page = tmp_path / "README.md"
    page.write_text("See [the table](results/x/table.md) and `benchmarks/gone/a.json`, "
                    "[a site](https://example.org), [here](#top).\n"
                    "```sh\ncat benchmarks/written-later.json\n```\n")
    assert links(page) == ["results/x/table.md"]
    assert code_paths(page) == ["benchmarks/gone/a.json"]
    assert not exists(tmp_path, "results/x/table.md")
    (tmp_path / "results" / "x").mkdir(parents=True)
    (tmp_path / "results" / "x" / "table.md").write_text("")
    assert exists(tmp_path, "results/x/table.md") and exists(tmp_path, "results/*/table.md")
    assert not exists(tmp_path, "results/x/{table,other}.md")
    assert alternatives("a/{b,c}-{1,2}.json") == ["a/b-1.json", "a/b-2.json", "a/c-1.json",
                                                 "a/c-2.json"]
