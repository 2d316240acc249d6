"""Feather's options, read and checked the same way by every engine adapter.

Options come from the engine's own configuration channel when it reaches the scheduler
(vLLM: ``--additional-config '{"feather": {...}}'``), else from ``FEATHER_*`` environment
variables, else defaults.  Every value goes through one validator per option, whichever
source it came from, so a typo or a wrong type fails start-up with a message naming the
option (``feather serve`` runs the same check before the engine starts).  Each file
Feather will write must be a writable file in an existing directory; a saved bandit
table must load.

Several scheduler processes (data-parallel ranks, replicas) each write their own files
(``Placement``): a file option may hold ``{rank}``, else the rank is inserted where there
are several (``stats.json`` -> ``stats.rank1.json``).  A bandit starts from its own
table, else from the one under the name as given, which every rank reads and none writes.
"""

from __future__ import annotations

import json
import logging
import math
import os
import string
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any

from feather_sched.core.cht import DEFAULT_CHUNK_TOKENS
from feather_sched.core.fairness import DEFAULT_MAX_OVERTAKES, DEFAULT_MAX_STOPS
from feather_sched.core.isolation import Isolation
from feather_sched.core.queue import DEFAULT_MAX_WAIT_S, DEFAULT_MIN_PASSING_TOKENS, FeatherQueue
from feather_sched.core.tenants import (
    DEFAULT_HIT_WEIGHT,
    DEFAULT_QUANTUM_TOKENS,
    TENANT_HEADER,
    TenantShare,
    parse_tenant,
)
from feather_sched.gates import GATE_KINDS, make_gate
from feather_sched.gates.base import BatchLayout, Gate, Persistent
from feather_sched.gates.heuristic import AlwaysAddGate
from feather_sched.gates.step_model import AUTO, EngineShape, StepPrior
from feather_sched.telemetry.stats import SAVE_EVERY_S

ENV_PREFIX = "FEATHER_"
OFF = ("off", "none", "null")
"""Spellings that turn an optional bound off (also ``null`` in JSON)."""
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")

logger = logging.getLogger("feather_sched")


class FeatherConfigError(ValueError):
    """A Feather option is unknown or has a bad value."""


REPLICA_VARIABLE = "FEATHER_REPLICA"
"""``r/n``: this process serves replica ``r`` of ``n`` engines behind one endpoint.
``feather serve --replicas`` sets it in each Ray Serve replica; set it yourself for
engines started by hand behind a balancer of your own."""
FILE_OPTIONS = ("state_file", "stats_file", "step_log")
"""The options naming a file Feather writes."""


@dataclass(frozen=True)
class Placement:
    """Which of a deployment's Feather schedulers this process runs: ``rank`` of
    ``ranks``, numbered over replicas and, inside each, the engine's data-parallel ranks."""

    rank: int = 0
    ranks: int = 1

    @classmethod
    def of(cls, dp_rank: int = 0, dp_ranks: int = 1,
           environ: Mapping[str, str] = os.environ) -> Placement:
        """The engine's data-parallel rank ``dp_rank`` of ``dp_ranks`` within the replica
        ``FEATHER_REPLICA`` names (one replica without it)."""
        replica, replicas = _replica(environ.get(REPLICA_VARIABLE))
        if not 0 <= dp_rank < dp_ranks:
            raise FeatherConfigError(f"data-parallel rank {dp_rank} of {dp_ranks}")
        return cls(replica * dp_ranks + dp_rank, max(replicas, replica + 1) * dp_ranks)

    @property
    def several(self) -> bool:
        """Whether the deployment runs more than one Feather scheduler."""
        return self.ranks > 1

    def path(self, given: str) -> str:
        """This process's file for the name ``given``: ``{rank}`` filled in; a name without
        it as given for a lone process, with ``.rank<r>`` before its suffix among several."""
        path = given.format(rank=self.rank)  # {{ and }} are braces in any name
        if _has_fields(given) or not self.several:
            return path
        named = Path(path)
        return str(named.with_name(f"{named.stem}.rank{self.rank}{named.suffix}"))


