"""``WorkloadArgs``: the workload options ``feather bench`` and ``feather sim`` share, and the
one place that turns them into a ``Workload`` (a generator, a trace or a dataset)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from feather_sched.workloads.datasets import load_dataset
from feather_sched.workloads.spec import ArrivalSpec, Workload, prioritized, tenanted
from feather_sched.workloads.synthetic import (
    long_documents,
    minority_groups,
    multi_tenant,
    multi_turn_chat,
    no_sharing,
    shared_prefix_groups,
)
from feather_sched.workloads.traces import Replay, load_jsonl, load_mooncake

WORKLOADS = ("shared-prefix", "minority", "long-docs", "chat", "no-sharing", "multi-tenant")


@dataclass
class WorkloadArgs:
    """The generator knobs ``feather bench`` and ``feather sim`` expose."""

    kind: str = "shared-prefix"
    trace: Path | None = None
    groups: int = 4
    prompts_per_group: int = 16
    prefix_len: int = 8192
    suffix_len: int = 32
    output_len: int = 64
    jitter: float = 0.0
    order: str = "shuffled"
    request_rate: float | None = None
    burstiness: float = 1.0
    minority_size: int = 20
    """``minority``: requests of each small group (``groups - 1`` of them; the majority
    has ``prompts_per_group``)."""
    high_priority_share: float = 0.0
    """In [0, 1]: a seeded random share of the requests in priority class 0 and the rest
    in class 1 (``workloads.spec.prioritized``); 0 keeps the workload's own classes (a trace's,
    else one class)."""
    tenants: int = 1
    """Spread the requests over this many tenants (``workloads.spec.tenanted``: a prefix group
    in one tenant); 1 keeps the workload's own (a trace's, else one).  ``multi-tenant``
    has ``groups`` tenants of its own."""
    prefixes_per_tenant: int = 0
    """``multi-tenant``: the odd tenants draw their prompts from this many long prefixes
    of their own each (DLPM's setting; 0: unshared prompts)."""
    seed: int = 0
    dataset_name: str | None = None
    """Real prompts (``datasets.DATASETS``) instead of a generator; they arrive at
    ``request_rate`` (Poisson), else all at once."""
    dataset_path: Path | None = None
    tokenizer: str | Path | None = None
    """The dataset's tokenizer (``datasets.load_tokenizer``)."""
    start: int = 0
    max_requests: int | None = None
    trace_speed: float = 1.0
    token_scale: float = 1.0
    dataset_output_len: int | None = None
    """Every output length of a trace or dataset (None: their own)."""

    def build(self) -> Workload:
        """The workload (ValueError for a bad knob)."""
        workload = self._generate()
        if self.dataset_output_len is not None:
            workload = Workload(workload.name, [replace(r, output_len=self.dataset_output_len)
                                                for r in workload])
        if self.tenants > 1:
            if self.kind == "multi-tenant" and self.trace is None and not self.dataset_name:
                raise ValueError("multi-tenant has --groups tenants of its own; leave "
                                 "--tenants at 1")
            workload = tenanted(workload, self.tenants)
        if self.high_priority_share == 0:
            return workload
        return prioritized(workload, self.high_priority_share, seed=self.seed)

    def _generate(self) -> Workload:
        replay = Replay(self.start, self.max_requests, self.trace_speed, self.token_scale)
        if self.trace is not None and self.dataset_name is not None:
            raise ValueError("give a trace or a dataset name, not both")
        if self.trace is not None:
            return load_trace(self.trace, replay)
        if self.dataset_name is not None:
            if replay.speed != 1 or replay.token_scale != 1:
                raise ValueError("trace speed and token scale are for traces; a dataset "
                                 "arrives at the request rate")
            return load_dataset(self.dataset_name, path=self.dataset_path,
                                tokenizer=self.tokenizer, start=self.start,
                                max_requests=self.max_requests,
                                arrival=self._arrival(), seed=self.seed)
        if replay != Replay() or self.dataset_path or self.dataset_output_len:
            raise ValueError("start, max requests, trace speed, token scale, dataset path and "
                             "dataset output length are for traces and datasets")
        if self.prefixes_per_tenant and self.kind != "multi-tenant":
            raise ValueError("prefixes per tenant are multi-tenant's")
        arrival = self._arrival()
        common = {"output_len": self.output_len, "arrival": arrival, "seed": self.seed}
        if self.kind == "shared-prefix":
            return shared_prefix_groups(
                groups=self.groups, prompts_per_group=self.prompts_per_group,
                prefix_len=self.prefix_len, suffix_len=self.suffix_len, jitter=self.jitter,
                order=self.order, **common)
        if self.kind == "minority":
            return minority_groups(
                majority=self.prompts_per_group,
                minorities=[self.minority_size] * max(1, self.groups - 1),
                prefix_len=self.prefix_len, suffix_len=self.suffix_len, **common)
        if self.kind == "long-docs":
            return long_documents(
                documents=self.groups, questions_per_document=self.prompts_per_group,
                doc_len_range=(self.prefix_len, 2 * self.prefix_len), order=self.order,
                **common)
        if self.kind == "chat":
            return multi_turn_chat(
                conversations=self.groups, turns=self.prompts_per_group,
                system_prompt_len=self.prefix_len, user_turn_len=self.suffix_len,
                assistant_turn_len=self.output_len, **common)
        if self.kind == "no-sharing":
            return no_sharing(requests=self.groups * self.prompts_per_group,
                              prompt_len=self.prefix_len + self.suffix_len,
                              jitter=self.jitter, **common)
        if self.kind == "multi-tenant":
            return multi_tenant(tenants=self.groups, requests_per_tenant=self.prompts_per_group,
                                prefix_len=self.prefix_len, suffix_len=self.suffix_len,
                                prefixes_per_tenant=self.prefixes_per_tenant, **common)
        raise ValueError(f"unknown workload {self.kind!r}; choose from {', '.join(WORKLOADS)}")

    def _arrival(self) -> ArrivalSpec | None:
        if self.request_rate is None:
            return None
        kind = "poisson" if self.burstiness == 1.0 else "bursty"
        return ArrivalSpec(kind=kind, rate=self.request_rate)


def load_trace(path: Path, replay: Replay | None = None) -> Workload:
    """A feather JSONL trace, or a Mooncake trace (recognised by its first line), with
    ``replay``'s window, speed and (Mooncake only) token scale."""
    replay = replay or Replay()
    with open(path) as handle:
        first = handle.readline()
    if '"hash_ids"' in first:
        return load_mooncake(path, replay=replay)
    return replay.apply(load_jsonl(path))
