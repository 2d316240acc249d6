"""What a run observes and what it comes to: ``records`` (``RequestRecord``, ``StepRecord``,
``RunResult``: per request and per engine step, before any statistics) and ``summary``
(vLLM's metrics over a run, and the median-with-range of repeated rounds).  Imported by
the simulator and the benchmarks alike; imports ``telemetry``, ``workloads`` and
``core.tenants`` (the service weights) only (an import-linter contract in
``pyproject.toml``, ``tests/test_imports.py``)."""
