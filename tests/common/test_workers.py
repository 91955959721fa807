"""Stage workers' failures as their parent process sees them (tasks/common/workers.py)."""

from __future__ import annotations

import sys

import pytest

from tasks.common.errors import is_deterministic
from tasks.common.journal import DiskWriteError
from tasks.common.progress import ProgressEvent
from tasks.common.workers import errors_file, merge_progress, run_processes

FULL_DISK_WORKER = """
import resource, sys
from tasks.common.journal import DiskWriteError
from tasks.common.workers import reporting_errors
# the disk full for this process alone: every write to a file fails (EFBIG; Python ignores SIGXFSZ)
resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
with reporting_errors(sys.argv[1]):
    raise DiskWriteError("writing shard 7 failed: No space left on device (0 MB free on that disk)")
"""


def test_a_worker_that_cannot_write_its_error_report_still_gets_its_error_to_the_parent(tmp_path):
    progress = tmp_path / "progress.jsonl"
    with pytest.raises(DiskWriteError, match=r"^writing shard 7 failed: No space left on device") as raised:
        run_processes([[sys.executable, "-c", FULL_DISK_WORKER, str(progress)]], [progress], None, poll_s=0.1,
                      label="test worker")
    assert is_deterministic(raised.value)  # permanent: not retried as a lost worker would be
    assert "raised in test worker 0" in "\n".join(raised.value.__notes__)
    report = errors_file(progress)
    assert not report.is_file() or report.stat().st_size == 0  # the report file was not written


CHATTY_WORKER = """
import dataclasses, logging, sys
from tasks.common.workers import rank_worker_main

@dataclasses.dataclass
class Job:
    name: str

def work(job, rank, world_size, callback):
    print("INFO 12-05 03:40:00 [cpu_worker.py:88] a library's start-up note", flush=True)
    print("a library's warning on stderr", file=sys.stderr, flush=True)
    logging.getLogger("vllm.triton_utils.importing").warning("a library's note through our log format")
    logging.getLogger("tasks.example").info("loaded %s", job.name)

sys.exit(rank_worker_main("example", Job, work, sys.argv[1:]))
"""


def test_a_workers_own_log_lines_reach_the_terminal_and_everything_it_printed_its_log_file(tmp_path, capfd):
    job, progress = tmp_path / "job.json", tmp_path / "progress-rank0.jsonl"
    job.write_text('{"name": "the verifier"}')
    run_processes([[sys.executable, "-c", CHATTY_WORKER, "--job", str(job), "--progress-file", str(progress)]],
                  [progress], None, poll_s=0.1, label="test worker")
    out, err = capfd.readouterr()
    assert "[rank 0] tasks.example: loaded the verifier" in err
    for library in ("start-up note", "warning on stderr", "through our log format"):
        assert library not in out + err
    log = (tmp_path / "progress-rank0.log").read_text()
    for line in ("a library's start-up note", "a library's warning on stderr", "a library's note through our log",
                 "tasks.example: loaded the verifier"):
        assert line in log


def test_a_failed_workers_error_names_its_log_file_with_its_last_lines(tmp_path):
    progress = tmp_path / "progress-rank0.jsonl"
    script = "import os; print('the last words before the crash', flush=True); os._exit(9)"
    with pytest.raises(Exception, match=r"exited with code 9 .*progress-rank0\.log") as raised:
        run_processes([[sys.executable, "-c", script]], [progress], None, poll_s=0.1, label="test worker")
    assert "the last words before the crash" in "\n".join(raised.value.__notes__)


def test_merged_progress_adds_counts_of_one_unit_and_says_how_many_workers_they_cover():
    """Three regeneration ranks: two inside a round count answers, one between chunks counts conversations
    (tasks/prepare/regenerate.py); the merged line adds the answers and says it covers 2 of the 3 workers."""
    in_round = [ProgressEvent("regenerate: chunk 1 of 2 (64 conversations), round 1", 40, 64, "answer", 4.0, 6.0, 30.0),
                ProgressEvent("regenerate: chunk 2 of 3 (64 conversations), round 1", 10, 64, "answer", 2.0, 27.0, 35.0)]
    between = ProgressEvent("regenerate", 64, 192, "conversation", 1.5, 85.0, 50.0)
    merged = merge_progress([*in_round, between, None], "regenerate")
    assert (merged.unit, merged.done, merged.total, merged.rate) == ("answer", 50, 128, 6.0)
    assert merged.eta_s == pytest.approx(78 / 6.0) and merged.elapsed_s == 50.0
    assert merged.note == "2 of 3 workers"
    alone = merge_progress([between, ProgressEvent("regenerate", 0, 128, "conversation", None, None, 5.0)], "regenerate")
    assert (alone.done, alone.total, alone.rate, alone.eta_s, alone.note) == (64, 320, 1.5, 256 / 1.5, "2 workers")
    loading = ProgressEvent("load SmolLM2", 0.1, 0.27, "GB", None, None, 3.0)
    assert merge_progress([None, loading], "regenerate") == loading  # no worker has started: the first one's event
