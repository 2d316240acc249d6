"""The engine adapters: ``vllm``, ``sglang`` and ``ray`` (Ray Serve), and ``asgi`` (request
bodies in their servers' middlewares).  Each translates its engine's types for the core's
public surface (``feather_sched.core``) and replays the engine's own arithmetic where
Feather needs it (how many KV blocks a request takes, who may be preempted); the rules
live once, in the core.  Only here
does Feather import an engine."""
