"""Hypothesis strategies shared by tests: JSON documents, valid ones made a little wrong."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
"""Any JSON value, NaN and infinities included (Python's json writes and reads them)."""


def or_any(valid: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly ``valid``, sometimes any JSON value in its place."""
    return st.one_of(valid, valid, valid, JSON_VALUES)


@st.composite
def fields_or_any(draw: st.DrawFn, fields: dict[str, st.SearchStrategy]) -> dict[str, Any]:
    """A JSON object of ``fields``, each value perhaps replaced (``or_any``), one field
    perhaps missing and an unknown one perhaps added."""
    data = {name: draw(or_any(value)) for name, value in fields.items()}
    if draw(st.integers(0, 7)) == 0:
        del data[draw(st.sampled_from(sorted(data)))]
    if draw(st.integers(0, 7)) == 0:
        data["unknown"] = draw(JSON_VALUES)
    return data


def documents(valid: st.SearchStrategy) -> st.SearchStrategy[bytes]:
    """File contents: a document from ``valid`` written as JSON, any JSON value, or any
    bytes."""
    def dumped(value: Any) -> bytes:
        return json.dumps(value).encode()

    return st.one_of(valid.map(dumped), valid.map(dumped), JSON_VALUES.map(dumped),
                     st.binary(max_size=64))
