"""Stage work in subprocesses: a CUDA abort, OOM kill or segfault fails the call, not the caller's
process (the Prefect flow), and the stage's retry resumes from what is on disk.

The parent, `run_processes(commands, progress_files, callback, label=...)`: starts one process per
command, follows their progress files while they run and passes their latest events, merged into
one, to `callback`. When a process fails, it raises:
- the worker's own exception, rebuilt from what the worker reported: its type where that type is
  already imported here (`VerifierError`, `ValueError`, ...; else a `WorkerFailed` that carries the
  type's name), its message, and `deterministic` (tasks/common/errors.py) as the worker classified it, so
  a stage's retry condition skips retries of what cannot change;
- `WorkerLost` (transient) for a process that died without reporting one (killed by the OOM killer
  or a signal, a segfault, a CUDA abort).
Each process's output goes to its own file: the file in `logs` if given, else `<progress
file>.log`, where only the lines of our own loggers (the workers' `[rank N]` format, loggers
tasks.* and the worker's __main__) are also copied to this process's stderr. What libraries print there (vLLM's start-up notes and CPU
warnings, progress bars) stays in the file, which a failure names, with its last lines in the
exception's notes.

The worker, `python -m <module>` with its progress file:

    with reporting_errors(progress_file):   # the exception goes to <progress>.errors.jsonl
        work(..., callback=progress_file_callback(progress_file))

Several processes may share one progress file's error file (the ranks of torchrun): each record
says its rank (`$RANK`). When that file cannot be written (the disk filled: the very error being
reported), a process started by `run_processes` sends the record through a pipe it inherited
instead, which needs no disk (`$EAGLE3_ERROR_PIPE`, "PARENT_PID:FD"; a torchrun rank, whose parent
is torchrun, cannot use it and goes unreported).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from tasks.common.errors import is_deterministic
from tasks.common.progress import ProgressCallback, ProgressEvent

log = logging.getLogger(__name__)


def progress_file_callback(path: str | Path) -> ProgressCallback:
    """Progress events as JSON lines, for the parent process to follow. Reporting is best effort:
    a failed write (a full disk) loses the event, not the work; the work's own writes report it."""
    path = Path(path)

    def write(event) -> None:
        try:
            with path.open("a") as f:
                f.write(json.dumps(asdict(event)) + "\n")
        except OSError as e:
            log.warning("progress not reported (%s: %s)", path, e.strerror or e)

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


def merge_progress(events: list, work: str = "extract") -> ProgressEvent | None:
    """One event for all workers: their `work` (the stage their events name: extract, regenerate)
    summed, or while none has started it, the first worker's (a load; the only event of a single
    process). Only counts of one unit add up: a regeneration worker inside a round counts answers,
    one between chunks conversations, so where they differ the unit most workers count is summed,
    and the note says how many of the workers that covers."""
    started = [e for e in events if e is not None]
    events = [e for e in started if e.stage.startswith(work)]
    if not events:
        return started[0] if started else None
    unit = Counter(e.unit for e in events).most_common(1)[0][0]
    counted = [e for e in events if e.unit == unit]
    rate = sum(e.rate or 0 for e in counted) or None
    done, total = sum(e.done for e in counted), sum(e.total for e in counted)
    workers = f"{len(counted)} workers" if len(counted) == len(events) else f"{len(counted)} of {len(events)} workers"
    return ProgressEvent(work, done, total, unit, rate, (total - done) / rate if rate else None,
                         max(e.elapsed_s for e in events), workers)


class WorkerFailed(RuntimeError):
    """A worker's exception whose type is not imported in this process: its name and message."""

    def __init__(self, type_name: str, message: str, deterministic: bool):
        super().__init__(message)
        self.type_name, self.deterministic = type_name, deterministic

    def __str__(self) -> str:
        return f"{self.type_name}: {super().__str__()}"


class WorkerLost(RuntimeError):
    """A worker process died without reporting an exception; a retry may well succeed."""

    deterministic = False


def errors_file(progress_file: str | Path) -> Path:
    """Where the processes writing `progress_file` report their exception."""
    progress_file = Path(progress_file)
    return progress_file.with_name(f"{progress_file.stem}.errors.jsonl")


ERROR_PIPE_ENV = "EAGLE3_ERROR_PIPE"


