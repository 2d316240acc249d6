"""Feather inside SGLang's scheduler (pinned: sglang 0.5.23), through SGLang's plugin hooks.

``register()`` puts the AROUND hooks of ``HOOKS`` into SGLang's ``HookRegistry``, which
every (spawned) scheduler process applies; they are inert unless ``FEATHER_SGLANG=1``.
Then each scheduler gets a ``FeatherSGLang``, which translates SGLang's types for the
runtime (held as ``RuntimeContract``): a round (``get_new_batch_prefill``) is one pass,
rewarded with the next decode step.  ``SGLangRequests`` views SGLang's ``Req``;
``FeatherSchedulePolicy`` is ``fcfs`` with the queue in Feather's order;
``FeatherPrefillAdder`` asks Feather about each request offered (STOP ends the round)
and gives SGLang's priority preemption Feather's urgent victims (``preemption``).

A fault in Feather's code never reaches SGLang: SGLang's own admission and ``fcfs`` serve
until Feather's picture is rebuilt.  Options: ``FEATHER_*`` or ``FEATHER_SGLANG_OPTIONS``.
How the hooks reach each process, the modes refused: docs/sglang.md, "Mechanism", "Limits".
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Hashable, Iterable, Mapping
from operator import attrgetter
from typing import Any

from feather_sched.core import (
    TENANT_ARG,
    Decision,
    EngineShape,
    FeatherConfig,
    FeatherConfigError,
    FeatherRuntime,
    Isolation,
    Namespace,
    RuntimeContract,
    is_true,
    parse_tenant,
    token_keys,
)
from feather_sched.integrations.sglang import preemption
from feather_sched.integrations.sglang.preemption import Room
from feather_sched.integrations.sglang.sessions import (
    SGLangSessions,
    session_namespace,
    why_no_sessions,
)
from feather_sched.integrations.sglang.stand_ins import prepare_sglang_import
from feather_sched.telemetry.steplog import BatchEntry

prepare_sglang_import()  # before the first SGLang import (see stand_ins)

from sglang.srt.managers.schedule_batch import Req, ScheduleBatch  # noqa: E402
from sglang.srt.managers.schedule_policy import (  # noqa: E402
    AddReqResult,
    PrefillAdder,
    SchedulePolicy,
)

logger = logging.getLogger("sglang.feather_sched")

POLICY_NAME = "feather"
"""What ``--schedule-policy`` takes under the launcher."""
BASE_POLICY = "fcfs"
"""The SGLang policy the engine is configured with underneath Feather."""
ENV_ENABLE = "FEATHER_SGLANG"
ENV_OPTIONS = "FEATHER_SGLANG_OPTIONS"


def feather_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether ``FEATHER_SGLANG`` selects Feather in this process (and its children)."""
    return is_true(environ.get(ENV_ENABLE, ""))


def feather_options(environ: Mapping[str, str] = os.environ, *, dp_rank: int = 0,
                    dp_ranks: int = 1) -> FeatherConfig:
    """Feather's options: ``FEATHER_SGLANG_OPTIONS`` (JSON) over ``FEATHER_*`` variables,
    for the scheduler of data-parallel rank ``dp_rank`` of ``dp_ranks`` (its files)."""
    return FeatherConfig.from_sources(None, environ, dp_rank=dp_rank, dp_ranks=dp_ranks,
                                      json_text=environ.get(ENV_OPTIONS) or None,
                                      source=ENV_OPTIONS)


