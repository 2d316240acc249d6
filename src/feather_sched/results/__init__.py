"""What a run observes and what it comes to: ``records`` (``RequestRecord``, ``StepRecord``,
``RunResult``: per request and per engine step, before any statistics) and ``summary``
(vLLM's metrics over a run, and the median-with-range of repeated rounds).  Imported by
the simulator and the benchmarks alike; imports ``telemetry`` and ``workloads`` only."""
