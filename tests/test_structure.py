"""The source's shape: no function in ``src/feather_sched`` over 60 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import feather_sched

MAX_LINES = 60
"""The longest a function may be, its ``def`` line to its last (decorators not counted)."""


def long_functions(root: Path, limit: int = MAX_LINES) -> dict[str, int]:
    """``module.qualified.name`` -> lines, for every function (nested ones too) in the
    Python files under ``root`` longer than ``limit`` lines."""
    found: dict[str, int] = {}
    for path in sorted(root.rglob("*.py")):
        module = ".".join(path.relative_to(root.parent).with_suffix("").parts)
        _visit(ast.parse(path.read_text(), str(path)), module, limit, found)
    return found


def _visit(node: ast.AST, prefix: str, limit: int, found: dict[str, int]) -> None:
    for child in ast.iter_child_nodes(node):
        name = prefix
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            name = f"{prefix}.{child.name}"
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            lines = child.end_lineno - child.lineno + 1
            if lines > limit:
                found[name] = lines
        _visit(child, name, limit, found)


def test_no_function_is_over_60_lines():
    assert long_functions(Path(feather_sched.__file__).parent) == {}


def test_the_count_runs_from_the_def_line_to_the_last(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    body = [f"x{i} = {i}" for i in range(59)]
    source = ["@decorated", "def fits():", *indent(body, 1),  # 60 lines, decorator aside
              "class C:", "    def long(self):", *indent(body, 2),
              "        def inner():", *indent([*body, "return 1"], 3)]
    (package / "mod.py").write_text("\n".join(source) + "\n")
    assert long_functions(package) == {"pkg.mod.C.long": 121, "pkg.mod.C.long.inner": 61}


def indent(lines: list[str], levels: int) -> list[str]:
    return ["    " * levels + line for line in lines]