class SGLangRequests:
    """``RequestView`` of SGLang's ``Req``: chunk keys from ``origin_input_ids``, priority
    classes from ``Req.priority`` as the scheduler's settings rank it, the tenant from
    ``custom_params``."""

    def __init__(self, chunk_tokens: int, *, priority_scheduling: bool = False,
                 low_priority_values_first: bool = False,
                 isolation: Isolation | None = None) -> None:
        """``priority_scheduling``, ``low_priority_values_first``: SGLang's
        ``enable_priority_scheduling`` and ``schedule_low_priority_values_first``;
        ``isolation``: Feather's (``FeatherConfig.isolation``)."""
        self.chunk_tokens = chunk_tokens
        self.isolation = isolation or Isolation()
        self.priority_scheduling = priority_scheduling
        self.low_priority_values_first = low_priority_values_first
        self.warm: set[str] | None = None
        """With agent sessions on, the warm continuing turns (``SGLangSessions.warm``)."""
        self.arrivals: dict[str, float] = {}
        """Arrivals kept for requests re-entered in Feather's queue (on its clock)."""

    request_id = attrgetter("rid")
    """The request's id (an attrgetter: the runtime maps it over the running list)."""

    def chunk_keys(self, req: Req) -> list:
        """Token chunks of ``origin_input_ids`` in the request's namespace
        (``core.isolation``): SGLang's radix cache keys by ``extra_key`` (which carries
        the LoRA id) and ``cache_salt`` besides the tokens (``RadixKey``), and so does
        Feather (multimodal items are in the tokens: SGLang pads them with their hashes)."""
        if not len(req.origin_input_ids):
            return []  # an empty prompt shares nothing (SGLang decides what to do with it)
        namespace = self.isolation.namespace(self.boundary(req), lambda: self.tenant(req))
        return token_keys(req.origin_input_ids, self.chunk_tokens, namespace)

    def prompt_tokens(self, req: Req) -> int:
        return len(req.origin_input_ids)

    def arrival_s(self, req: Req) -> float | None:
        """None (now, on the runtime's clock), but for a request re-entered while it
        waits (``FeatherSGLang``'s overdue requests joining the warm turns)."""
        return self.arrivals.get(req.rid)

    def priority(self, req: Req) -> int:
        """Feather's class: ``engine_class``; with sessions on, each SGLang class split in
        two, its warm continuing turns first (``2 * class``), then its other requests (a
        class beyond 2**61, as None's, is not split: it would leave 64 bits).  Urgent
        preemption compares SGLang's own classes: a warm turn preempts none of its class."""
        engine_class, warm = self.engine_class(req), self.warm
        if warm is None or abs(engine_class) >= 1 << 61:
            return engine_class
        return 2 * engine_class + (req.rid not in warm)

    def engine_class(self, req: Req) -> int:
        """The class (lower more urgent) in SGLang's order of urgency: 0 without priority
        scheduling (SGLang then ignores ``Req.priority``); ``Req.priority`` when low values
        go first; else ``~priority`` (``-1 - priority``: SGLang's default runs high values
        first; unlike negation it stays in SGLang's signed 64-bit range, where Feather's
        fairness bound stores classes).  None, not yet given SGLang's default, is least
        urgent, as that default makes it."""
        if not self.priority_scheduling:
            return 0
        value = req.priority
        if value is None:
            return sys.maxsize
        return value if self.low_priority_values_first else ~value

    def session_namespace(self, req: Req) -> Namespace:
        """Where the request's session lives: its tenant and its radix-cache boundary
        (``extra_key``, ``cache_salt``), isolated tenants or not."""
        return session_namespace(self.boundary(req), self.tenant(req))

    @staticmethod
    def boundary(req: Req) -> tuple:
        """What SGLang's ``RadixKey`` keys by besides the tokens, the parts the request has."""
        return (("extra_key", req.extra_key) if req.extra_key is not None else None,
                ("cache_salt", req.cache_salt) if req.cache_salt is not None else None)

    def tenant(self, req: Req) -> Hashable:
        """``custom_params["tenant"]`` of the request's ``SamplingParams`` (``parse_tenant``),
        the one field SGLang carries from every front to the scheduler's ``Req``: native
        ``/generate``'s ``sampling_params``, the OpenAI endpoints' ``custom_params``, the
        Python ``Engine``'s sampling params; the launcher fills it from the ``x-tenant-id``
        header or OpenAI's ``user`` (``tenant_front``).  A value ``tenant_error`` refuses
        reads as the default tenant: its request was aborted as it entered the queue."""
        try:
            return parse_tenant(self._raw_tenant(req))
        except ValueError:
            return parse_tenant(None)

    def tenant_error(self, req: Req) -> str | None:
        """Why the request's tenant is invalid, or None."""
        try:
            parse_tenant(self._raw_tenant(req))
        except ValueError as error:
            return str(error)
        return None

    @staticmethod
    def _raw_tenant(req: Req) -> object:
        params = req.sampling_params.custom_params
        return params.get(TENANT_ARG) if isinstance(params, dict) else None


def is_decode_step(batch: ScheduleBatch) -> bool:
    """A batch that decodes the running requests (mixed chunked prefill included)."""
    mode = batch.forward_mode
    return mode.is_decode() or mode.is_mixed()