@contextmanager
def reporting_errors(progress_file: str | Path | None) -> Iterator[None]:
    """In a worker: an exception leaving the block is recorded for the parent, traceback included,
    and the process exits with status 1 after one line saying so (the parent raises it, with the
    traceback, into the run's log: a second copy on the terminal would bury the run's one error
    line). When it cannot be recorded it is re-raised: its traceback on stderr is all there is."""
    try:
        yield
    except Exception as e:
        if progress_file is None:
            raise
        record = {"rank": int(os.environ.get("RANK", 0)), "pid": os.getpid(),
                  "type": f"{type(e).__module__}.{type(e).__qualname__}", "message": str(e),
                  "deterministic": is_deterministic(e), "traceback": traceback.format_exc()[-8000:]}
        line = json.dumps(record) + "\n"
        try:
            with errors_file(progress_file).open("a") as f:
                f.write(line)
        except OSError as write_error:
            if not send_through_pipe(line):
                log.error("the exception could not be reported to the parent process (%s: %s)",
                          errors_file(progress_file), write_error.strerror or write_error)
                raise e from None
        log.error("%s: %s (reported to the parent process)", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        raise SystemExit(1) from None


def send_through_pipe(line: str) -> bool:
    """`line` into the pipe `run_processes` passed this process, if it did (the pipe's parent end
    is this process's parent: not a torchrun rank's nor a child's that inherited the variable)."""
    parent, _, fd = os.environ.get(ERROR_PIPE_ENV, "").partition(":")
    if not fd or parent != str(os.getppid()):
        return False
    try:
        os.write(int(fd), line.encode())  # blocks, if the pipe is full, until the parent's next read
    except OSError:
        return False
    return True


def rebuild(record: dict) -> Exception:
    """The worker's exception: its own type when that is imported here and takes the message
    alone, else a WorkerFailed naming it. Either way `deterministic` is the worker's verdict."""
    module, _, qualname = record["type"].rpartition(".")
    cls = getattr(sys.modules.get(module), qualname, None)
    exc = None
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            exc = cls(record["message"])
            if str(exc) != record["message"]:
                exc = None
        except Exception:
            exc = None
    if exc is None:
        exc = WorkerFailed(qualname, record["message"], record["deterministic"])
    exc.deterministic = record["deterministic"]
    return exc


def read_errors(progress_file: Path) -> list[dict]:
    path = errors_file(progress_file)
    return parse_records(path.read_text()) if path.is_file() else []


def parse_records(text: str) -> list[dict]:
    records = []
    for line in text.splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by a kill or a full disk
    return records


class ErrorPipe:
    """The parent end of a worker's error pipe (`send_through_pipe`): what the worker sent, read
    without blocking (a grandchild may hold the write end open after the worker exits)."""

    def __init__(self):
        self.read_fd, write_fd = os.pipe()
        self.write_fd: int | None = write_fd
        os.set_blocking(self.read_fd, False)
        self.received = b""

    def env(self, env: dict[str, str] | None) -> dict[str, str]:
        return {**(os.environ if env is None else env), ERROR_PIPE_ENV: f"{os.getpid()}:{self.write_fd}"}

    def drain(self) -> None:
        while True:
            try:
                chunk = os.read(self.read_fd, 65536)
            except BlockingIOError:
                return
            if not chunk:
                return
            self.received += chunk

    def records(self) -> list[dict]:
        self.drain()
        return parse_records(self.received.decode(errors="replace"))

    def close_write_end(self) -> None:
        if self.write_fd is not None:
            os.close(self.write_fd)
            self.write_fd = None

    def close(self) -> None:
        self.close_write_end()
        os.close(self.read_fd)


def exit_description(code: int) -> str:
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
        why = " (the kernel's OOM killer sends it when memory runs out)" if -code == signal.SIGKILL else ""
        return f"was killed by {name}{why}"
    return f"exited with code {code} without reporting an exception"


def output_tail(path: Path, lines: int = 25) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.is_file() else ""


def write_job_file(job) -> Path:
    """The job (a dataclass) as JSON in `<job.out_dir>/progress/job.json`, for its worker processes."""
    path = Path(job.out_dir) / "progress" / "job.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(job)))
    return path


def worker_command(module: str, job_file: Path, rank: int, world_size: int, progress_file: Path) -> list[str]:
    """A stage's worker process: `python -m MODULE --job JOB --rank R --world-size N --progress-file F`."""
    return [sys.executable, "-m", module, "--job", str(job_file), "--rank", str(rank), "--world-size",
            str(world_size), "--progress-file", str(progress_file)]


def run_one_worker(module: str, job, label: str, callback: ProgressCallback | None, lock_fd: int) -> None:
    """`job` done by one worker process (`python -m module`, rank 0 of 1) holding the folder's lock
    `lock_fd`, its progress passed to `callback`."""
    job_file = write_job_file(job)
    progress_file = job_file.with_name("rank-0.jsonl")
    run_processes([worker_command(module, job_file, 0, 1, progress_file)], [progress_file], callback, label=label,
                  pass_fds=(lock_fd,))


# True in a stage's worker process (rank_worker_main): the process exists for that work alone, so an
# engine may take it over (tasks/common/vllm_support.keep_engine_in_this_process)
IN_WORKER_PROCESS = False


def rank_worker_main(module: str, job_type: type, work: Callable, argv: list[str] | None = None) -> int:
    """A stage's worker process, the other end of `worker_command`: `python -m MODULE --job JOB.json
    --rank R --world-size N [--progress-file F]` runs `work(job, rank, world_size, callback)`, its
    progress and any exception written for the parent."""
    p = argparse.ArgumentParser(prog=f"python -m {module}")
    p.add_argument("--job", required=True, help=f"a {job_type.__name__} as JSON")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--progress-file")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s [rank {a.rank}] %(name)s: %(message)s")
    job = job_type(**json.loads(Path(a.job).read_text()))
    global IN_WORKER_PROCESS
    IN_WORKER_PROCESS = True
    with reporting_errors(a.progress_file):
        work(job, a.rank, a.world_size, progress_file_callback(a.progress_file) if a.progress_file else None)
    return 0


