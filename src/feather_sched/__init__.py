"""feather-sched: a prefix-aware request scheduler for LLM inference engines.

The package map, bottom up; each layer imports only the layers above it in this list
(checked by ``tests/test_imports.py``):

* ``telemetry`` - what Feather measures and how it writes files: scheduler stats and the
  meter, the step log, Prometheus series, atomic file writes.
* ``models``, ``costmodel``, ``attention`` - the embedded model configs; the step-cost
  model (hardware and model profiles, calibration); shared-prefix decode attention (the
  plan and the kernels), engine-agnostic.
* ``gates`` - the ADD/STOP gates: the protocol, the registry, each gate, the step model.
* ``core`` - admission, engine-agnostic: the Chunked Hash Tree, prefix groups, the queue
  and its waiting bounds, options, fault containment and ``FeatherRuntime``, the one
  contract every engine drives (``core``'s package exports are the adapters' surface).
* ``workloads``, ``routing``, ``results``, ``scheduler_names`` - workload types,
  generators, traces, datasets and options; routing over replicas; what a run records;
  the scheduler names a comparison run takes.
* ``sim`` - the serving simulator, driving the same runtime; never an engine.
* ``integrations`` - ``vllm``, ``sglang``, ``ray``: the adapters, which translate types and
  replay the engine's own arithmetic (KV blocks, who may be preempted); the rules live in
  ``core``.
* ``bench``, ``cli``, ``serve``, ``docs`` - the benchmark drivers, the ``feather`` command,
  and the generator of the documentation's reference pages (``docs/options.md``).

Nothing below ``integrations`` imports an engine (vLLM, SGLang, Ray).
"""

__version__ = "0.1.0"
