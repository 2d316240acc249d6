"""FeatherScheduler on the real vLLM engine (CPU build, tiny random-weight model, in-process)."""

from __future__ import annotations

import os
from collections import Counter

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
vllm = pytest.importorskip("vllm", reason="the vllm extra is not installed")

import numpy as np  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

from feather_sched.core.cht import ChunkedHashTree  # noqa: E402
from feather_sched.core.tenants import service_of  # noqa: E402
from feather_sched.integrations.vllm.scheduler import (  # noqa: E402
    FeatherScheduler,
    FeatherSyncScheduler,
)
from feather_sched.models import TINY_LLAMA  # noqa: E402
from feather_sched.telemetry.prometheus import PrometheusSink  # noqa: E402
from tests.helpers.faults import Injector  # noqa: E402
from tests.helpers.vllm_engines import shut_down  # noqa: E402

BLOCK = 128
KV_BYTES_PER_TOKEN = 2 * 8 * 64 * 2 * 2  # layers x KV heads x head dim x (K, V) x bf16


class RecordingScheduler(FeatherSyncScheduler):
    """Counts preemptions and records which requests run after every step (CPU: sync)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.preemptions = 0
        self.running_per_step: list[list[str]] = []

    def _preempt_request(self, request, *args, **kwargs) -> None:
        self.preemptions += 1
        super()._preempt_request(request, *args, **kwargs)

    def schedule(self, *args, **kwargs):
        output = super().schedule(*args, **kwargs)
        self.running_per_step.append([r.request_id for r in self.running])
        return output


def make_llm(scheduler_cls=None, feather: dict | None = None, kv_blocks: int = 512,
             **engine) -> LLM:
    extra = dict(engine)
    if scheduler_cls is not None:
        extra["scheduler_cls"] = scheduler_cls
    if feather is not None:
        extra["additional_config"] = {"feather": feather}
    return LLM(model=str(TINY_LLAMA), load_format="dummy", skip_tokenizer_init=True,
               enforce_eager=True, seed=0, max_model_len=2048, block_size=BLOCK,
               kv_cache_memory_bytes=kv_blocks * BLOCK * KV_BYTES_PER_TOKEN, **extra)


def group_prompts(groups: int, per_group: int, prefix_blocks: int = 4,
                  seed: int = 0) -> list[tuple[int, list[int]]]:
    """(group, prompt) pairs, interleaved: each group's prefix + a 20-token suffix."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(1, 32000, prefix_blocks * BLOCK).tolist() for _ in range(groups)]
    return [(i % groups, prefixes[i % groups] + rng.integers(1, 32000, 20).tolist())
            for i in range(groups * per_group)]


def scheduler_of(llm: LLM) -> FeatherScheduler:
    return llm.llm_engine.engine_core.engine_core.scheduler


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run_to_completion(llm: LLM, prompts: list[list[int]], max_tokens: int | list[int],
                      abort_after_steps: dict[int, list[str]] | None = None) -> list:
    """Drive the engine step by step; returns every finished RequestOutput."""
    engine = llm.llm_engine
    lengths = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    for i, (prompt, length) in enumerate(zip(prompts, lengths, strict=True)):
        engine.add_request(f"r{i}", TokensPrompt(prompt_token_ids=prompt), greedy(length))
    finished, step = [], 0
    while engine.has_unfinished_requests():
        if step in (abort_after_steps or {}):
            engine.abort_request(abort_after_steps[step])
        finished += [out for out in engine.step() if out.finished]
        step += 1
    return finished


def external_id(internal_id: str) -> str:
    """vLLM suffixes request ids internally ("r3" becomes "r3-1a2b3c4d")."""
    return internal_id.rsplit("-", 1)[0]


@pytest.fixture(scope="module")
def default_outputs():
    prompts = [p for _, p in group_prompts(groups=3, per_group=6)]
    llm = make_llm()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], greedy(12))
    shut_down(llm)
    return prompts, [list(o.outputs[0].token_ids) for o in outputs]


def test_greedy_outputs_equal_the_default_schedulers(default_outputs) -> None:
    prompts, expected = default_outputs
    llm = make_llm(RecordingScheduler, {"gate": "chunk-loss",
                                        "gate_options": {"max_loss": 0, "floor_start": 0,
                                                         "floor_step": 0}})
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], greedy(12))
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    assert scheduler_of(llm).feather.runtime.counts.stop > 0


