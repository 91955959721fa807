"""Stage workers' failures as their parent process sees them (tasks/common/workers.py)."""

from __future__ import annotations

import sys

import pytest

from tasks.common.errors import is_deterministic
from tasks.common.journal import DiskWriteError
from tasks.common.workers import errors_file, run_processes

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
