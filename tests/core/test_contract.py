"""The runtime contract (``core.contract.RuntimeContract``): ``FeatherRuntime`` has every
member with the contract's signature, and the adapters (``integrations``, the simulator's
policies in ``sim``) use no member of a runtime outside it, nor leave one of it unused.

The adapters hold their runtime as ``RuntimeContract`` (checked here), so mypy (``make
check``, ``[tool.mypy]`` in pyproject.toml) refuses any member outside it, through any
name or chain.  The scan below is the second net, for what mypy cannot see (a runtime
typed ``Any``, as the simulator's policies are): it finds runtime objects by the names
they are bound to, ``runtime`` (a local, or an attribute such as ``self.runtime``) and in
``sim`` also ``policy``; ``core.urgent.make_room`` drives a runtime on vLLM's adapter's
and the simulator's behalf, so its uses count as theirs."""

from __future__ import annotations

import ast
import inspect
import typing
from pathlib import Path

from feather_sched.core import contract
from feather_sched.core.config import FeatherConfig
from feather_sched.core.contract import RuntimeContract
from feather_sched.core.runtime import FeatherRuntime
from tests.core.test_runtime import View

PACKAGE = Path(__file__).parents[2] / "src" / "feather_sched"
BOUND_NAMES = {"integrations": {"runtime"}, "sim": {"runtime", "policy"}}
"""Per adapter package, the names its runtime objects are bound to."""
ON_BEHALF = {"core/urgent.py": ("integrations/vllm", "sim")}
"""Core modules that drive a runtime (bound to ``runtime``) for the adapters named."""
HOLDERS = ("integrations/vllm/scheduler.py", "integrations/sglang/scheduler.py",
           "sim/policies.py")
"""The modules that build a runtime: each holds it as ``RuntimeContract``."""
TYPED_AS_THE_CLASS = {"integrations/vllm/urgent.py"}
"""Owned by another change: still takes ``FeatherRuntime[Request]``, to become
``RuntimeContract[Request]`` there."""


# ---- FeatherRuntime implements the contract ------------------------------------------


def _shape(signature: inspect.Signature) -> tuple:
    """What a caller relies on: each parameter's name, kind, default and annotation."""
    return ([(p.name, p.kind, p.default, p.annotation)
             for p in signature.parameters.values()], signature.return_annotation)


def mismatches(implementation: type, instance: object) -> list[str]:
    """The contract's members ``implementation`` lacks or declares differently
    (``instance``, one of it, shows the parts set in ``__init__``)."""
    found = []
    hints = typing.get_type_hints(RuntimeContract)
    for name in contract.members():
        declared = vars(RuntimeContract).get(name)
        actual = inspect.getattr_static(implementation, name, None)
        if name in hints:
            if not isinstance(getattr(instance, name, None), hints[name]):
                found.append(f"{name}: not a {hints[name].__name__} attribute")
        elif isinstance(declared, property):
            if not isinstance(actual, property) or \
                    _shape(inspect.signature(actual.fget)) != _shape(
                        inspect.signature(declared.fget)):
                found.append(f"{name}: not the property {declared.fget.__annotations__}")
        elif not callable(actual) or \
                _shape(inspect.signature(actual)) != _shape(inspect.signature(declared)):
            found.append(f"{name}: not {name}{inspect.signature(declared)}")
    return found


def runtime() -> FeatherRuntime:
    return FeatherRuntime(FeatherConfig(), View())


def test_feather_runtime_has_every_member_of_the_contract_with_its_signature() -> None:
    assert len(contract.members()) > 30
    assert mismatches(FeatherRuntime, runtime()) == []


def test_a_member_missing_or_declared_otherwise_is_told() -> None:
    class Drifted(FeatherRuntime):
        def decide(self, offered=None, *, again: bool = False):  # another signature
            return None

        counts_service = False  # an attribute where the contract has a property

    drifted = Drifted(FeatherConfig(), View())
    drifted.meter = None  # not the StepMeter the contract declares
    found = mismatches(Drifted, drifted)
    assert [line.split(":")[0] for line in found] == ["decide", "counts_service", "meter"]


# ---- the adapters use the contract and nothing else ----------------------------------


def _bound(node: ast.AST, names: set[str]) -> bool:
    """Whether ``node`` is a runtime object: a name or attribute bound as one."""
    return (isinstance(node, ast.Name) and node.id in names) or \
        (isinstance(node, ast.Attribute) and node.attr in names)


