"""The source's shape: no function in ``src/feather_sched`` over 60 lines, no class over
400, no docstring over 15 (a package's overview in its ``__init__`` excepted)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import feather_sched

MAX_LINES = 60
"""The longest a function may be, its ``def`` line to its last (decorators not counted)."""
MAX_CLASS_LINES = 400
"""The longest a class may be, its ``class`` line to its last: a class past it holds more
than one job's state (split it into rooms, as ``core.runtime`` is)."""


MAX_DOCSTRING_LINES = 15
"""The longest a docstring may be: what a thing does, its contract and its cost (proofs
go to ``docs/``, history to commit messages)."""

Definition = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def modules(root: Path) -> Iterator[tuple[Path, str, ast.Module]]:
    """Each Python file under ``root``: its path, its module name, its syntax tree."""
    for path in sorted(root.rglob("*.py")):
        module = ".".join(path.relative_to(root.parent).with_suffix("").parts)
        yield path, module, ast.parse(path.read_text(), str(path))


def definitions(node: ast.AST, prefix: str) -> Iterator[tuple[str, Definition]]:
    """Every function and class under ``node`` (nested ones too), by qualified name."""
    for child in ast.iter_child_nodes(node):
        name = prefix
        if isinstance(child, Definition):
            name = f"{prefix}.{child.name}"
            yield name, child
        yield from definitions(child, name)


def long_functions(root: Path, limit: int = MAX_LINES,
                   kinds: tuple[type, ...] = FUNCTIONS) -> dict[str, int]:
    """``module.qualified.name`` -> lines, for every function (nested ones too; with
    ``kinds`` ``(ast.ClassDef,)``, every class) in the Python files under ``root``
    longer than ``limit`` lines."""
    return {name: lines for _, module, tree in modules(root)
            for name, node in definitions(tree, module)
            if isinstance(node, kinds) and (lines := node.end_lineno - node.lineno + 1) > limit}


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


def long_docstrings(root: Path, limit: int = MAX_DOCSTRING_LINES) -> dict[str, int]:
    """``module[.qualified.name]`` -> lines, for every docstring (a module's, a class's,
    a function's) in the Python files under ``root`` longer than ``limit`` lines, but a
    package's own (its ``__init__``'s module docstring: the package's overview)."""
    found = {}
    for path, module, tree in modules(root):
        named = [(module, tree)] if path.name != "__init__.py" else []
        for name, node in [*named, *definitions(tree, module)]:
            lines = docstring_lines(node)
            if lines > limit:
                found[name] = lines
    return found


def docstring_lines(node: ast.Module | Definition) -> int:
    """The lines of ``node``'s docstring, its quotes included (0: none)."""
    first = node.body[0] if node.body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and \
            isinstance(first.value.value, str):
        return first.end_lineno - first.lineno + 1
    return 0


def test_no_docstring_is_over_15_lines() -> None:
    assert long_docstrings(Path(feather_sched.__file__).parent) == {}


def test_docstrings_are_counted_but_a_packages_overview(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    long = '"""' + "\n" * 15 + '"""'  # 16 lines
    (package / "__init__.py").write_text(f"{long}\n")
    (package / "mod.py").write_text(
        f"{long}\nclass C:\n    {long}\n    def f(self):\n        'One line.'\n"
        f"def g():\n    x = 1\n    {long}\n")
    assert long_docstrings(package) == {"pkg.mod": 16, "pkg.mod.C": 16}