def run_processes(commands: list[list[str]], progress_files: list[Path], callback: ProgressCallback | None,
                  envs: list[dict[str, str]] | None = None, poll_s: float = 2.0, label: str = "worker",
                  logs: list[Path] | None = None, pass_fds: tuple[int, ...] = ()) -> None:
    """Run one process per command (with its env, or this one's), each writing progress to its
    file, and wait for all, passing their merged progress to `callback` whenever it changes.
    A process's output goes to its file in `logs` if given, else to `<progress file>.log` with our
    own log lines copied to this process's stderr.
    `pass_fds` stay open in the processes (an output folder's lock, tasks/common/folder_lock.py).
    Raises if any failed (module docstring): the first reported exception, else `WorkerLost`."""
    for path in progress_files:  # files left by an earlier attempt would report its progress and errors
        path.unlink(missing_ok=True)
        errors_file(path).unlink(missing_ok=True)
    echo = not logs  # our own lines to the terminal, the rest to the file only
    logs = logs or [path.with_name(f"{path.stem}.log") for path in progress_files]
    outputs = [log.open("wb") for log in logs]
    pipes: list[ErrorPipe] = []
    copiers: list[threading.Thread] = []
    stopping = False
    try:
        procs = []
        for i, cmd in enumerate(commands):
            pipes.append(ErrorPipe())
            procs.append(subprocess.Popen(cmd, env=pipes[i].env(envs[i] if envs else None),
                                          stdout=subprocess.PIPE if echo else outputs[i], stderr=subprocess.STDOUT,
                                          pass_fds=(*pass_fds, pipes[i].write_fd)))
            pipes[i].close_write_end()  # the worker holds it now
            if echo:
                copiers.append(copy_output(procs[i].stdout, outputs[i]))
            log.info("%s %d started (pid %d); its output: %s", label, i, procs[i].pid, logs[i])

        def running() -> bool:
            for pipe in pipes:
                pipe.drain()  # a worker writing into a full pipe waits for this
            return any(p.poll() is None for p in procs)

        follow(running, progress_files, callback, poll_s)
        piped = [pipe.records() for pipe in pipes]
    except BaseException as e:  # a stop signal (flows/stop.py) or a failure here: no worker outlives its stage
        stopping = not isinstance(e, Exception)
        end_process_trees(procs)
        raise
    finally:
        for copier in copiers:  # the output's last lines (a traceback) in the file before it is read
            # a grandchild still holding the pipe must not hold up the stage, nor a stop (its promise: 10 s)
            copier.join(timeout=1 if stopping else 10)
        for f in outputs[len(copiers):]:  # a copying thread closes its file at the end of the output
            f.close()
        for pipe in pipes:
            pipe.close()
    failed = {i: p.returncode for i, p in enumerate(procs) if p.returncode != 0}
    if failed:
        raise worker_failure(failed, progress_files, label, logs, piped)


