"""The engine adapters: ``vllm``, ``sglang`` and ``ray`` (Ray Serve), and ``asgi`` (request
bodies in their servers' middlewares).  Each translates its engine's types for the core's
public surface (``feather_sched.core``); the logic lives once, in the core.  Only here
does Feather import an engine."""