def test_faults_in_feathers_code_leave_the_engines_outputs(default_outputs, monkeypatch,
                                                           contained_faults, caplog) -> None:
    """The real engine, greedy: exceptions from the tree, the gate, the meter, the metrics
    sink and the running order at random passes; then one in every decision until
    Feather is off.  Outputs are the default scheduler's token for token, every request
    finishes once, each fault is counted once, and Feather turns off with one line."""
    prompts, expected = default_outputs
    llm = make_llm(RecordingScheduler, {"gate": "bandit"})
    scheduler = scheduler_of(llm)
    runtime = scheduler.feather.runtime
    runtime.meter.sink = PrometheusSink("engine-faults")
    injector = Injector(monkeypatch, seed=3, rate=0.3)
    injector.target_all()
    schedule = scheduler.schedule

    def schedule_meeting_faults(*args, **kwargs):
        injector.next_pass()
        return schedule(*args, **kwargs)

    monkeypatch.setattr(scheduler, "schedule", schedule_meeting_faults)

    def outputs(stagger: bool = False) -> list[list[int]]:
        """Every prompt at once, or one more at each step (each step then decides)."""
        engine, arrivals, finished = llm.llm_engine, list(enumerate(prompts)), []
        while arrivals or engine.has_unfinished_requests():
            for i, prompt in arrivals[:1] if stagger else arrivals:
                engine.add_request(f"r{i}", TokensPrompt(prompt_token_ids=prompt), greedy(12))
            arrivals = arrivals[1:] if stagger else []
            finished += [out for out in engine.step() if out.finished]
        ids = sorted(external_id(o.request_id) for o in finished)
        assert ids == sorted(f"r{i}" for i in range(len(prompts)))  # each exactly once
        tokens = {external_id(o.request_id): list(o.outputs[0].token_ids) for o in finished}
        return [tokens[f"r{i}"] for i in range(len(prompts))]

    assert outputs() == expected
    assert outputs() == expected  # the cache warm now: other passes
    assert len(injector.raised) == len(contained_faults) == runtime.meter.stats.faults > 2
    assert runtime.faults.active and runtime.counts.add > 0
    injector.armed = False
    runtime.faults.limit = 3
    monkeypatch.setattr(ChunkedHashTree, "best", lambda *args: 1 / 0)
    assert outputs(stagger=True) == expected
    assert not runtime.faults.active
    assert [where for where, _ in contained_faults[len(injector.raised):]] == ["decide"] * 3
    assert caplog.text.count("Feather is off") == 1


def test_stop_holds_other_groups_back_until_the_batch_drains() -> None:
    strict = {"gate": "chunk-loss", "max_wait_s": None, "max_stops": None,
              "gate_options": {"max_loss": 0, "max_loss_loaded": 0, "floor_start": 0,
                               "floor_step": 0}}
    groups_seen = {}
    for name, options in (("always", {"gate": "always"}), ("feather", strict)):
        llm = make_llm(RecordingScheduler, options)
        pairs = group_prompts(groups=2, per_group=6)
        run_to_completion(llm, [p for _, p in pairs], max_tokens=6)
        group_of = {f"r{i}": g for i, (g, _) in enumerate(pairs)}
        steps = scheduler_of(llm).running_per_step
        groups_seen[name] = max(len({group_of[external_id(r)] for r in step})
                                for step in steps if step)
        sizes = [len(step) for step in steps]
        if name == "feather":
            assert max(sizes) == 6, sizes
        shut_down(llm)
    assert groups_seen == {"always": 2, "feather": 1}


def test_every_request_ends_once_with_aborts_and_preemption() -> None:
    llm = make_llm(RecordingScheduler, {"gate": "bandit", "gate_options": {"seed": 1}},
                   kv_blocks=24)
    pairs = group_prompts(groups=3, per_group=5, prefix_blocks=3)
    aborted = ["r1", "r7", "r12"]
    finished = run_to_completion(llm, [p for _, p in pairs], max_tokens=150,
                                 abort_after_steps={3: aborted})
    ids = [out.request_id for out in finished]
    assert len(ids) == len(set(ids))
    completed = {out.request_id for out in finished
                 if len(out.outputs[0].token_ids) == 150}
    assert completed | set(aborted) == {f"r{i}" for i in range(len(pairs))}
    assert not completed & set(aborted)
    scheduler = scheduler_of(llm)
    assert scheduler.preemptions > 0
    runtime = scheduler.feather.runtime
    assert len(runtime) == 0 and runtime.queue.num_running == 0 and not runtime._record.tracked


