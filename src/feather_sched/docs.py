"""Reference pages generated from the code, so that they cannot drift from it.

``options_page()`` is ``docs/options.md``: every Feather option in the order of
``core.config.VALIDATORS``, with what its validator accepts (its own error message), its
default and Python type (the ``FeatherConfig`` field), its ``FEATHER_*`` environment
variable and its description (the field's docstring); then each gate's keyword options
(``gate_options``), read from the signature of the class ``make_gate`` builds.
``contract_table()`` is the runtime contract's table in ``docs/architecture.md``, between
``CONTRACT_BEGIN`` and ``CONTRACT_END``: each member of ``core.contract.RuntimeContract``
with its docstring.

Regenerate both with ``make docs``; ``tests/test_docs.py`` fails while a committed page
differs from what this produces.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from feather_sched.core import config, contract
from feather_sched.gates import GATE_KINDS
from feather_sched.gates.bandit import UCBBanditGate
from feather_sched.gates.heuristic import ChunkLossGate
from feather_sched.gates.model import ModelGate

GATE_FACTORIES: dict[str, Callable[..., Any] | None] = {
    "always": None,
    "chunk-loss": ChunkLossGate,
    "bandit": UCBBanditGate,
    "model": ModelGate.with_prior,
}
"""What ``gates.make_gate`` builds for each kind from ``gate_options`` (None: no options)."""

_PROBES = (-1, object())
"""Values every validator refuses with the message that says what it accepts: ``-1``
first (a number refused for its range says which numbers), then a value of no type."""


def option_variable(name: str) -> str:
    """The environment variable that sets option ``name`` (``FEATHER_`` + its name)."""
    return config.ENV_PREFIX + name.upper()


def accepted(name: str) -> str:
    """What option ``name``'s validator accepts, in its own words ("a positive integer")."""
    validator = config.VALIDATORS[name]
    for probe in _PROBES:
        try:
            validator(probe)
        except (ValueError, TypeError, ArithmeticError) as error:
            words = str(error).removeprefix("must be ")
            break
    else:
        raise ValueError(f"option {name!r}: its validator refuses none of {_PROBES!r}")
    try:
        takes_null = validator(None) is None
    except (ValueError, TypeError, ArithmeticError):
        takes_null = False
    if takes_null and '"off"' not in words:
        words += ", or null"
    return words


