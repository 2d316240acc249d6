"""``feather sim``: the serving simulator's runs, reported like ``feather bench``.

One workload, several policies, each on a fresh simulated engine with the same cost
model; the report is vLLM's benchmark block plus the model's own figures (HBM bytes per
output token, modelled L2 hit rate) and the ratio table.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from feather_sched.core.runtime import FeatherRuntime
from feather_sched.costmodel.calibrate import load_profile
from feather_sched.costmodel.cost import CostModel, CostParams
from feather_sched.costmodel.hardware import HARDWARE, HardwareProfile, load_hardware
from feather_sched.costmodel.model_profiles import MODELS, ModelProfile
from feather_sched.results.records import RequestRecord, RunResult
from feather_sched.scheduler_names import SIM_KINDS, parse_scheduler
from feather_sched.sim.engine import EngineConfig, SimEngine, SimResult
from feather_sched.sim.policies import make_policy
from feather_sched.workloads.spec import Workload

KV_MEMORY_FRACTION = 0.9
"""vLLM's default gpu_memory_utilization: what weights and KV cache may use together."""
BLOCK_TOKENS = 16
"""vLLM's KV block size on GPUs: the simulated engine's block unless a plan sets another."""


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
        return EngineConfig(block_tokens=BLOCK_TOKENS,
                            num_blocks=kv_pool_blocks(self.hardware, self.model, BLOCK_TOKENS))

    @classmethod
    def from_options(cls, workload: Workload, *, hardware: str = "h100-sxm",
                     model: str = "llama-3-8b", profile: str | Path | None = None,
                     schedulers: Sequence[str] = ("fcfs", "feather-bandit"),
                     feather_options: dict[str, Any] | None = None, cascade: bool = False,
                     kv_cache_gib: float | None = None, **engine: Any) -> SimPlan:
        """The plan ``feather sim``'s options describe: ``hardware`` and ``model`` by name
        (``hardware`` also a hardware JSON file) with the default cost parameters, or a
        calibrated ``profile`` (its hardware, model and parameters); ``engine`` are
        ``EngineConfig``'s fields (``block_tokens``, ``max_num_seqs``, ...).  The KV pool
        holds ``num_blocks`` where given, else ``kv_cache_gib`` where given, else what the
        device's memory holds beside the weights.  ValueError (or OSError, for a profile
        that cannot be read) naming what is wrong."""
        if profile is not None:
            hw, mp, params = load_profile(profile)
        else:
            hw, mp, params = hardware_named(hardware), model_named(model), CostParams()
        block_tokens = engine.setdefault("block_tokens", BLOCK_TOKENS)
        if "num_blocks" not in engine:
            engine["num_blocks"] = (kv_pool_blocks(hw, mp, block_tokens) if kv_cache_gib is None
                                    else int(kv_cache_gib * 2**30
                                             // (mp.kv_bytes_per_token * block_tokens)))
        elif kv_cache_gib is not None:
            raise ValueError("give the KV pool as num_blocks or as kv_cache_gib, not both")
        return cls(workload=workload, hardware=hw, model=mp, params=params,
                   schedulers=list(schedulers), feather_options=dict(feather_options or {}),
                   cascade=cascade, engine=EngineConfig(**engine))


def kv_pool_blocks(hardware: HardwareProfile, model: ModelProfile, block_tokens: int) -> int:
    """KV blocks of ``block_tokens`` that vLLM's default memory share leaves for the KV
    cache beside ``model``'s weights on ``hardware`` (ValueError where nothing is left)."""
    kv_bytes = hardware.memory_bytes * KV_MEMORY_FRACTION - model.weight_bytes
    if kv_bytes <= 0:
        raise ValueError(f"{model.name} does not fit in {hardware.name}")
    return int(kv_bytes // (model.kv_bytes_per_token * block_tokens))


def hardware_named(name: str) -> HardwareProfile:
    """A datasheet profile by name (``HARDWARE``), or a hardware JSON file."""
    if name in HARDWARE:
        return HARDWARE[name]
    if Path(name).exists():
        return load_hardware(name)
    raise ValueError(unknown("hardware", name, HARDWARE))


def model_named(name: str) -> ModelProfile:
    """A model profile by name (``MODELS``)."""
    if name in MODELS:
        return MODELS[name]
    raise ValueError(unknown("model", name, MODELS))


def unknown(kind: str, name: str, known: dict) -> str:
    return (f"unknown {kind} {name!r}; choose from {', '.join(known)} "
            "or give a profile file")


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
            assert isinstance(policy, FeatherRuntime)
            engine.run(workload, policy)
            policy.meter.gate.save(state_file)
            pulls = sum(arm.pulls for arms in policy.meter.gate.table.values()
                        for arm in arms.values())
    return pulls