class FeatherSGLang:
    """One SGLang scheduler's Feather: the runtime, SGLang's rounds and steps translated."""

    def __init__(self, config: FeatherConfig | None = None, *,
                 seats: int | None = None, kv_tokens: int | None = None,
                 engine: EngineShape | None = None, priority_scheduling: bool = False,
                 low_priority_values_first: bool = False,
                 priority_preemption: bool = False) -> None:
        """``seats``: SGLang's ``max_running_requests``; ``kv_tokens``: its
        ``max_total_num_tokens`` (the KV pool); ``engine``: its device and model
        (``engine_shape``); each where known.  ``priority_scheduling`` and
        ``low_priority_values_first``: the scheduler's ``enable_priority_scheduling`` and
        ``schedule_low_priority_values_first`` (how ``Req.priority`` ranks);
        ``priority_preemption``: its ``enable_priority_preemption`` (priority scheduling
        without ``--disable-priority-preemption``): urgent preemption is on."""
        self.config = config if config is not None else FeatherConfig()
        self.requests = SGLangRequests(self.config.chunk_tokens,
                                       priority_scheduling=priority_scheduling,
                                       low_priority_values_first=low_priority_values_first,
                                       isolation=self.config.isolation)
        self.runtime: RuntimeContract[Req] = FeatherRuntime(
            self.config, self.requests, name="FeatherSGLang", seats=seats,
            kv_tokens=kv_tokens, engine=engine)
        self.priority_preemption = priority_preemption
        self._bound: list[Req] | None = None
        self._cursor = 0
        self._next_decode = 0
        """The key of the next decode step: the rounds before it are rewarded with it."""
        self._decodes: dict[int, int] = {}
        """SGLang's launch counter of a decode batch -> its key."""
        self._batches: dict[int, list[BatchEntry]] = {}
        """Launch counter -> the batch as the step log describes it (step log or model gate)."""
        self.adder_class: type[FeatherPrefillAdder] = type(
            "BoundFeatherPrefillAdder", (FeatherPrefillAdder,), {"feather": self}
        )
        """``PrefillAdder`` subclass that consults this runtime (what the scheduler builds)."""
        self.faults = self.runtime.faults
        """Containment; ``faults.serves``: whether Feather serves the round (a round is a
        pass: ``begin_round`` opens it) and the calls after it, else SGLang's own order."""
        self.sessions: SGLangSessions | None = None
        """Agent sessions (``option sessions``, ``start_sessions``)."""

    # ---- sessions ---------------------------------------------------------------------

    def start_sessions(self, tree_cache: Any, pool_tokens: int) -> None:
        """Agent sessions over the scheduler's radix cache, where the option asks for them;
        off, with a warning, where that cache cannot hold them (``why_no_sessions``)."""
        if not self.config.sessions:
            return
        why = why_no_sessions(tree_cache)
        if why is not None:
            logger.warning("Feather's agent sessions are off: %s", why)
            return
        try:
            self.sessions = SGLangSessions(
                tree_cache, pool_tokens, self.config.session_held_share,
                self.requests.session_namespace, self.config.chunk_tokens, self.runtime.now,
                "FeatherSGLang", guard=self._guarded)
        except Exception:  # an optional part: never the scheduler's start
            logger.warning("Feather's agent sessions are off: they failed to start",
                           exc_info=True)
            return
        self.requests.warm = self.sessions.warm

    def _guarded(self, call: Callable[..., Any], *args: Any) -> None:
        if self.faults.active:
            self.faults.attempt("sessions", call, *args)

    def _sessions_round(self) -> None:
        """Before a round: lapsed holds end; with Feather off, every hold, for good."""
        sessions = self.sessions
        if sessions is None:
            return
        if self.faults.active:
            self.faults.attempt("sessions", sessions.expire)
            return
        self.sessions = self.requests.warm = None
        try:  # Feather is off: nothing of it may raise into SGLang's round
            sessions.unwrap()
            sessions.release_all()
        except Exception:
            logger.exception("Feather's agent sessions: releasing the holds failed")

    def _overdue_join_warm(self, waiting: list[Req]) -> None:
        """Requests past ``max_wait_s`` while warm turns of their SGLang class wait join
        them (``PinnedSessions.join_overdue``), re-entered in class ``2 * class``."""
        runtime, sessions = self.runtime, self.sessions
        if sessions is None:
            return
        late = sessions.join_overdue(lambda: waiting, self.config.max_wait_s, runtime.now(),
                                     lambda r: r.rid, self.requests.engine_class,
                                     lambda r: runtime.age_key(r)[1])
        for req in late:
            self.requests.arrivals[req.rid] = runtime.age_key(req)[1]
            runtime.discard(req.rid)
            runtime.enter_waiting(req)
            del self.requests.arrivals[req.rid]

    def holds_yield(self, req: Req | None, alone: bool) -> bool:
        """SGLang lacks KV room for ``req`` (None: the running batch's next decode step):
        whether a hold gave some back (``PinnedSessions.yields``: at once for the
        decode step, where SGLang would retract, or a request the round would otherwise
        run ``alone``; for another, after its wait)."""
        sessions = self.sessions
        if sessions is None or not self.faults.active or not sessions.pins:
            return False
        return bool(self.faults.call("sessions", self._holds_yield, sessions, req, alone,
                                     default=False))

    def _holds_yield(self, sessions: SGLangSessions, req: Req | None, alone: bool) -> bool:
        if req is None or alone:
            return sessions.yields()
        if not self.faults.serves:
            return False
        return sessions.yields(self.runtime.now() - self.runtime.age_key(req)[1],
                               self.config.max_wait_s)

    # ---- rounds -----------------------------------------------------------------------

    def begin_round(self, running: Iterable[Req], waiting: Iterable[Req]) -> None:
        """A round starts: after a fault, Feather's picture is rebuilt from SGLang's
        running and waiting requests first; a fault here leaves the round to SGLang."""
        self._bound = None
        self._sessions_round()
        if self.faults.open_pass():
            waiting = list(waiting)
            self.faults.attempt("begin_pass", self._begin_round, list(running), waiting)
            if self.sessions is not None and self.faults.serves:
                self.faults.attempt("sessions", self._overdue_join_warm, waiting)

    def _begin_round(self, running: list[Req], waiting: list[Req]) -> None:
        if not waiting and not self.faults.dirty:
            # SGLang orders (calc_priority) only a queue that holds requests: reconcile here
            self.runtime.reconcile(running, waiting)
        self.runtime.begin_pass(running, waiting)

    def rank_waiting(self, waiting: list[Req], running: Iterable[Req]) -> bool:
        """Reconcile with SGLang's queues, then sort ``waiting`` in place in the order
        Feather would admit it (``FeatherRuntime.rank_waiting``: the candidate, then as
        the tree ranks them) and remember it for this round.  False, and ``waiting`` as it
        was, when Feather is out of the round (a fault, here or before; or off)."""
        return self.faults.serves and self.faults.attempt("order", self._rank_waiting,
                                                          waiting, running)

    def _rank_waiting(self, waiting: list[Req], running: Iterable[Req]) -> None:
        self.runtime.reconcile(running, waiting)
        self._bound, self._cursor = waiting, 0
        waiting[:] = self.runtime.rank_waiting(waiting)

    def stops(self, req: Req) -> bool:
        """Whether Feather's answer for the request SGLang offers is STOP (never while
        Feather is out of the round: SGLang's own admission then)."""
        if not self.faults.serves:
            return False
        answer = self.faults.call("decide", self.runtime.decide, req)
        return answer is not None and answer.decision is Decision.STOP

    def admitted(self, req: Req) -> None:
        """SGLang admitted ``req``: the runtime admits it; the next best comes up; its
        session's hold ends."""
        if self.sessions is not None and self.faults.active:
            self.faults.attempt("sessions", self.sessions.admitted, req.rid)
        if self.faults.serves:
            self.faults.attempt("admit", self._admitted, req)

    def _admitted(self, req: Req) -> None:
        runtime = self.runtime
        runtime.admit(req)
        bound = self._bound
        if bound is None:
            return
        try:
            position = bound.index(req, self._cursor)
        except ValueError:
            return
        self._cursor = position + 1
        following = runtime.candidate()
        if following is None:
            return
        try:
            found = bound.index(following, position + 1)
        except ValueError:
            return
        if found != position + 1:
            bound.insert(position + 1, bound.pop(found))

    def end_round(self, running: Iterable[Req], started: float) -> None:
        """The round, begun at ``started`` (``time.perf_counter``), formed the next decode
        step's batch."""
        self._bound = None
        if self.faults.serves:
            self.faults.attempt("end_pass", self.runtime.end_pass, self._next_decode,
                                list(running))
        if self.faults.active:
            self.faults.attempt("meter", self.runtime.meter.scheduled,
                                time.perf_counter() - started)
            if self.sessions is not None:
                self.faults.attempt("sessions", self.sessions.publish)

    # ---- steps ------------------------------------------------------------------------

    def launched(self, batch: ScheduleBatch) -> None:
        """A batch went to the device; a decode batch takes the waiting rounds' key."""
        if is_decode_step(batch):
            self._decodes[batch.forward_iter] = self._next_decode
            self._next_decode += 1
        if self.runtime.wants_batches and self.faults.active:
            entries = self.faults.call("step", self.batch_entries, batch)
            if entries is not None:
                self._batches[batch.forward_iter] = entries

    def outputs(self, batch: ScheduleBatch) -> list[int] | None:
        """Each request's output length before SGLang processes its batch's result, for
        ``processed`` to count the step's service; None where none is counted (fair
        share off, or Feather off).  O(batch)."""
        if not self.runtime.counts_service or not self.faults.active:
            return None
        return [len(req.output_ids) for req in batch.reqs]

    def processed(self, batch: ScheduleBatch, seconds: float,
                  outputs: list[int] | None = None) -> None:
        """A batch's result was processed: the step's service is counted (``outputs``:
        the requests' output lengths before), finished requests leave, the step is
        rewarded (while a fault is pending, the next round's rebuild lets them leave)."""
        launch = batch.forward_iter
        key: Hashable = self._decodes.pop(launch, ("prefill", launch))
        entries = self._batches.pop(launch, None)
        if self.faults.active:
            self.faults.attempt("step", self._processed, batch, key, seconds, entries,
                                outputs)
        if self.sessions is not None and self.faults.active:
            self.faults.attempt("sessions", self._observe_reload, self.sessions, batch,
                                seconds)

    @staticmethod
    def _observe_reload(sessions: SGLangSessions, batch: ScheduleBatch, seconds: float) -> None:
        """An extend step's tokens and seconds, for what recomputing a prefix costs."""
        if batch.forward_mode.is_extend() and batch.extend_lens:
            sessions.cost.observe(sum(batch.extend_lens), seconds)

    def _processed(self, batch: ScheduleBatch, key: Hashable, seconds: float,
                   entries: list[BatchEntry] | None, outputs: list[int] | None) -> None:
        if outputs is not None:
            self._serve(batch, outputs)
        if self.faults.serves:
            for req in batch.reqs:
                if req.finished():
                    self.runtime.discard(req.rid)
        self.runtime.end_step(key, batch.batch_size(), seconds, entries)

    def _serve(self, batch: ScheduleBatch, outputs: list[int]) -> None:
        """The step's service per request (``FeatherRuntime.served``), before a finished
        one leaves: the prompt tokens it computed, its entry in the ``extend_lens`` SGLang
        fixed when it prepared an extend or mixed batch (radix-cache hits excluded, each
        prefill chunk its own tokens, a retracted request's recomputation included; none
        for a decode row), and the tokens its result appended to ``output_ids``."""
        extend_lens = batch.extend_lens if batch.forward_mode.is_extend() else None
        decoding = {id(req) for req in batch.decoding_reqs or ()}
        for i, (req, before) in enumerate(zip(batch.reqs, outputs, strict=True)):
            computed = 0 if extend_lens is None or id(req) in decoding else extend_lens[i]
            generated = max(len(req.output_ids) - before, 0)  # a session may cut outputs
            if computed or generated:
                self.runtime.served(req.rid, computed, generated)

    def batch_entries(self, batch: ScheduleBatch) -> list[BatchEntry]:
        """The batch in its order, as the step log describes it
        (``FeatherRuntime.describe_batch``: in Feather's chunks, as for vLLM)."""
        decoding = {id(req) for req in (batch.decoding_reqs or [])} \
            if batch.forward_mode.is_mixed() else set()
        rows = []
        for req in batch.reqs:
            if batch.forward_mode.is_decode() or id(req) in decoding:
                rows.append((req, len(req.origin_input_ids) + len(req.output_ids), 1))
            else:
                rows.append((req, req.extend_end, req.extend_len))
        return self.runtime.describe_batch(rows)

    def order_running(self, batch: ScheduleBatch) -> None:
        """Put the running decode batch in Feather's order, if it is not already and a
        group runs (SGLang's order while a fault is pending or Feather is off)."""
        if len(batch.reqs) < 2 or not self.faults.serves or not self.runtime.batch_has_groups:
            return
        order = self.faults.call("order_running", self._batch_positions, batch.reqs)
        if order is None or order == list(range(len(order))):
            return
        permute_batch(batch, order)
        self.runtime.meter.stats.reordered_batches += 1

    def _batch_positions(self, reqs: list[Req]) -> list[int]:
        return positions(reqs, self.runtime.batch_order(reqs))

    def retraction_order(self, reqs: list[Req]) -> list[int] | None:
        """The indices of ``reqs`` in Feather's retraction order, which is its running
        order (the end first); None while a fault is pending or Feather is off (SGLang's
        own order then)."""
        if not self.faults.serves:
            return None
        return self.faults.call("retraction_order", self._retraction_positions, reqs)

    def _retraction_positions(self, reqs: list[Req]) -> list[int]:
        return positions(reqs, self.runtime.order(reqs))

    def retracted(self, reqs: Iterable[Req], *, urgent: bool = False) -> None:
        """SGLang retracted ``reqs`` for KV room (``urgent``: each for a waiting request
        of a more urgent class): preemptions, counted per request, class and group
        (``FeatherRuntime.preempted``)."""
        if self.faults.serves:
            self.faults.attempt("preempted", self._retracted, list(reqs), urgent)

    def _retracted(self, reqs: list[Req], urgent: bool) -> None:
        for req in reqs:
            self.runtime.preempted(req, urgent=urgent)

    def entered(self, req: Req) -> None:
        """SGLang put ``req`` at the end of its waiting queue (its session recognised
        first: its class depends on it)."""
        if self.sessions is not None and self.faults.active:
            self.faults.attempt("sessions", self.sessions.arrived, req)
        if self.faults.serves:
            self.faults.attempt("enter_waiting", self.runtime.enter_waiting, req)

    def dropped(self, req: Req) -> None:
        """SGLang dropped ``req`` unrun (``Scheduler._release_aborted_request``: aborted or
        refused while waiting): its session lets go of it (``SGLangSessions.dropped``)."""
        if self.sessions is not None and self.faults.active:
            self.faults.attempt("sessions", self.sessions.dropped, req)

    def refuse_bad_tenant(self, req: Req) -> None:
        """Under fair share, a request entering SGLang's queue whose tenant is invalid is
        aborted the way SGLang refuses bad input (``Req.set_finish_with_abort``: a 400
        saying why), and is then finished like any other."""
        if self.runtime.fair_share and self.faults.active and req.to_finish is None:
            error = self.faults.call("tenant", self.requests.tenant_error, req)
            if error is not None:
                req.set_finish_with_abort(f"Invalid request: {error}")

    def urgent_victims(self, running: list[Req], req: Req, threshold: int,
                       room: Room) -> list[Req]:
        """The running requests to preempt together for waiting ``req``, which lacks a seat
        or KV room: ``FeatherRuntime.urgent_victims`` (the fewest in Feather's order that
        make ``room``, each at most ``max_urgent_preemptions`` times) among those of
        ``running`` not finished and less urgent than ``req`` by more than SGLang's
        ``threshold`` (``--priority-scheduling-preemption-threshold``, as SGLang's own
        priority preemption); [] unless ``preempts``."""
        if not self.preempts:
            return []
        return self.faults.call("urgent_victims", self._urgent_victims, running, req,
                                threshold, room) or []

    def _urgent_victims(self, running: list[Req], req: Req, threshold: int,
                        room: Room) -> list[Req]:
        priority = self.requests.engine_class
        urgency = priority(req)
        beyond = [r for r in running if not r.finished() and priority(r) - urgency > threshold]
        return self.runtime.urgent_victims(beyond, req, room)

    def takes_freed_room(self, req: Req, victims: list[Req]) -> bool:
        """After ``victims`` were released for ``req``: they wait again in Feather's
        picture (SGLang requeues them as its round ends) and the share decides who takes
        the room they freed (``FeatherRuntime.promise``); False where it gives the room to
        another request (the victims' tenant's, below its seat share), which SGLang's
        next round offers first."""
        return self.faults.call("promise", self._takes_freed_room, req, victims,
                                default=True) is not False

    def _takes_freed_room(self, req: Req, victims: list[Req]) -> bool:
        for victim in victims:
            self.runtime.enter_waiting(victim)
        return self.runtime.promise(req)

    @property
    def preempts(self) -> bool:
        """Whether a request may preempt for urgency now: SGLang's priority preemption is
        on and Feather serves the round."""
        return self.priority_preemption and self.faults.serves