@dataclass(frozen=True)
class FeatherConfig:
    """One scheduler process's options, checked; its file options are its own paths."""

    gate: str = "model"
    """ADD/STOP policy: ``always`` (no gating), ``chunk-loss``, ``bandit`` (the paper's) or
    ``model`` (the default: with the batch ordered it admits as ``always`` and predicts
    nothing; with ordering off it is the best gate measured, ``benchmarks/gate``)."""
    gate_options: dict[str, Any] = field(default_factory=dict)
    """Keyword options of the gate, a JSON object (see ``feather_sched.gates``): e.g.
    ``{"max_loss": 5}`` (chunk-loss), ``{"exploration": 200, "seed": 0}`` (bandit),
    ``{"prior": "h100-sxm/llama-3-8b"}`` (model; its prior defaults to ``auto``)."""
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    """Chunk size in tokens; with engine block hashes, rounded down to whole blocks, at
    least one (``max(1, chunk_tokens // block_size)`` blocks a chunk)."""
    state_file: str | None = None
    """Bandit table to start from and to save to (warm start across restarts); needs
    ``gate: bandit``."""
    max_overtakes: int | None = DEFAULT_MAX_OVERTAKES
    """Fairness bound: while a request waits, at most this many later arrivals are
    admitted before it (``fairness``); None (or "off") turns it off."""
    max_stops: int | None = DEFAULT_MAX_STOPS
    """Fairness bound: while a request waits, the gate ends at most this many scheduling
    passes early; None (or "off") turns it off."""
    max_wait_s: float | None = DEFAULT_MAX_WAIT_S
    """Starvation backstop: a request waiting longer is admitted whatever the gate says;
    None (or "off") turns it off."""
    fairness: str = "off"
    """Fair share between tenants: ``tenants`` keeps a virtual service counter per tenant
    (VTC's weighted prompt and output tokens, a prefix-cache hit at ``fair_hit_weight`` of
    a computed token, so sharing a prefix pays the tenant that shares it) and admits, in
    the tree's prefix order (the least served first among requests sharing as much), only
    among the backlogged tenants within ``fair_quantum_tokens`` of the least served, none
    holding its share of the engine's seats while one below its share waits; ``vtc`` is
    VTC itself, the baseline: the same counters charging each prompt whole when admitted,
    the least served tenant's oldest request next, no prefix order, seat share, gate
    (every answer ADD) or waiting bound, the engine's own running order and victim (the
    options of those do not apply); ``off`` (the default): one queue for all
    (docs/fairness.md#tenants)."""
    tenant_weights: dict[str, float] = field(default_factory=dict)
    """Each tenant's share relative to the others, a JSON object of positive numbers
    (``{"gold": 2}``); a tenant not named has weight 1."""
    fair_quantum_tokens: int = DEFAULT_QUANTUM_TOKENS
    """How far, in weighted tokens, a tenant may get ahead of the least served one while
    the prefix order picks it (``fairness: tenants``); ahead of a light tenant, only its
    part of it (its part of the recent service over its fair part); 0 is VTC's own rule."""
    fair_hit_weight: float = DEFAULT_HIT_WEIGHT
    """What a prompt token served from the prefix cache costs its tenant under fair share,
    relative to one the engine computes, from 0 (computed tokens only: a hit is free) to
    1 (VTC's: the whole prompt, whoever computed it)."""
    isolate_tenants: bool = False
    """Each named tenant its own prefix namespace: requests of two tenants are never
    grouped, ranked or ordered by each other's prefixes, as requests of two
    ``cache_salt`` values never are (docs/isolation.md).  Off by default: tenants that
    share a public prefix (one system prompt) keep running as one group; a gateway that
    must isolate tenants sets ``cache_salt`` per tenant (the engine's cache then isolates
    them too) or turns this on."""
    tenant_header: str = TENANT_HEADER
    """The HTTP header in which a gateway names a request's tenant; the fronts read it
    (and refuse a bad one) only where tenants are used (``fairness`` or
    ``isolate_tenants``), otherwise every request passes untouched."""
    max_urgent_preemptions: int = 1
    """A waiting request that cannot be admitted for lack of KV room or a seat preempts
    the fewest running requests of a less urgent class that make room
    (``FeatherRuntime.urgent_victims``: the end of Feather's order among them first),
    each running request at most this many times over its life; 0 turns it off."""
    max_preemptions: int | None = 8
    """A running request preempted this many times (for KV room or urgency) goes after
    every other running member of its prefix group in Feather's victim order: it is
    preempted again only once they are gone or at the bound too (groups still give way
    youngest first; docs/fairness.md, "Under KV pressure").  None: no bound."""
    min_passing_tokens: int = DEFAULT_MIN_PASSING_TOKENS
    """Shortest prefix shared with the running set for which a waiting request passes
    older ones in the tree's order (0: any shared chunk)."""
    shortest_when_all_fits: bool = False
    """While the engine could run every request in flight at once, admit the waiting
    request with the fewest prompt tokens left to compute first (shared chunks with the
    running set do not count), not the oldest; still within ``max_overtakes``.  Mean
    TTFT 0.67-0.88x on Mooncake, BFCL and conversation traces in the simulator, but p99
    1.26x FCFS's on BFCL at 0.8x capacity (docs/fairness.md)."""
    order_running: bool = True
    """Keep the running list, and so the batch, ordered by prefix group
    (``batch_layout``)."""
    sessions: bool = False
    """Agent sessions (docs/sessions.md): a request extending a recently finished one's
    prompt and output is its session's next turn; a turn that ends with its session
    expected to go on keeps its KV blocks from eviction for a time the rule chooses, and
    the next turn whose prefix is warm is admitted ahead of newcomers (within the bounds
    above).  Off by default: a hold keeps KV from other requests on a guess, and vLLM never
    tells the scheduler that a turn called a tool, so the first gap of a session is never
    held there (docs/sessions.md#wiring-into-the-runtime)."""
    session_held_share: float = 0.5
    """The most of the KV pool's blocks that session holds keep at once (``sessions``)."""
    stats_file: str | None = None
    """Where the adapter writes its ``SchedulerStats`` as JSON (periodically and at
    shutdown): scheduling time, step time, admission counts, queue sizes, preemptions,
    faults."""
    step_log: str | None = None
    """CSV to append each step's batch composition and time to (for ``feather calibrate``)."""
    shared_prefix_attention: str = "auto"
    """Shared-prefix decode attention (each prefix group's KV read once per step):
    ``auto`` (with Feather's scheduler, where the self-check at engine start measured it
    exact and faster than the engine's kernel on this machine and these shapes), ``on``
    (no check; also under the engine's own scheduler) or ``off``."""
    shared_prefix_min_tokens: int | None = None
    """Shortest shared prefix that shared-prefix attention reads once for its group (None:
    under ``auto`` the break-even the self-check measured; under ``on`` the kernel's
    default for the engine's KV layout, ``attention.cpu_kernel.MIN_SHARED_TOKENS_BY_LAYOUT``:
    256 tokens over vLLM's ``vec`` CPU layout, 8192 over ``amx``)."""
    max_tenant_labels: int = 32
    """Tenants named on the ``feather:tenant_*`` series of ``/metrics``: the first this many
    a scheduler process sees, besides ``default``; every later one is labelled ``other``,
    so an unbounded set of tenants cannot multiply Prometheus's series."""
    max_faults: int = 8
    """Faults of Feather's own code in a row (no clean scheduling pass between them) that
    turn Feather off for the engine, which keeps its own order from then on."""
    save_every_s: float = SAVE_EVERY_S
    """Seconds between writes of ``stats_file`` and ``state_file`` while the engine
    schedules (they are also written every 512 steps, when the engine drains, and at
    shutdown): what an engine killed without a shutdown can lose."""

    placement: Placement = field(default=Placement(), kw_only=True)
    """Which scheduler process of the deployment this is for.  The file options hold this
    process's paths (``Placement.path`` of the names given)."""
    shared_state_file: str | None = field(default=None, init=False)
    """The table a bandit starts from while its own ``state_file`` does not exist: the name
    as given, where the rank was inserted into it; else None."""

    def __post_init__(self) -> None:
        for name in VALIDATORS:
            object.__setattr__(self, name, _checked(name, getattr(self, name)))
        if self.state_file is not None and self.gate != "bandit":
            raise FeatherConfigError("feather option 'state_file' needs gate 'bandit'")
        for name in FILE_OPTIONS:
            given = getattr(self, name)
            if given is None:
                continue
            path = self.placement.path(given)
            if name == "state_file" and self.placement.several and not _has_fields(given):
                object.__setattr__(self, "shared_state_file", Placement().path(given))
            object.__setattr__(self, name, path)
            check_writable(name, path)
        if self.placement.several and any(getattr(self, n) for n in FILE_OPTIONS):
            logger.info("Feather: scheduler rank %d of %d writes %s", self.placement.rank,
                        self.placement.ranks, ", ".join(
                            f"{n} {getattr(self, n)}" for n in FILE_OPTIONS if getattr(self, n)))
        self.make_gate(announce=False)  # the gate options and state file, checked once

    @classmethod
    def from_sources(
        cls, options: Mapping[str, Any] | None, environ: Mapping[str, str] = os.environ, *,
        dp_rank: int = 0, dp_ranks: int = 1, json_text: str | None = None,
        source: str = "feather options",
    ) -> FeatherConfig:
        """Options from the engine's config mapping, or from ``json_text`` (its JSON, as
        an environment variable carries it; not both), falling back to FEATHER_*
        variables, for the scheduler of data-parallel rank ``dp_rank`` of ``dp_ranks`` in
        its replica (``Placement.of``).  FeatherConfigError naming the option on any bad
        value, and ``source`` for text that is not a JSON object."""
        if json_text is not None:
            if options is not None:
                raise ValueError("give options or their JSON text, not both")
            try:
                options = _mapping(json_text)
            except ValueError as error:  # json.JSONDecodeError is one
                raise FeatherConfigError(f"{source}: not a JSON object ({error})") from None
        values = _sourced(options, environ, VALIDATORS)
        unknown = sorted(set(options or {}) - set(VALIDATORS), key=str)
        if unknown:
            raise FeatherConfigError(f"unknown feather option(s) {unknown}; known: "
                                     f"{', '.join(VALIDATORS)}")
        return cls(**values, placement=Placement.of(dp_rank, dp_ranks, environ))

    @staticmethod
    def option(name: str, options: Mapping[str, Any] | None,
               environ: Mapping[str, str] = os.environ) -> Any:
        """One option's checked value from the sources ``from_sources`` reads, checking
        nothing else (no other option, no file): for a process that needs only this one,
        such as a worker on a node where the scheduler's files do not exist."""
        value = _sourced(options, environ, (name,)).get(name, MISSING)
        if value is MISSING:
            default = FeatherConfig.__dataclass_fields__[name]
            value = default.default_factory() if default.default is MISSING else default.default
        return _checked(name, value)

    @property
    def batch_layout(self) -> BatchLayout:
        """The batch layout ``order_running`` asks for (an adapter may find that the
        engine keeps its own: ``FeatherRuntime.engine_keeps_its_order``); VTC's is the
        engine's."""
        return BatchLayout.FEATHER if self.order_running and not self.is_vtc else \
            BatchLayout.ENGINE

    @property
    def uses_tenants(self) -> bool:
        """Whether requests' tenants change anything (fair share or tenant isolation): the
        HTTP fronts name tenants only then."""
        return self.fairness != "off" or self.isolate_tenants

    @classmethod
    def tenant_header_of(cls, options: Mapping[str, Any] | None,
                         environ: Mapping[str, str] = os.environ) -> str | None:
        """``tenant_front_header`` of the options ``from_sources`` reads, reading only
        those it needs (``option``: no file checked).  FeatherConfigError for a bad one."""
        return cls(**{name: cls.option(name, options, environ) for name in (
            "fairness", "isolate_tenants", "tenant_header")}).tenant_front_header

    @property
    def tenant_front_header(self) -> str | None:
        """The header the HTTP fronts read tenants from, None where tenants are not used:
        every request then passes them untouched, as the engine's own server takes it."""
        return self.tenant_header if self.uses_tenants else None

    @property
    def isolation(self) -> Isolation:
        """The namespaces of this engine's requests' prefix keys (``isolation``)."""
        return Isolation(self.isolate_tenants)

    @property
    def is_vtc(self) -> bool:
        """``fairness: vtc``: VTC itself, no prefix order, gate or waiting bound."""
        return self.fairness == "vtc"

    def make_gate(self, *, announce: bool = True, engine: EngineShape | None = None) -> Gate:
        """The configured gate; a bandit warm-starts from ``state_file`` when it exists, a
        model gate with prior ``auto`` from ``engine``'s profile, where there is one
        (logged when ``announce``: once per gate put to use, not per validation)."""
        options = dict(self.gate_options)
        if self.gate == "model":
            options.setdefault("layout", self.batch_layout)
            if not isinstance(options.get("prior", AUTO), str | StepPrior | None):
                raise FeatherConfigError("feather option 'gate_options': prior must be a "
                                         f"profile name or null, got {options['prior']!r}")
            if options.get("prior", AUTO) == AUTO and engine is not None:
                options["prior"], note = StepPrior.for_engine(engine)
                if announce:
                    ordered = options["layout"] is BatchLayout.FEATHER
                    logger.info("Feather: model gate %s%s", note, "; it predicts only where "
                                "batch ordering cannot act" if ordered else "")
        try:
            gate = make_gate(self.gate, **options)
        except (ValueError, TypeError, ArithmeticError) as error:
            raise FeatherConfigError(f"feather option 'gate_options': {error}") from None
        source = self.warm_start_file()
        if source is not None:
            assert isinstance(gate, Persistent)  # only the bandit has a state file
            try:
                gate.load(source)
            except (OSError, ValueError) as error:
                raise FeatherConfigError(
                    f"feather option 'state_file' ({source}): {error}") from None
            if announce:
                logger.info("Feather: bandit table loaded from %s (%d learned decisions)%s",
                            source, gate.learned_decisions, "" if source == self.state_file
                            else f"; saved to {self.state_file}")
        return gate

    def warm_start_file(self) -> str | None:
        """The bandit table to start from: ``state_file`` where it exists, else
        ``shared_state_file`` where that exists, else None (a cold start)."""
        for path in (self.state_file, self.shared_state_file):
            if path is not None and Path(path).exists():
                return path
        return None

    def make_queue(self, clock: Callable[[], float] = time.monotonic,
                   engine: EngineShape | None = None,
                   chunk_tokens: int | None = None) -> FeatherQueue:
        """The queue with the configured gate and bounds (``engine``: see ``make_gate``;
        ``chunk_tokens``: what a chunk key stands for where the engine's blocks round the
        configured ``chunk_tokens``)."""
        chunk_tokens = chunk_tokens or self.chunk_tokens
        if self.is_vtc:
            queue = FeatherQueue(AlwaysAddGate(), max_overtakes=None, max_stops=None,
                                 max_wait_s=None, chunk_tokens=chunk_tokens, clock=clock,
                                 share=TenantShare(self.tenant_weights, quantum=0,
                                                   hit_weight=1, shares_seats=False),
                                 prefix_order=False)
        else:
            share = None if self.fairness == "off" else TenantShare(
                self.tenant_weights, self.fair_quantum_tokens, self.fair_hit_weight)
            queue = FeatherQueue(self.make_gate(engine=engine),
                                 max_overtakes=self.max_overtakes, max_stops=self.max_stops,
                                 max_wait_s=self.max_wait_s, chunk_tokens=chunk_tokens,
                                 min_passing_tokens=self.min_passing_tokens, clock=clock,
                                 share=share,
                                 shortest_when_all_fits=self.shortest_when_all_fits)
        queue.use_layout(self.batch_layout)
        return queue