def members_used(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, member) for each use of a runtime's member in ``source``: ``runtime.x``,
    ``len(runtime)`` (``__len__``) and ``x in runtime`` (``__contains__``)."""
    used = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and _bound(node.value, names):
            used.append((node.lineno, node.attr))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id == "len" and node.args and _bound(node.args[0], names):
            used.append((node.lineno, "__len__"))
        elif isinstance(node, ast.Compare) and \
                any(isinstance(op, ast.In | ast.NotIn) for op in node.ops) and \
                any(_bound(right, names) for right in node.comparators):
            used.append((node.lineno, "__contains__"))
    return sorted(used)


def adapter_uses(package: Path = PACKAGE) -> dict[str, list[tuple[int, str]]]:
    """Each adapter module (``integrations/**``, ``sim/**``), and each module of
    ``ON_BEHALF``, with its uses of a runtime."""
    uses = {}
    for adapter, names in BOUND_NAMES.items():
        for path in sorted((package / adapter).rglob("*.py")):
            uses[str(path.relative_to(package))] = members_used(path.read_text(), names)
    for module in ON_BEHALF:
        if (package / module).exists():
            uses[module] = members_used((package / module).read_text(), {"runtime"})
    return uses


def outside_the_contract(uses: dict[str, list[tuple[int, str]]]) -> list[str]:
    allowed = set(contract.members())
    return [f"{path}:{line} {member}" for path, found in uses.items()
            for line, member in found if member not in allowed]


def test_the_adapters_use_no_runtime_member_outside_the_contract() -> None:
    uses = adapter_uses()
    assert outside_the_contract(uses) == [], \
        "an adapter uses a runtime member the contract does not declare: add it to " \
        "core/contract.py with its one-line contract, or use a member it declares"
    by_engine = {engine: {member for path, found in uses.items()
                          if path.startswith(engine) or engine in ON_BEHALF.get(path, ())
                          for _, member in found}
                 for engine in ("integrations/vllm", "integrations/sglang", "sim")}
    assert {engine: len(used) >= 15 for engine, used in by_engine.items()} == \
        dict.fromkeys(by_engine, True), by_engine  # the scan sees each adapter's calls


def test_every_member_of_the_contract_is_used_by_an_adapter() -> None:
    used = {member for found in adapter_uses().values() for _, member in found}
    assert [member for member in contract.members() if member not in used] == []


def test_the_scan_finds_a_member_used_outside_the_contract(tmp_path: Path) -> None:
    planted = tmp_path / "integrations" / "planted.py"
    planted.parent.mkdir()
    planted.write_text(
        "class Adapter:\n"
        "    def step(self, view):\n"
        "        runtime = self.runtime\n"
        "        runtime.begin_pass([])\n"
        "        self.runtime.queue.add(1)\n"
        "        if view in self.feather.runtime and len(runtime):\n"
        "            view.runtime._tracked.clear()\n")
    (tmp_path / "sim").mkdir()
    (tmp_path / "sim" / "planted.py").write_text("def run(policy):\n    policy.view\n")
    assert outside_the_contract(adapter_uses(tmp_path)) == [
        "integrations/planted.py:5 queue", "integrations/planted.py:6 __contains__",
        "integrations/planted.py:7 _tracked", "sim/planted.py:2 view"]


# ---- the adapters hold the runtime as the contract (what mypy checks) ----------------


def annotations_naming(source: str, name: str) -> list[int]:
    """The lines of each annotation in ``source`` (a parameter's, a variable's, a
    return's) that names ``name``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        annotations = []
        if isinstance(node, ast.arg | ast.AnnAssign):
            annotations.append(node.annotation)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            annotations.append(node.returns)
        found += [annotation.lineno for annotation in annotations if annotation is not None
                  and any(isinstance(part, ast.Name) and part.id == name
                          for part in ast.walk(annotation))]
    return sorted(found)


def test_the_adapters_type_the_runtime_as_the_contract_never_as_the_class() -> None:
    typed = {path: annotations_naming((PACKAGE / path).read_text(), "RuntimeContract")
             for path in HOLDERS}
    assert [path for path, lines in typed.items() if not lines] == []
    as_the_class = [f"{path.relative_to(PACKAGE)}:{line}"
                    for adapter in BOUND_NAMES for path in sorted((PACKAGE / adapter).rglob("*.py"))
                    if str(path.relative_to(PACKAGE)) not in TYPED_AS_THE_CLASS
                    for line in annotations_naming(path.read_text(), "FeatherRuntime")]
    assert as_the_class == [], "hold the runtime as RuntimeContract, so that mypy checks its uses"


def test_an_annotation_naming_the_class_is_found() -> None:
    source = ("def f(runtime: FeatherRuntime[R]) -> list[FeatherRuntime]:\n"
              "    held: RuntimeContract[R] = FeatherRuntime()\n")
    assert annotations_naming(source, "FeatherRuntime") == [1, 1]
    assert annotations_naming(source, "RuntimeContract") == [2]