def attribute_docstrings(source: Any) -> dict[str, str]:
    """The docstrings under the top-level assignments of a module or class (the string
    literal after each one), read from its source."""
    tree = ast.parse(inspect.getsource(source))
    body = tree.body[0].body if inspect.isclass(source) else tree.body  # type: ignore
    docs = {}
    for statement, following in itertools.pairwise(body):
        targets = statement.targets if isinstance(statement, ast.Assign) else \
            [statement.target] if isinstance(statement, ast.AnnAssign) else []
        if (len(targets) == 1 and isinstance(targets[0], ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[targets[0].id] = inspect.cleandoc(following.value.value)
    return docs


def markdown(docstring: str) -> str:
    """A docstring's reStructuredText literals (````x````) as Markdown code spans."""
    return docstring.replace("``", "`")


def default_of(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    raise ValueError(f"option {field.name!r} has no default")


def as_json(value: Any) -> str:
    return json.dumps(value)


def _is_option_value(value: Any) -> bool:
    """Whether a default could be given in JSON (a gate's table is not an option)."""
    return value is None or isinstance(value, bool | int | float | str)


def gate_options(kind: str) -> list[tuple[str, Any]]:
    """Gate ``kind``'s keyword options and their defaults, from its factory's signature."""
    factory = GATE_FACTORIES[kind]
    if factory is None:
        return []
    return [(name, parameter.default)
            for name, parameter in inspect.signature(factory).parameters.items()
            if parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)
            and parameter.default is not parameter.empty
            and _is_option_value(parameter.default)]


def _joined(text: str) -> str:
    """Text on one line, as Markdown."""
    return markdown(" ".join(text.split()))


def _summary(doc: str | None) -> str:
    """A docstring's first paragraph, on one line."""
    return _joined(inspect.cleandoc(doc).split("\n\n")[0]) if doc else ""


def options_page() -> str:
    """``docs/options.md``, from ``core/config.py`` and the gates."""
    fields, docs = _documented_options()
    lines = [*_options_table(fields), *_option_sections(fields, docs), *_gate_sections()]
    page = "\n".join(lines)
    return re.sub(r"[ \t]+$", "", page, flags=re.MULTILINE)


def _documented_options() -> tuple[dict[str, dataclasses.Field], dict[str, str]]:
    """``FeatherConfig``'s fields and attribute docstrings by name, checked: every option
    has both, and every gate kind a factory."""
    fields = {f.name: f for f in dataclasses.fields(config.FeatherConfig)}
    docs = attribute_docstrings(config.FeatherConfig)
    missing = [name for name in config.VALIDATORS if name not in fields or name not in docs]
    if missing:
        raise ValueError(f"options without a FeatherConfig field and docstring: {missing}")
    if set(GATE_FACTORIES) != set(GATE_KINDS):
        raise ValueError(f"GATE_FACTORIES {sorted(GATE_FACTORIES)} is not GATE_KINDS "
                         f"{sorted(GATE_KINDS)}")
    return fields, docs


def _options_table(fields: dict[str, dataclasses.Field]) -> list[str]:
    """The page's head: the generated-file notice, ``config``'s docstring, how "off" and
    booleans are spelled, and the table of every option."""
    lines = [
        "<!-- Generated by `python -m feather_sched.docs --out docs/options.md` (or `make "
        "docs`) from src/feather_sched/core/config.py and the gates: do not edit by hand; "
        "tests/test_docs.py fails while this page differs from what the code produces. -->",
        "",
        "# Options",
        "",
        markdown(inspect.cleandoc(config.__doc__ or "")),
        "",
        "A bound that can be turned off takes `\"off\"`, spelled "
        + ", ".join(f"`{word}`" for word in config.OFF)
        + " (or JSON `null`); a boolean also takes "
        + ", ".join(f"`{word}`" for word in config.TRUE + config.FALSE)
        + " (case-insensitive), the way an environment variable spells it.",
        "",
        "| option | environment variable | default | accepts |",
        "|---|---|---|---|",
    ]
    for name in config.VALIDATORS:
        lines.append(f"| [`{name}`](#{name}) | `{option_variable(name)}` | "
                     f"`{as_json(default_of(fields[name]))}` | {accepted(name)} |")
    return lines


def _option_sections(fields: dict[str, dataclasses.Field], docs: dict[str, str]) -> list[str]:
    """One section per option (its docstring, what it accepts, default, variable and type),
    then the other variables."""
    lines: list[str] = []
    for name in config.VALIDATORS:
        lines += [
            "",
            f"## `{name}`",
            "",
            markdown(docs[name]),
            "",
            f"- **Accepts:** {accepted(name)}",
            f"- **Default:** `{as_json(default_of(fields[name]))}`",
            f"- **Environment variable:** `{option_variable(name)}`",
            f"- **Python type:** `{fields[name].type}`",
        ]
    variables = attribute_docstrings(config)
    return [*lines, "", "## Other variables", "",
            f"- `{config.REPLICA_VARIABLE}`: {_joined(variables['REPLICA_VARIABLE'])}"]


def _gate_sections() -> list[str]:
    """Each gate's keyword options (``gate_options``) with their defaults."""
    lines = [
        "",
        "## Gate options",
        "",
        "`gate_options` holds the chosen gate's keyword options "
        "(`feather_sched.gates.make_gate`); an unknown one fails start-up.",
    ]
    for kind in GATE_KINDS:
        factory = GATE_FACTORIES[kind]
        owner = factory.__self__ if inspect.ismethod(factory) else factory
        lines += ["", f"### `{kind}`", ""]
        if factory is None:
            lines.append("No options.")
            continue
        lines += [f"{_summary(owner.__doc__)} (`{owner.__module__}.{owner.__qualname__}`)",
                  "", "| option | default |", "|---|---|"]
        lines += [f"| `{name}` | `{as_json(value)}` |" for name, value in gate_options(kind)]
    return [*lines,
            "",
            "The model gate's `layout` is the batch layout `order_running` asks for "
            "(`FeatherConfig.batch_layout`), and the engine's where the adapter finds that "
            "ordering cannot act there.",
            ""]


CONTRACT_BEGIN = ("<!-- The table is generated from src/feather_sched/core/contract.py by "
                  "`python -m feather_sched.docs --contract docs/architecture.md` (or `make "
                  "docs`): do not edit it by hand; tests/test_docs.py fails while it is "
                  "stale. -->")
CONTRACT_END = "<!-- End of the generated table. -->"


def _call(name: str) -> str:
    """How an adapter spells a use of member ``name``: ``begin_pass(running, ...)``."""
    member = inspect.getattr_static(contract.RuntimeContract, name, None)
    if member is None or isinstance(member, property):
        return f"`{name}`"
    parameters = list(inspect.signature(member).parameters.values())[1:]
    bare = inspect.Signature([p.replace(annotation=p.empty) for p in parameters])
    return "`len(runtime)`" if name == "__len__" else f"`{name}{bare}`"


def contract_table() -> str:
    """The runtime contract as a Markdown table, between its two markers."""
    docs = attribute_docstrings(contract.RuntimeContract)
    lines = [CONTRACT_BEGIN, "", "| member | contract |", "|---|---|"]
    for name in contract.members():
        member = inspect.getattr_static(contract.RuntimeContract, name, None)
        doc = docs[name] if member is None else inspect.getdoc(member)
        if not doc:
            raise ValueError(f"RuntimeContract.{name} has no docstring")
        lines.append(f"| {_call(name)} | {_joined(doc)} |")
    return "\n".join([*lines, "", CONTRACT_END])


def with_contract(page: str) -> str:
    """``page`` with the text between the contract's markers replaced by the table."""
    begin, end = page.find(CONTRACT_BEGIN), page.find(CONTRACT_END)
    if begin < 0 or end < begin:
        raise ValueError("the page has no generated contract table (its markers: "
                         f"{CONTRACT_BEGIN!r} ... {CONTRACT_END!r})")
    return page[:begin] + contract_table() + page[end + len(CONTRACT_END):]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m feather_sched.docs",
        description="Print the generated options page (docs/options.md).")
    parser.add_argument("--out", type=Path, help="write the page here instead of stdout")
    parser.add_argument("--contract", type=Path, metavar="PAGE",
                        help="also regenerate the runtime contract's table in PAGE "
                             "(docs/architecture.md)")
    arguments = parser.parse_args(argv)
    if arguments.contract is not None:
        arguments.contract.write_text(with_contract(arguments.contract.read_text()))
    page = options_page()
    if arguments.out is None:
        sys.stdout.write(page)
    else:
        arguments.out.write_text(page)


if __name__ == "__main__":
    main()
