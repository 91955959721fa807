"""Read-only files in an output folder: one error line naming the file, never a retry.

This machine's tests run as root, which permission bits do not stop; the immutable attribute
(`chattr +i`) does, so it stands in for a file a user cannot write."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml
from flow_support import small_config

from tasks.common.errors import is_deterministic
from tasks.common.folder_lock import LOCK_NAME, LockNotWritableError, folder_lock

ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def unwritable(path: Path) -> Iterator[Path]:
    path.touch()
    made = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
    if made.returncode != 0:  # a filesystem without the attribute, or a container without CAP_LINUX_IMMUTABLE
        pytest.skip(f"cannot make a file immutable here: {made.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def test_a_lock_file_that_cannot_be_written_is_a_permanent_error_naming_it(tmp_path):
    with unwritable(tmp_path / LOCK_NAME) as lock, pytest.raises(LockNotWritableError) as refused:
        with folder_lock(tmp_path, "test"):
            pass
    assert str(lock) in str(refused.value) and "read-only" in str(refused.value)
    assert is_deterministic(refused.value)  # never retried: the same file refuses the same way


def test_the_cli_on_a_folder_with_a_read_only_lock_ends_in_one_error_line(sharegpt, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    config = small_config(out, Path(sharegpt))
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config.model_dump()))
    with unwritable(out / LOCK_NAME) as lock:
        run = subprocess.run([sys.executable, "-m", "flows.cli", "run", str(tmp_path / "run.yaml")],
                             capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 2, run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(lock) in errors[0], run.stderr[-3000:]
    assert "Traceback" not in run.stderr
