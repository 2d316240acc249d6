"""Namespaces of prefix keys: plain requests keep their keys, any boundary or isolated
tenant moves them apart, and the same namespace gives the same keys in every process."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from feather_sched.core.cht import token_chunk_keys
from feather_sched.core.isolation import (
    SHARED,
    Isolation,
    Namespace,
    engine_keys,
    token_keys,
)

PROMPT = np.arange(1000, dtype=np.int32)


def test_plain_requests_keep_their_keys_and_a_boundary_moves_every_key() -> None:
    plain = token_keys(PROMPT, 128)
    assert plain == token_chunk_keys(PROMPT, 128) and Namespace().seed == 0
    salted = [token_keys(PROMPT, 128, Namespace((("cache_salt", s),))) for s in "ab"]
    assert salted[0] == token_keys(PROMPT, 128, Namespace((("cache_salt", "a"),)))
    for one, other in [(plain, salted[0]), (salted[0], salted[1])]:
        assert not set(one) & set(other)  # not even a first chunk in common
    assert engine_keys([1, 2], SHARED) == [1, 2]
    tenant = Namespace(tenant="acme")
    assert engine_keys([1, 2], tenant) == [(tenant.seed, 1), (tenant.seed, 2)]
    assert Namespace((("cache_salt", "a"),), "acme").beyond_engine() == tenant


def test_tenants_are_namespaces_only_when_isolated_and_named() -> None:
    salt = [("cache_salt", "a"), None]
    assert Isolation().namespace(salt, lambda: "acme") == Namespace((("cache_salt", "a"),))
    isolated = Isolation(isolate_tenants=True)
    assert isolated.namespace((), lambda: "acme") == Namespace(tenant="acme")
    assert isolated.namespace((), lambda: "default") == SHARED  # the unnamed requests
    asked: list[str] = []
    Isolation().namespace((), lambda: asked.append("tenant") or "acme")
    assert not asked  # the tenant is not read where tenants are not isolated


def test_a_namespace_seeds_the_same_in_another_process() -> None:
    code = ("from feather_sched.core.isolation import Namespace; "
            "print(Namespace((('lora', 'a', '/p'),), 'acme').seed)")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, env={**os.environ, "PYTHONHASHSEED": "7"})
    assert int(other.stdout) == Namespace((("lora", "a", "/p"),), "acme").seed


def test_a_namespace_is_made_of_primitives_only() -> None:
    """An object's ``repr`` may hold its address, which would make the seed per process
    (the router's and the engine's namespaces would then never meet)."""
    import enum

    class Kind(enum.StrEnum):
        LORA = "lora"

    assert Namespace((("mm", "f00d", 3), ("salt", b"x", 1.5, True, None)), "acme").seed
    for part in (object(), Kind.LORA, ["lora"], ("lora", {"a": 1})):
        with pytest.raises(TypeError, match="a namespace is made of"):
            Namespace((part,))
    with pytest.raises(TypeError):
        Isolation(isolate_tenants=True).namespace((), lambda: object())