def positions(reqs: list[Req], ordered: list[Req]) -> list[int]:
    """The indices in ``reqs`` of ``ordered``'s requests, in its order; RuntimeError if
    ``ordered`` is not a permutation of ``reqs``."""
    place = {id(req): i for i, req in enumerate(reqs)}
    order = [place[id(req)] for req in ordered]
    if len(set(order)) != len(reqs):
        raise RuntimeError("Feather's running order is not a permutation of the batch")
    return order


def permute_batch(batch: ScheduleBatch, order: list[int]) -> None:
    """Reorder a batch's requests and every per-request field with SGLang's own
    ``filter_batch``.  It skips a "filter" that keeps every request, so a placeholder is
    appended to ``reqs`` for the call; it is never indexed and does not survive it."""
    reqs = batch.reqs
    reqs.append(reqs[0])
    try:
        batch.filter_batch(keep_indices=order)
    finally:
        if batch.reqs is reqs:
            reqs.pop()


class FeatherSchedulePolicy(SchedulePolicy):
    """SGLang's ``fcfs`` policy with the waiting queue ordered by the Chunked Hash Tree."""

    def __init__(
        self,
        feather: FeatherSGLang,
        tree_cache: Any,
        enable_hierarchical_cache: bool = False,
        enable_priority_scheduling: bool = False,
        schedule_low_priority_values_first: bool = False,
        chunked_req: Callable[[], Req | None] = lambda: None,
    ):
        super().__init__(
            BASE_POLICY,
            tree_cache,
            enable_hierarchical_cache,
            enable_priority_scheduling,
            schedule_low_priority_values_first,
        )
        self.feather = feather
        self.chunked_req = chunked_req
        """The scheduler's request between prefill chunks (running, in no batch)."""

    def calc_priority(
        self,
        waiting_queue: list[Req],
        running_batch: ScheduleBatch | None = None,
        processed_tokens: int = 0,
    ) -> None:
        super().calc_priority(waiting_queue, running_batch, processed_tokens)
        if not self.feather.rank_waiting(waiting_queue, running_requests(
                running_batch, chunked=self.chunked_req())):
            waiting_queue.sort(key=self.fcfs_key)  # SGLang's own order, which Feather undid

    def fcfs_key(self, req: Req) -> tuple[int, float]:
        """SGLang's ``fcfs`` order: by queue entry (its list's order before Feather sorted
        it), after the priority class under priority scheduling."""
        entered = req.time_stats.wait_queue_entry_time
        if not self.enable_priority_scheduling:
            return 0, entered
        return req.priority * self.priority_sign, entered