def check_writable(option: str, path: str) -> None:
    """That Feather can create or replace ``path``; FeatherConfigError naming both if not."""
    target = Path(path)
    where = f"feather option '{option}' ({path})"
    if target.is_dir():
        raise FeatherConfigError(f"{where}: is a directory")
    directory = target.parent
    if not directory.is_dir():
        raise FeatherConfigError(f"{where}: directory {directory} does not exist")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise FeatherConfigError(f"{where}: cannot write in {directory}")
    if target.exists() and not os.access(target, os.W_OK):
        raise FeatherConfigError(f"{where}: the file is not writable")


# ---- one validator per option (JSON values and environment strings alike) -------------


def _gate(value: Any) -> str:
    if value not in GATE_KINDS:
        raise ValueError(f"must be one of {', '.join(GATE_KINDS)}")
    return value


def _mapping(value: Any) -> dict[str, Any]:
    if isinstance(value, str):
        value = json.loads(value)
    if not isinstance(value, dict):
        raise ValueError("must be a JSON object")
    return value


def _positive_integer(value: Any) -> int:
    number = _integer(value)
    if number <= 0:
        raise ValueError("must be a positive integer")
    return number


def _optional_positive_integer(value: Any) -> int | None:
    return None if value is None else _positive_integer(value)


