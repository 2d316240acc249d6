"""Admission, engine-agnostic: what Feather decides and keeps, for any engine.

* ``cht`` - the Chunked Hash Tree: chunk keys, waiting and running requests, the best
  candidate; ``prefix`` - the one notion of a prefix group and of a batch's shared tokens;
* ``queue`` - ``FeatherQueue``: the tree's order, the gate, and the bounds on waiting
  (``fairness``) and between tenants (``tenants``); requests WAITING, RUNNING or HELD;
* ``isolation`` - the namespace of a request's prefix keys (what must never be shared);
* ``config`` - ``FeatherConfig``: every option, validated once; ``faults`` -
  ``FaultGuard``: Feather's own exceptions contained;
* ``runtime`` - ``FeatherRuntime``: the one contract vLLM, SGLang and the simulator drive,
  a composition of rooms: ``view`` (``RequestView``, all an adapter implements),
  ``record`` (the requests the engine holds), ``order`` (its running and waiting lists in
  Feather's order), ``ledger`` (this pass's admissions, the steps awaiting reward),
  ``recovery`` (the picture emptied and rebuilt after a fault); ``contract`` -
  ``RuntimeContract``: that contract's members, each with its contract;
* ``urgent`` - urgent preemption, once: the rule (``fewest_victims``), ``make_room`` (the
  protocol vLLM's adapter and the simulator run before their pass), ``Room``, the
  engine's room arithmetic it asks, and ``engine_members``, the check of the
  engine-private members an adapter's replay reads.

This package's exports (``__all__``) are the engine adapters' surface: an adapter imports
``feather_sched.core``, never a module beneath it (``tests/test_imports.py``).  Imports
``gates`` and ``telemetry``; never an engine, the simulator or the benchmarks.
"""

from feather_sched.core.cht import DEFAULT_CHUNK_TOKENS, block_chunk_keys, token_chunk_keys
from feather_sched.core.config import (
    REPLICA_VARIABLE,
    FeatherConfig,
    FeatherConfigError,
    is_true,
)
from feather_sched.core.contract import RuntimeContract
from feather_sched.core.faults import FaultGuard
from feather_sched.core.isolation import SHARED, Isolation, Namespace, engine_keys, token_keys
from feather_sched.core.prefix import describe_batch, keys_per_chunk
from feather_sched.core.queue import Admission, QueueState
from feather_sched.core.runtime import FeatherRuntime, RequestView
from feather_sched.core.tenants import (
    DEFAULT_TENANT,
    TENANT_ARG,
    TENANT_HEADER,
    named_tenant,
    parse_tenant,
)
from feather_sched.core.urgent import Room, engine_members, make_room
from feather_sched.gates.base import Decision
from feather_sched.gates.step_model import EngineShape

__all__ = [
    "DEFAULT_CHUNK_TOKENS",
    "DEFAULT_TENANT",
    "REPLICA_VARIABLE",
    "SHARED",
    "TENANT_ARG",
    "TENANT_HEADER",
    "Admission",
    "Decision",
    "EngineShape",
    "FaultGuard",
    "FeatherConfig",
    "FeatherConfigError",
    "FeatherRuntime",
    "Isolation",
    "Namespace",
    "QueueState",
    "RequestView",
    "Room",
    "RuntimeContract",
    "block_chunk_keys",
    "describe_batch",
    "engine_keys",
    "engine_members",
    "is_true",
    "keys_per_chunk",
    "make_room",
    "named_tenant",
    "parse_tenant",
    "token_chunk_keys",
    "token_keys",
]
