"""Benchmark drivers: ``offline`` (a fresh real vLLM engine per scheduler), ``client`` (an
OpenAI-compatible server), ``serving`` (``feather bench``), ``report`` (vLLM's metrics,
tables, JSON, plots), ``study`` (the benchmark studies' harness) and ``cht``
(``feather cht-bench``: the tree against a radix tree and SGLang's policy).  The top of
the package: it may import anything."""
