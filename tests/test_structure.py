"""The source's shape: no function in ``src/feather_sched`` over 60 lines, no class over 400."""

from __future__ import annotations

import ast
from pathlib import Path

import feather_sched

MAX_LINES = 60
"""The longest a function may be, its ``def`` line to its last (decorators not counted)."""
MAX_CLASS_LINES = 400
"""The longest a class may be, its ``class`` line to its last: a class past it holds more
than one job's state (split it into rooms, as ``core.runtime`` is)."""


FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def long_functions(root: Path, limit: int = MAX_LINES,
                   kinds: tuple[type, ...] = FUNCTIONS) -> dict[str, int]:
    """``module.qualified.name`` -> lines, for every function (nested ones too; with
    ``kinds`` ``(ast.ClassDef,)``, every class) in the Python files under ``root``
    longer than ``limit`` lines."""
    found: dict[str, int] = {}
    for path in sorted(root.rglob("*.py")):
        module = ".".join(path.relative_to(root.parent).with_suffix("").parts)
        _visit(ast.parse(path.read_text(), str(path)), module, limit, kinds, found)
    return found


def _visit(node: ast.AST, prefix: str, limit: int, kinds: tuple[type, ...],
           found: dict[str, int]) -> None:
    for child in ast.iter_child_nodes(node):
        name = prefix
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            name = f"{prefix}.{child.name}"
        if isinstance(child, kinds):
            lines = child.end_lineno - child.lineno + 1
            if lines > limit:
                found[name] = lines
        _visit(child, name, limit, kinds, found)


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


def test_no_class_is_over_400_lines():
    assert long_functions(Path(feather_sched.__file__).parent, MAX_CLASS_LINES,
                          (ast.ClassDef,)) == {}


def test_a_class_is_counted_whole_and_a_nested_one_on_its_own(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    body = [f"x{i} = {i}" for i in range(398)]
    source = ["class Fits:", *indent(body[1:], 1), "    def method(self):", "        pass",
              "class Long:", *indent(body, 1),
              "    class Inner:", *indent([*body, "y = 0", "z = 0"], 2)]
    (package / "mod.py").write_text("\n".join(source) + "\n")
    assert long_functions(package, MAX_CLASS_LINES, (ast.ClassDef,)) == \
        {"pkg.mod.Long": 800, "pkg.mod.Long.Inner": 401}  # Fits: 400 lines


def indent(lines: list[str], levels: int) -> list[str]:
    return ["    " * levels + line for line in lines]
