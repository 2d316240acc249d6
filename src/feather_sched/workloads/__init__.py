"""Request workloads in token ids: ``spec`` (the types, arrivals, priority classes and
parameter checks), ``synthetic`` (seedable generators), ``traces`` (JSON Lines and
Mooncake traces), ``datasets`` (ShareGPT and BFCL prompt text) and ``options``
(``WorkloadArgs``: the options ``feather bench`` and ``feather sim`` share).

Imports ``models`` (the embedded tokenizer) and ``core.tenants`` (what a tenant id is)
only (an import-linter contract in ``pyproject.toml``, ``tests/test_imports.py``).
"""