class FeatherPrefillAdder(PrefillAdder):
    """SGLang's ``PrefillAdder`` that asks Feather about each request SGLang offers."""

    feather: FeatherSGLang
    """Set on the per-scheduler subclass (``FeatherSGLang.adder_class``)."""

    def add_one_req(self, req: Req, has_chunked_req: bool, truncation_align_size: int | None):
        """SGLang's admission of the request it offers, if Feather admits it; where there
        is no KV room for it, Feather's urgent victims are preempted together and SGLang's
        admission tried once more (its prefix matched afresh: a release may evict what it
        had matched)."""
        feather = self.feather
        if feather.stops(req):
            return AddReqResult.OTHER
        result = super().add_one_req(req, has_chunked_req, truncation_align_size)
        if result is AddReqResult.NO_TOKEN and not self._added(req) and \
                self._preempt_for(req, seat=False):
            req.init_next_round_input(self.tree_cache)
            result = super().add_one_req(req, has_chunked_req, truncation_align_size)
        while result is AddReqResult.NO_TOKEN and not self._added(req) and \
                feather.holds_yield(req, self._alone()):
            req.init_next_round_input(self.tree_cache)
            result = super().add_one_req(req, has_chunked_req, truncation_align_size)
        if self._added(req):
            feather.admitted(req)
        return result

    def _alone(self) -> bool:
        """Nothing runs and the round has admitted nothing: a request refused now would
        leave the engine idle."""
        batch = self.running_batch
        return not self.can_run_list and (batch is None or batch.is_empty())

    def _added(self, req: Req) -> bool:
        return bool(self.can_run_list) and self.can_run_list[-1] is req

    def preempt_to_schedule(self, req: Req) -> bool:
        """SGLang's priority preemption for ``req`` (every seat is taken), only if Feather
        would admit it (on STOP nothing is preempted and SGLang's round ends, as it would
        at ``add_one_req``), and then of Feather's urgent victims, which free a seat and
        the tokens SGLang's arithmetic asks for it; SGLang's own victims while Feather is
        out of the round."""
        feather = self.feather
        if feather.stops(req):
            return False
        if not feather.faults.serves:
            return super().preempt_to_schedule(req)
        return self._preempt_for(req, seat=True)

    def _preempt_for(self, req: Req, seat: bool) -> bool:
        """Preempt Feather's urgent victims for ``req`` (False: none), those that make
        ``preemption.Room`` (``seat``: one is needed), with SGLang's own release
        (``preemption.preempt``); counted as preemptions.  False too where the share gives
        the freed room to another request (``takes_freed_room``): SGLang then does not
        add ``req`` now (its round ends, for a seat)."""
        feather = self.feather
        if not feather.preempts or not preemption.usable(self):
            return False
        room = feather.faults.call("urgent_room", preemption.Room, self, req, seat)
        if room is None:
            return False
        victims = feather.urgent_victims(self.running_batch.reqs, req,
                                         self.priority_scheduling_preemption_threshold, room)
        if not victims:
            return False
        preemption.preempt(self, victims)
        feather.retracted(victims, urgent=True)
        return feather.takes_freed_room(req, victims)


