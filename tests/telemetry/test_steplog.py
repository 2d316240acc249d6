"""The step log: one format written and read whole, even when a write is cut short, and
several logs read as one."""

from __future__ import annotations

import os
import resource
import subprocess
import sys

import pytest

from feather_sched.telemetry.steplog import (
    BatchEntry,
    StepLogWriter,
    log_files,
    read_logs,
    read_steps,
    write_steps,
)

HEADER = "step,position,group,shared_tokens,context_tokens,new_tokens,seconds\n"
STEP = [BatchEntry("g1", 128, 300, 1), BatchEntry("g1", 128, 301, 1), BatchEntry("g2", 0, 50, 50)]


def test_steps_round_trip_and_empty_steps_vanish(tmp_path) -> None:
    path = tmp_path / "steps.csv"
    write_steps(path, [(STEP, 0.25), ([], 0.1), (STEP[:1], 0.5)])
    assert read_steps(path) == [(STEP, 0.25), (STEP[:1], 0.5)]


def test_a_writer_continues_a_log_and_cuts_a_partial_last_line(tmp_path) -> None:
    path = tmp_path / "steps.csv"
    writer = StepLogWriter(path)
    writer.append(STEP, 0.25)
    writer.append([], 1.0)
    writer.close()
    with open(path, "a") as file:
        file.write("1,0,g1,12")  # an engine killed mid-write
    writer = StepLogWriter(path)
    assert writer.next_step == 1
    writer.append(STEP[:2], 0.5)
    writer.close()
    assert read_steps(path) == [(STEP, 0.25), (STEP[:2], 0.5)]


def test_a_failed_write_leaves_the_log_whole(tmp_path) -> None:
    """Run in a child with a file-size limit, so the write hits EFBIG mid-way."""
    path = tmp_path / "steps.csv"
    script = f"""
import resource, signal
from feather_sched.telemetry.steplog import BatchEntry, StepLogWriter
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
writer = StepLogWriter({str(path)!r})
writer.append([BatchEntry("g", 1, 2, 1)], 0.5)
resource.setrlimit(resource.RLIMIT_FSIZE, (300, 300))
try:
    writer.append([BatchEntry("g" * 40, 1, 2, 1)] * 10, 0.5)
except OSError as error:
    print("failed", error.errno)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=True)
    assert done.stdout.startswith("failed"), done.stdout + done.stderr
    assert read_steps(path) == [([BatchEntry("g", 1, 2, 1)], 0.5)]
    assert os.path.getsize(path) < 300 and resource.RLIMIT_FSIZE


@pytest.mark.parametrize(("rows", "message"), [
    ("step,position,group,shared_tokens,context_tokens,new_tokens\n0,0,a,0,1,1\n",
     r"line 1: missing column\(s\) seconds"),
    (HEADER + "0,0,a,0,1,1,0.1\n0,1,a,0,x,1,0.1\n", r"line 3: column 'context_tokens'"),
    (HEADER + "0,0,a,-5,1,1,0.1\n", r"line 2: column 'shared_tokens'.*-5"),
    (HEADER + "0,0,a,0,1,1,0.1\n0,1,a,0,1,1,0.2\n", r"line 3: column 'seconds'"),
    (HEADER + "0,0,a,0,1,1,0.1\n0,0,a,0,1,1,0.1\n", r"line 3: column 'position'"),
    (HEADER + "0,0,a,5,1,1,0.1\n", r"line 2: column 'shared_tokens'"),
    (HEADER + "0,0,a,0,1\n", r"line 2: column 'new_tokens'"),
])
def test_malformed_csv_names_the_line(tmp_path, rows: str, message: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(rows)
    with pytest.raises(ValueError, match=message):
        read_steps(path)


@pytest.mark.parametrize(("tail", "kept"), [
    ("2,0,g1,12", 2),  # the first row of step 2 cut short: steps 0 and 1 stay
    ("1,2,g2,0,5", 1),  # the third row of step 1 cut short: its two rows before go too
    ("1", 1),  # cut inside the step number, which may be step 1's
    ("2", 2),  # ... or may not
])
def test_a_step_cut_short_at_the_end_is_skipped_with_a_warning(tmp_path, caplog, tail: str,
                                                                kept: int) -> None:
    """What another writer, or an engine killed mid-write, leaves: never an error."""
    path = tmp_path / "steps.csv"
    write_steps(path, [(STEP, 0.25), (STEP[:2], 0.5)])
    with open(path, "a") as file:
        file.write(tail)
    with caplog.at_level("WARNING", logger="feather_sched"):
        assert read_steps(path) == [(STEP, 0.25), (STEP[:2], 0.5)][:kept]
    assert "its last step was cut short" in caplog.text
    writer = StepLogWriter(path)  # a writer continuing the log cuts the same away
    assert writer.next_step == kept
    writer.close()
    assert read_steps(path) == [(STEP, 0.25), (STEP[:2], 0.5)][:kept]
    path.write_text(HEADER[:10])  # nothing whole at all
    assert read_steps(path) == []


def test_several_logs_are_read_as_one_from_files_directories_and_patterns(tmp_path) -> None:
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    write_steps(ranks / "steps.rank0.csv", [(STEP, 0.25)])
    write_steps(ranks / "steps.rank1.csv", [(STEP[:1], 0.5), (STEP[:2], 0.75)])
    (ranks / "stats.rank0.json").write_text("{}")
    files = [ranks / "steps.rank0.csv", ranks / "steps.rank1.csv"]
    merged = [(STEP, 0.25), (STEP[:1], 0.5), (STEP[:2], 0.75)]
    for names in ([ranks], [str(ranks / "steps.rank*.csv")], files):
        assert log_files(names) == files
        assert read_logs(names) == merged
    for missing in (tmp_path / "none.csv", tmp_path / "*.csv", tmp_path):
        with pytest.raises(ValueError, match="no step log there"):
            log_files([missing, *files])
