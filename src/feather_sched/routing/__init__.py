"""Routing requests over engine replicas by prefix, engine-agnostic (no engine, no Ray):
``prefix_index`` (which replicas hold each chunk key), ``router`` (the base: loads, and
every request finished or returned exactly once), ``feather`` (``FeatherRouter`` and the
approximate index), ``cache_index`` (the precise index the engines' KV events feed) and
``baselines`` (round robin, power of two, Ray's and SGLang's prefix rules; ``ROUTER_CLASSES``
and ``make_router``).

Imports ``core.cht`` only; Ray lives in ``integrations.ray``.
"""