# ---- scheduler hooks (applied by SGLang's HookRegistry) ------------------------------

_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"


def running_requests(*batches: ScheduleBatch | None, chunked: Req | None) -> list[Req]:
    """What SGLang runs: the requests of ``batches`` and the chunked request (between its
    chunks it is in no batch), less finished ones (their result already let them go)."""
    running: list[Req] = []
    seen: set[int] = set()
    for req in [r for b in batches if b is not None for r in b.reqs] + [chunked]:
        if req is not None and id(req) not in seen and not req.finished():
            seen.add(id(req))
            running.append(req)
    return running


def engine_shape(scheduler: Any) -> EngineShape | None:
    """The scheduler's device and model in Feather's terms (the model gate's prior);
    None where it has no model config.  Feather runs only without tensor or pipeline
    parallelism here (``_unsupported`` refuses them), so the shape is the whole model's."""
    model = getattr(scheduler, "model_config", None)
    if model is None:
        return None
    from sglang.srt.runtime_context import get_device
    from sglang.srt.utils.common import get_device_name

    return EngineShape.of(model, lambda: get_device_name(get_device().gpu_id or 0))


_process_feather: FeatherSGLang | None = None
"""The Feather of this process's scheduler (SGLang runs one scheduler per process), for
the hook on ``ScheduleBatch``'s retraction order, which sees only requests."""


