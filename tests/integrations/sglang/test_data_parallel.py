"""Feather's files under SGLang's data parallelism (``--dp-size``): SGLang runs a scheduler
process per rank, stating its rank at spawn; each rank's Feather writes its own files.
The scheduler hook runs as in ``test_sglang`` (SGLang's real parallel context, a stub
scheduler), with the rank SGLang's data-parallel controller would state."""

from __future__ import annotations

import pytest

from feather_sched.bench.cht.sglang_policy import published_server_args, sglang_installed

if not sglang_installed():
    pytest.skip("SGLang is not installed", allow_module_level=True)

from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.runtime_context import get_parallel

from feather_sched.integrations.sglang import scheduler as feather_sglang
from tests.integrations.sglang.test_scheduler import _stub_scheduler


@pytest.mark.parametrize(("dp_rank", "dp_ranks", "name"), [
    (None, 1, "stats.json"), (0, 2, "stats.rank0.json"), (1, 2, "stats.rank1.json")])
def test_each_data_parallel_rank_writes_its_own_files(monkeypatch, tmp_path, dp_rank: int,
                                                      dp_ranks: int, name: str) -> None:
    monkeypatch.setattr(feather_sglang, "_process_feather", None)  # restored afterwards
    monkeypatch.setenv("FEATHER_SGLANG", "1")
    monkeypatch.setenv("FEATHER_STATS_FILE", str(tmp_path / "stats.json"))
    scheduler = _stub_scheduler(RadixCache.create_simulated())
    with published_server_args(), get_parallel().override(dp_rank=dp_rank,
                                                          num_dp_ranks=dp_ranks):
        feather_sglang._hook_init_schedule_policy(lambda s: None, scheduler)
    feather = scheduler.feather
    assert feather.config.stats_file == str(tmp_path / name)
    feather.runtime.close()
    assert [p.name for p in tmp_path.iterdir()] == [name]
