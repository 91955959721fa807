"""Stage work in subprocesses: a CUDA abort, OOM kill or segfault fails the call, not the caller's
process (the Prefect flow), and the stage's retry resumes from what is on disk.

A worker process reports progress as JSON lines in its own file (`progress_file_callback`); the
parent follows the files while the processes run and passes their latest events, merged into
one, to its callback (`run_processes`).
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import asdict
from pathlib import Path

from tasks.progress import ProgressCallback, ProgressEvent


def progress_file_callback(path: str | Path) -> ProgressCallback:
    """Progress events as JSON lines, for the parent process to follow."""
    path = Path(path)

    def write(event) -> None:
        with path.open("a") as f:
            f.write(json.dumps(asdict(event)) + "\n")

    return write


class ProgressFile:
    def __init__(self, path: Path):
        self.path, self.last = path, None

    def latest(self):
        if self.path.is_file():
            lines = self.path.read_text().splitlines()
            for line in reversed(lines):
                try:
                    self.last = ProgressEvent(**json.loads(line))
                    break
                except (json.JSONDecodeError, TypeError):
                    continue
        return self.last


def merge_progress(events: list) -> ProgressEvent | None:
    """One event for all workers: their extraction summed, or while none extracts yet, the first
    worker's (a load; the only event of a single process)."""
    started = [e for e in events if e is not None]
    events = [e for e in started if e.stage.startswith("extract")]
    if not events:
        return started[0] if started else None
    rate = sum(e.rate or 0 for e in events) or None
    done, total = sum(e.done for e in events), sum(e.total for e in events)
    return ProgressEvent("extract", done, total, "tok", rate, (total - done) / rate if rate else None,
                         max(e.elapsed_s for e in events), f"{len(events)} workers")


def run_processes(commands: list[list[str]], progress_files: list[Path], callback: ProgressCallback | None,
                  envs: list[dict[str, str]] | None = None, poll_s: float = 2.0) -> dict[int, int]:
    """Run one process per command (with its env, or this one's), each writing progress to its
    file, and wait for all, passing their merged progress to `callback` whenever it changes.
    Returns the exit codes of the processes that failed, by index; raising is the caller's call."""
    for path in progress_files:  # a file left by an earlier attempt would report its progress
        path.unlink(missing_ok=True)
    procs = [subprocess.Popen(cmd, env=envs[i] if envs else None) for i, cmd in enumerate(commands)]
    followers = [ProgressFile(path) for path in progress_files]
    last = None
    while True:
        running = any(p.poll() is None for p in procs)
        merged = merge_progress([f.latest() for f in followers])
        if callback is not None and merged is not None and merged != last:
            callback(merged)
            last = merged
        if not running:
            break  # read once more after the last exit: the workers' final events
        time.sleep(poll_s)
    return {i: p.returncode for i, p in enumerate(procs) if p.returncode != 0}