def _hook_init_schedule_policy(original: Callable, scheduler: Any, *args: Any, **kwargs: Any):
    global _process_feather
    result = original(scheduler, *args, **kwargs)
    scheduler.feather = _process_feather = None  # no earlier scheduler's Feather acts here
    if not feather_enabled():
        return result
    reason = _unsupported(scheduler)
    if reason:
        raise FeatherConfigError(f"--schedule-policy feather cannot run in this SGLang "
                                 f"scheduler: {reason}; use one of SGLang's own policies")
    from sglang.srt.runtime_context import get_parallel

    dp_ranks = get_parallel().num_dp_ranks  # --dp-size: a scheduler process per rank
    dp_rank = (get_parallel().dp_rank or 0) if dp_ranks > 1 else 0  # stated at spawn
    feather = FeatherSGLang(feather_options(dp_rank=dp_rank, dp_ranks=dp_ranks),
                            seats=getattr(scheduler, "max_running_requests", None),
                            kv_tokens=getattr(scheduler, "max_total_num_tokens", None),
                            engine=engine_shape(scheduler),
                            priority_scheduling=scheduler.enable_priority_scheduling,
                            low_priority_values_first=scheduler.schedule_low_priority_values_first,
                            priority_preemption=getattr(scheduler, "enable_priority_preemption",
                                                        False))
    feather.start_sessions(scheduler.tree_cache,
                           getattr(scheduler, "max_total_num_tokens", None) or 1)
    scheduler.feather = _process_feather = feather
    scheduler.policy = FeatherSchedulePolicy(
        feather,
        scheduler.tree_cache,
        scheduler.enable_hierarchical_cache,
        scheduler.enable_priority_scheduling,
        scheduler.schedule_low_priority_values_first,
        chunked_req=lambda: scheduler.chunked_req,
    )
    logger.info("Feather scheduling policy: %s", feather.config)
    return result


def _hook_get_prefill_adder_class(original: Callable, scheduler: Any, *args: Any, **kwargs: Any):
    feather = getattr(scheduler, "feather", None)
    if feather is None:
        return original(scheduler, *args, **kwargs)
    return feather.adder_class


def _hook_add_request_to_queue(original: Callable, scheduler: Any, req: Any, *args: Any,
                               **kwargs: Any):
    feather = getattr(scheduler, "feather", None)
    if feather is not None:
        feather.refuse_bad_tenant(req)
    result = original(scheduler, req, *args, **kwargs)
    if feather is not None:
        waiting = scheduler.waiting_queue
        if waiting and waiting[-1] is req:
            feather.entered(req)
    return result


def _hook_release_aborted_request(original: Callable, scheduler: Any, req: Any, *args: Any,
                                  **kwargs: Any):
    result = original(scheduler, req, *args, **kwargs)
    feather = getattr(scheduler, "feather", None)
    if feather is not None:
        feather.dropped(req)
    return result


def _hook_get_new_batch_prefill(original: Callable, scheduler: Any, *args: Any,
                                **kwargs: Any):
    feather = getattr(scheduler, "feather", None)
    if feather is None:
        return original(scheduler, *args, **kwargs)
    started = time.perf_counter()
    running_batch = kwargs.get("running_batch", args[0] if args else None)
    feather.begin_round(running_requests(running_batch, chunked=scheduler.chunked_req),
                        scheduler.waiting_queue)
    plan = original(scheduler, *args, **kwargs)
    feather.end_round(running_requests(plan.running_batch, plan.batch_to_run,
                                       chunked=scheduler.chunked_req), started)
    return plan


