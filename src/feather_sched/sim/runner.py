"""``feather sim``: the serving simulator's runs, reported like ``feather bench``.

One workload, several policies, each on a fresh simulated engine with the same cost
model; the report is vLLM's benchmark block plus the model's own figures (HBM bytes per
output token, modelled L2 hit rate) and the ratio table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from feather_sched.core.runtime import FeatherRuntime
from feather_sched.costmodel.cost import CostModel, CostParams
from feather_sched.costmodel.hardware import HardwareProfile
from feather_sched.costmodel.model_profiles import ModelProfile
from feather_sched.results.records import RequestRecord, RunResult
from feather_sched.scheduler_names import SIM_KINDS, parse_scheduler
from feather_sched.sim.engine import EngineConfig, SimEngine, SimResult
from feather_sched.sim.policies import make_policy
from feather_sched.workloads.spec import Workload

KV_MEMORY_FRACTION = 0.9
"""vLLM's default gpu_memory_utilization: what weights and KV cache may use together."""


@dataclass
class SimPlan:
    workload: Workload
    hardware: HardwareProfile
    model: ModelProfile
    params: CostParams = field(default_factory=CostParams)
    schedulers: list[str] = field(default_factory=lambda: ["fcfs", "feather-bandit"])
    feather_options: dict[str, Any] = field(default_factory=dict)
    cascade: bool = False
    engine: EngineConfig | None = None
    """Default: vLLM's GPU limits and a KV pool sized from the device's memory."""

    def cost_model(self, scheduler: str) -> CostModel:
        """The step-cost model of one scheduler's run: a cascade kernel where its name ends
        in ``-shared``, none for ``-noshared``, else as ``cascade`` says."""
        shared = parse_scheduler(scheduler, SIM_KINDS).shared_prefix
        cascade = self.cascade if shared is None else shared
        return CostModel(self.hardware, self.model, self.params, cascade=cascade)

    def engine_config(self) -> EngineConfig:
        if self.engine is not None:
            return self.engine
        block_tokens = 16
        kv_bytes = self.hardware.memory_bytes * KV_MEMORY_FRACTION - self.model.weight_bytes
        if kv_bytes <= 0:
            raise ValueError(f"{self.model.name} does not fit in {self.hardware.name}")
        blocks = int(kv_bytes // (self.model.kv_bytes_per_token * block_tokens))
        return EngineConfig(block_tokens=block_tokens, num_blocks=blocks)


def simulate(plan: SimPlan, name: str,
             on_done: Callable[[RequestRecord], None] | None = None) -> RunResult:
    """One policy's simulated run, as the benchmark report takes it."""
    engine = SimEngine(plan.cost_model(name), plan.engine_config())
    policy = make_policy(name, plan.feather_options, engine)
    result = engine.run(plan.workload, policy, on_done)
    run = as_run_result(result, policy, name)
    classes = len(plan.workload.priority_classes)
    priority = parse_scheduler(name, SIM_KINDS).priority_policy(classes)
    run.scheduling_policy = "priority" if priority else "fcfs"
    return run


def as_run_result(result: SimResult, policy: Any, name: str) -> RunResult:
    run = result.run_result()
    run.name = name
    if isinstance(policy, FeatherRuntime):
        run.gate_counts = asdict(policy.counts)
    run.extra = {
        "hbm_bytes_per_output_token": result.costs.hbm_bytes_per_output_token,
        "modelled_l2_hit_rate": result.costs.l2_hit_rate,
        "scheduler_cpu_s": result.scheduler_cpu_s + result.modelled_scheduler_s,
    }
    return run


PRETRAIN_FAMILY = (
    # (groups, prompts per group, prefix tokens, output tokens): the paper's ranges.
    (1, 64, 4096, 50), (4, 32, 1024, 50), (8, 32, 4096, 100), (8, 64, 10240, 50),
    (16, 16, 2048, 200), (32, 8, 8192, 50), (100, 8, 5120, 50), (64, 16, 512, 100),
)


def pretrain_bandit(plan: SimPlan, state_file: str, rounds: int,
                    workload_of: Callable[[int, int, int, int, int], Workload]) -> int:
    """Run the bandit gate over ``PRETRAIN_FAMILY`` ``rounds`` times, one table throughout.

    Each run warm-starts from ``state_file`` and saves back to it, exactly as a server
    would across restarts; returns the number of learned decisions in the table.
    """
    options = {**plan.feather_options, "state_file": state_file}
    engine = SimEngine(plan.cost_model("feather-bandit"), plan.engine_config())
    pulls = 0
    for round_index in range(rounds):
        for shape in PRETRAIN_FAMILY:
            workload = workload_of(*shape, round_index)
            policy = make_policy("feather-bandit", options, engine)
            engine.run(workload, policy)
            policy.queue.gate.save(state_file)
            pulls = sum(arm.pulls for arms in policy.queue.gate.table.values()
                        for arm in arms.values())
    return pulls