def _count(value: Any) -> int:
    number = _integer(value)
    if number < 0:
        raise ValueError("must be a non-negative integer")
    return number


def _optional_count(value: Any) -> int | None:
    if _is_off(value):
        return None
    number = _integer(value)
    if number < 0:
        raise ValueError("must be a non-negative integer or \"off\"")
    return number


def _optional_seconds(value: Any) -> float | None:
    if _is_off(value) or (isinstance(value, str) and value.strip().lower() == "inf"):
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError("must be a number of seconds or \"off\"")
    number = float(value)
    if not math.isfinite(number) or number < 0:
        raise ValueError("must be a non-negative number of seconds or \"off\"")
    return number


def _fraction(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError("must be a number from 0 to 1")
    number = float(value)
    if not 0 <= number <= 1:
        raise ValueError("must be a number from 0 to 1")
    return number


def _positive_seconds(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError("must be a positive number of seconds")
    number = float(value)
    if not math.isfinite(number) or number <= 0:
        raise ValueError("must be a positive number of seconds")
    return number


def is_true(word: str) -> bool:
    """Whether an environment word says yes (``TRUE``: 1, true, yes, on; any case)."""
    return word.strip().lower() in TRUE


def _boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in TRUE + FALSE:
        return value.strip().lower() in TRUE
    raise ValueError(f"must be true or false (or one of {', '.join(TRUE + FALSE)})")


SHARED_PREFIX_MODES = ("auto", "on", "off")
FAIRNESS_MODES = ("off", "tenants", "vtc")


def _fairness_mode(value: Any) -> str:
    word = value.strip().lower() if isinstance(value, str) else value
    if word not in FAIRNESS_MODES:
        raise ValueError(f"must be one of {', '.join(FAIRNESS_MODES)}")
    return word


def _weights(value: Any) -> dict[str, float]:
    weights = _mapping(value)
    for tenant, weight in weights.items():
        if isinstance(weight, bool) or not isinstance(weight, int | float) or \
                not math.isfinite(weight) or weight <= 0:
            raise ValueError(f"tenant {tenant!r}: a weight must be a positive number")
    return {parse_tenant(tenant, "a tenant weight's name"): float(weight)
            for tenant, weight in weights.items()}


_HEADER_CHARS = frozenset(string.ascii_lowercase + string.digits + "!#$%&'*+-.^_`|~")


def _header_name(value: Any) -> str:
    word = value.strip().lower() if isinstance(value, str) else value
    if not isinstance(word, str) or not word or not set(word) <= _HEADER_CHARS:
        raise ValueError("must be an HTTP header name (letters, digits, '-' ...)")
    return word


def _shared_prefix_mode(value: Any) -> str:
    word = value.strip().lower() if isinstance(value, str) else value
    if word in SHARED_PREFIX_MODES:
        return word
    if isinstance(value, bool) or word in TRUE + FALSE:
        return "on" if value is True or word in TRUE else "off"
    raise ValueError(f"must be one of {', '.join(SHARED_PREFIX_MODES)} (or a boolean)")


def _optional_path(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str | os.PathLike) or not str(value) or "\0" in str(value):
        raise ValueError("must be a file path")
    path = str(value)
    fields_named = {name for _, name, _, _ in string.Formatter().parse(path) if name is not None}
    if fields_named - {"rank"}:
        raise ValueError("may hold only the placeholder {rank} (write a brace as {{ or }})")
    path.format(rank=0)  # a bad format spec, as in {rank:s}, fails here
    return path


def _has_fields(path: str) -> bool:
    """Whether a checked path holds ``{rank}``."""
    return any(name is not None for _, name, _, _ in string.Formatter().parse(path))


def _integer(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError("must be an integer")
    return int(value)


def _is_off(value: Any) -> bool:
    return value is None or (isinstance(value, str) and value.strip().lower() in OFF)


VALIDATORS: dict[str, Callable[[Any], Any]] = {
    "gate": _gate,
    "gate_options": _mapping,
    "chunk_tokens": _positive_integer,
    "state_file": _optional_path,
    "max_overtakes": _optional_count,
    "max_stops": _optional_count,
    "max_wait_s": _optional_seconds,
    "fairness": _fairness_mode,
    "tenant_weights": _weights,
    "fair_quantum_tokens": _count,
    "fair_hit_weight": _fraction,
    "isolate_tenants": _boolean,
    "tenant_header": _header_name,
    "max_urgent_preemptions": _count,
    "max_preemptions": _optional_positive_integer,
    "min_passing_tokens": _count,
    "shortest_when_all_fits": _boolean,
    "order_running": _boolean,
    "sessions": _boolean,
    "session_held_share": _fraction,
    "stats_file": _optional_path,
    "step_log": _optional_path,
    "shared_prefix_attention": _shared_prefix_mode,
    "shared_prefix_min_tokens": _optional_positive_integer,
    "max_tenant_labels": _positive_integer,
    "max_faults": _positive_integer,
    "save_every_s": _positive_seconds,
}
"""Each option's validator: the checked value, or ValueError saying what it must be."""


def _checked(name: str, value: Any, variable: str | None = None) -> Any:
    """``value`` through option ``name``'s validator; FeatherConfigError naming the option
    (and the ``variable`` it came from) if it is refused."""
    try:
        return VALIDATORS[name](value)
    except (ValueError, TypeError, ArithmeticError) as error:
        where = f"feather option '{name}'"
        message = f"{variable}={value!r} ({where}): {error}" if variable else \
            f"{where}: {error}, got {value!r}"
        raise FeatherConfigError(message) from None


def _sourced(options: Mapping[str, Any] | None, environ: Mapping[str, str],
             names: Collection[str]) -> dict[str, Any]:
    """The options among ``names`` that ``options`` or the FEATHER_* variables set, the
    mapping winning (FEATHER_GATE=bandit, FEATHER_GATE_OPTIONS='{"exploration": 100}'...);
    variables checked here, so their errors name them."""
    if options is not None and not isinstance(options, Mapping):
        raise FeatherConfigError(f"feather options must be a JSON object, got {options!r}")
    values = {}
    for name in names:
        variable = ENV_PREFIX + name.upper()
        if variable in environ:
            values[name] = _checked(name, environ[variable], variable)
    values.update((name, value) for name, value in (options or {}).items() if name in names)
    return values


def _replica(value: str | None) -> tuple[int, int]:
    """``FEATHER_REPLICA``'s ``r/n`` as (r, n); (0, 1) when unset.  ``r`` may pass ``n``
    (a replica Ray starts before the one it replaces has stopped)."""
    if value is None:
        return 0, 1
    try:
        replica, replicas = (int(part) for part in value.split("/"))
    except ValueError:
        replica, replicas = -1, 0
    if replica < 0 or replicas < 1:
        raise FeatherConfigError(f"{REPLICA_VARIABLE}={value!r}: must be r/n, replica r "
                                 "(from 0) of n")
    return replica, replicas