def _hook_update_running_batch(original: Callable, scheduler: Any, batch: Any, *args: Any,
                               **kwargs: Any):
    feather = getattr(scheduler, "feather", None)
    if feather is not None:
        feather.order_running(batch)
    return original(scheduler, batch, *args, **kwargs)


def _hook_run_batch(original: Callable, scheduler: Any, batch: Any, *args: Any, **kwargs: Any):
    result = original(scheduler, batch, *args, **kwargs)
    feather = getattr(scheduler, "feather", None)
    if feather is not None:
        feather.launched(batch)
    return result


def _hook_process_batch_result(original: Callable, scheduler: Any, batch: Any, *args: Any,
                               **kwargs: Any):
    feather = getattr(scheduler, "feather", None)
    outputs = None if feather is None else feather.outputs(batch)
    result = original(scheduler, batch, *args, **kwargs)
    launched = getattr(batch, "launch_ts", None)
    if feather is not None and launched is not None:
        feather.processed(batch, time.monotonic() - launched, outputs)
    return result


def _hook_decode_retraction_order(original: Callable, reqs: list, *args: Any,
                                  **kwargs: Any) -> list[int]:
    """The order SGLang retracts decoding requests from (the end first): under Feather, its
    running order, so the newest member of the youngest group of the least urgent class
    goes first (``FeatherRuntime.preemption_victim``'s rule) instead of SGLang's
    fewest-output-tokens first (or its ``--retraction-policy priority``)."""
    feather = _process_feather
    order = None if feather is None else feather.retraction_order(reqs)
    return original(reqs, *args, **kwargs) if order is None else order


def _hook_check_decode_mem(original: Callable, batch: Any, *args: Any, **kwargs: Any) -> bool:
    """Whether the next decode step fits; where it does not, session holds yield first
    (least valuable first), before SGLang retracts a running request."""
    fits = original(batch, *args, **kwargs)
    feather = _process_feather
    while not fits and feather is not None and feather.holds_yield(None, alone=False):
        fits = original(batch, *args, **kwargs)
    return fits


def _hook_retract_decode(original: Callable, batch: Any, *args: Any, **kwargs: Any):
    """SGLang's retraction under memory pressure: its retracted requests are counted as
    preemptions."""
    result = original(batch, *args, **kwargs)
    feather = _process_feather
    if feather is not None:
        feather.retracted(result[0])
    return result


HOOKS: dict[str, Callable] = {
    f"{_SCHEDULER}.init_schedule_policy": _hook_init_schedule_policy,
    f"{_SCHEDULER}.get_prefill_adder_class": _hook_get_prefill_adder_class,
    f"{_SCHEDULER}._add_request_to_queue": _hook_add_request_to_queue,
    f"{_SCHEDULER}._release_aborted_request": _hook_release_aborted_request,
    f"{_SCHEDULER}.get_new_batch_prefill": _hook_get_new_batch_prefill,
    f"{_SCHEDULER}.update_running_batch": _hook_update_running_batch,
    f"{_SCHEDULER}.run_batch": _hook_run_batch,
    f"{_SCHEDULER}.process_batch_result": _hook_process_batch_result,
    "sglang.srt.managers.schedule_batch.ScheduleBatch._get_decode_retraction_order":
        _hook_decode_retraction_order,
    "sglang.srt.managers.schedule_batch.ScheduleBatch.retract_decode": _hook_retract_decode,
    "sglang.srt.managers.schedule_batch.ScheduleBatch.check_decode_mem":
        _hook_check_decode_mem,
}
"""Hook target -> AROUND hook; each is inert on a scheduler without ``feather``."""

_registered = False


def register() -> None:
    """Register Feather's scheduler hooks with SGLang (idempotent; a general plugin).

    They take effect when SGLang's ``load_plugins()`` applies its ``HookRegistry``, as every
    scheduler process does first thing.
    """
    global _registered
    if _registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookSource, HookType

    source = HookSource(plugin_name="feather", dist_name="feather-sched")
    for target, hook in HOOKS.items():
        HookRegistry.register(target, hook, HookType.AROUND, source=source)
    _registered = True


def _unsupported(scheduler: Any) -> str | None:
    """Why Feather cannot drive this scheduler, or None (then start-up is refused)."""
    from sglang.srt.runtime_context import get_disagg, get_parallel

    mode = getattr(get_disagg(), "disaggregation_mode", "null")
    if mode not in (None, "null"):
        return f"PD disaggregation ({mode}) schedules through its own queues"
    if getattr(scheduler, "dllm_config", None) is not None:
        return "diffusion LLM scheduling builds its own PrefillAdder"
    parallel = get_parallel()
    if getattr(parallel, "pp_size", 1) > 1:
        return "pipeline parallelism schedules per micro-batch"
    if getattr(parallel, "tp_size", 1) > 1:
        return (f"tensor parallelism (tp_size {parallel.tp_size}) runs one scheduler per "
                "rank, and every rank must form the same batches; Feather's decisions read "
                "per-process inputs (its clock, the step times its gate learns from), and a "
                "fault it contains on one rank would put that rank alone on SGLang's order: "
                "the ranks would diverge and hang the group")
    if getattr(scheduler, "enable_pdmux", False):
        return "PD multiplexing runs its own split-prefill loop"
    if getattr(scheduler, "enable_hisparse", False):
        return "hierarchical sparse attention stages requests outside SGLang's queues"
    return None