def test_fair_share_seats_a_second_tenant_before_a_flood_drains_and_counts_its_work(
        ) -> None:
    """Ten requests of one tenant behind one 512-token prefix, then three of another
    sharing nothing, four seats, fair share on: the other tenant's requests are all
    admitted before the flood's last.  The runtime is charged, per tenant, exactly the
    prompt tokens vLLM reports it did not serve from its prefix cache and the tokens it
    generated (no preemption here: nothing recomputed)."""
    llm = make_llm(RecordingScheduler, {"gate": "always", "fairness": "tenants"},
                   max_num_seqs=4)
    scheduler = scheduler_of(llm)
    share = scheduler.feather.runtime.queue.share
    charged: Counter[str] = Counter()
    charge = share.charge

    def spying_charge(tenant, computed_tokens, output_tokens):
        charged[tenant] += service_of(computed_tokens, output_tokens)
        return charge(tenant, computed_tokens, output_tokens)

    share.charge = spying_charge
    rng = np.random.default_rng(3)
    prefix = rng.integers(1, 32000, 4 * BLOCK).tolist()
    prompts = {f"flood{i}": prefix + rng.integers(1, 32000, 20).tolist() for i in range(10)}
    prompts |= {f"other{i}": rng.integers(1, 32000, 300).tolist() for i in range(3)}
    engine = llm.llm_engine
    for rid, prompt in prompts.items():
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                extra_args={"tenant": rid.rstrip("0123456789")})
        engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), params)
    finished = []
    while engine.has_unfinished_requests():
        finished += [out for out in engine.step() if out.finished]
    admitted = list(dict.fromkeys(external_id(r) for step in scheduler.running_per_step
                                  for r in step))
    assert max(admitted.index(f"other{i}") for i in range(3)) < admitted.index(admitted[-1])
    assert admitted[-1].startswith("flood"), admitted
    assert scheduler.preemptions == 0 and len(finished) == len(prompts)
    done: Counter[str] = Counter()
    for out in finished:
        done[out.request_id.rstrip("0123456789")] += service_of(
            len(out.prompt_token_ids) - out.num_cached_tokens, len(out.outputs[0].token_ids))
    assert charged == done
    assert sum(o.num_cached_tokens for o in finished) >= 8 * 4 * BLOCK  # the flood's hits
    assert all(share.service(tenant) >= done[tenant] for tenant in done)  # lifts add


def test_bad_feather_options_fail_at_startup() -> None:
    with pytest.raises(Exception, match="feather option 'gate': must be one of"):
        make_llm(FeatherScheduler, {"gate": "greedy"})


def test_feather_scheduler_builds_the_variant_the_engine_mode_needs() -> None:
    llm = make_llm(FeatherScheduler, {"gate": "bandit"})
    assert type(scheduler_of(llm)) is FeatherSyncScheduler  # vLLM on CPU: no async
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for _, p in group_prompts(2, 2)],
                           greedy(3))
    assert [len(o.outputs[0].token_ids) for o in outputs] == [3, 3, 3, 3]


def test_a_subclass_of_the_wrong_base_is_refused() -> None:
    class AsyncOnly(FeatherScheduler):
        pass

    with pytest.raises(Exception, match="does not match async scheduling off"):
        make_llm(AsyncOnly)


def test_step_log_feeds_feather_calibrate(tmp_path) -> None:
    from feather_sched.telemetry.steplog import read_steps

    log = tmp_path / "steps.csv"
    llm = make_llm(FeatherScheduler, {"gate": "always", "step_log": str(log)})
    pairs = group_prompts(groups=2, per_group=3)
    llm.generate([TokensPrompt(prompt_token_ids=p) for _, p in pairs], greedy(4))
    steps = read_steps(log)
    assert len(steps) >= 4
    decode = steps[-1][0]
    assert len(decode) == 6 and all(e.new_tokens == 1 for e in decode)
    groups = [e.group for e in decode]
    assert len(set(groups)) == 2 and groups[:3] == [groups[0]] * 3  # ordered by group
    assert all(e.shared_tokens == 4 * BLOCK for e in decode)
    assert all(seconds > 0 for _, seconds in steps)