# A line our own code logged in a worker (rank_worker_main's and training's format, a logger of
# tasks.* or the worker's __main__): worth the terminal. Libraries that log through the same root
# handler (vLLM's Triton notes on CPU) are not.
OUR_LINE = re.compile(rb"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ [A-Z]+ \[rank \d+\] (tasks\.|__main__:)")


def copy_output(stream, log) -> threading.Thread:
    """Every line of a worker's output (its children's too: vLLM's engine processes) into its log
    file, and our own lines also to this process's stderr, in a thread until the output ends."""
    def copy() -> None:
        with stream, log:
            for line in stream:
                log.write(line)
                log.flush()
                if OUR_LINE.match(line):
                    os.write(2, line)

    thread = threading.Thread(target=copy, name="worker-output", daemon=True)
    thread.start()
    return thread


# How long a process of a stopping run has between SIGTERM and SIGKILL: a Python worker or the trainer
# dies at once (SIGTERM's default action), vLLM's engines shut down in about a second; the run's stop
# promises every process gone within 10 s (flows/stop.py), its Prefect server's end included.
STOP_GRACE_S = 3.0
KILLED_WAIT_S = 2.0  # a SIGKILLed process is gone once the kernel ends it (not while in an uninterruptible write)


def process_trees(pids: list[int]) -> list:
    """The processes `pids` and everything each started (vLLM's engine processes, data loaders), as
    psutil processes; those already gone are left out."""
    import psutil

    tree = []
    for pid in pids:
        try:
            parent = psutil.Process(pid)
            tree += [parent, *parent.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
    return tree


def end_processes(processes: list, grace_s: float = STOP_GRACE_S) -> list:
    """SIGTERM to each of `processes` (psutil's), SIGKILL to those still alive after `grace_s`.
    Returns those alive even after that (none, unless the kernel holds one in a write)."""
    import psutil

    for process in processes:
        try:
            process.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(processes, timeout=grace_s)
    for process in alive:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    return psutil.wait_procs(alive, timeout=KILLED_WAIT_S)[1]


def end_process_trees(procs: list[subprocess.Popen], grace_s: float = STOP_GRACE_S) -> None:
    """Terminate each process and everything it started, then kill whatever is still alive after `grace_s`."""
    end_processes(process_trees([proc.pid for proc in procs]), grace_s)
    for proc in procs:
        proc.poll()  # reaped: no zombie left behind


def worker_failure(failed: dict[int, int], progress_files: list[Path], label: str, logs: list[Path],
                   piped: list[list[dict]] | None = None) -> Exception:
    """The exception for failed processes: the first one a worker reported (in its errors file, or
    through its pipe where that file could not be written), else `WorkerLost`."""
    i, code = next(iter(failed.items()))
    records = [(j, r) for j in failed
               for r in sorted(read_errors(progress_files[j]) + (piped[j] if piped else []), key=lambda r: r["rank"])]
    if records:
        i, record = records[0]
        exc = rebuild(record)
        exc.add_note(f"raised in {label} {record['rank']} (pid {record['pid']}); its traceback:\n"
                     + record["traceback"].rstrip())
    else:
        others = f" ({len(failed) - 1} more failed)" if len(failed) > 1 else ""
        exc = WorkerLost(f"{label} {i} {exit_description(code)} (its output: {logs[i]}){others}; a retry resumes "
                         "from what is on disk")
    exc.add_note(f"the last lines of its output ({logs[i]}):\n{output_tail(logs[i])}")
    return exc


EXIT_POLL_S = 0.05


def follow(running: Callable[[], bool], progress_files: list[Path], callback: ProgressCallback | None,
           poll_s: float, work: str = "extract") -> None:
    """While `running()`, pass the merged progress of the files to `callback` when it changes (the
    files of processes here, or of ranks on other nodes writing into a shared folder)."""
    followers = [ProgressFile(path) for path in progress_files]
    last = None
    while True:
        still_running = running()
        merged = merge_progress([f.latest() for f in followers], work)
        if callback is not None and merged is not None and merged != last:
            callback(merged)
            last = merged
        if not still_running:
            break  # read once more after the last exit: the workers' final events
        deadline = time.monotonic() + poll_s
        while time.monotonic() < deadline and running():  # progress every poll_s, the last exit seen at once
            time.sleep(EXIT_POLL_S)
