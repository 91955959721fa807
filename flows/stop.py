"""The command line's polite stop: SIGTERM or SIGINT to `eagle3-pipeline run` ends every process of the
run (workers, the trainer, streamed extraction's producers, vLLM's engines, the run's Prefect server)
within 10 s of the signal (README's promise), records the flow run Cancelled, says how long the processes took
to be gone, and exits 128 + the signal's number right after saying it.

The order: the stage in progress unwinds (tasks/common/workers.py ends its processes, a streamed
extraction's producers abandon their shards: tasks/extract/stream.py); then what is left of the run but
the Prefect server gets SIGKILL KILL_AFTER_S after the signal; the flow run is marked Cancelled while
the server still runs; the server is ended; the time is measured once every process is gone, and the
process exits with os._exit. Not a normal exit: the interpreter's finalization (freeing what torch,
datasets and Prefect hold, no Python frame left to show) took 6-10 s on a loaded 2-core machine after
the run's last process had gone. Everything the run writes is written or flushed by then: its log file
line by line, stdout and stderr here. Should the unwinding hang (a stage's call that a signal does not
interrupt), a watchdog thread ends the run itself FORCE_AFTER_S after the signal.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import NoReturn

import psutil

from flows import prefect_env
from tasks.common.workers import end_processes, process_trees

log = logging.getLogger(__name__)

KILL_AFTER_S = 4.0  # the run's processes but its Prefect server: SIGKILL if still alive this long after the signal
CANCEL_TIMEOUT_S = 2.0  # at most this long for the server to record the flow run Cancelled
SERVER_GRACE_S = 1.5  # then the server's graceful shutdown, SIGKILL after this
FORCE_AFTER_S = 5.0  # the main thread has not begun to end the run by then: the watchdog does it

STARTED_AT = datetime.now(UTC)  # flow runs created before this process started are not its own
_ending = threading.Lock()
_run_began = False
_first_signal: tuple[int, float, list[psutil.Process]] | None = None  # signum, when, this process's descendants then
_noting = threading.Lock()


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGINT, raised in the main thread wherever the run is. A BaseException, so that
    Prefect's engine does not take it for a task's failure to retry: the stage unwinds, ending its
    worker processes on the way (tasks/common/workers.py), and the folder's lock goes with it.
    `at` and `processes`: when the first signal came and this process's descendants then (a worker
    that dies meanwhile leaves its own children to another parent: they are still the run's)."""

    def __init__(self, signum: int):
        self.signum, self.at, self.processes = note_signal(signum)  # the first signal's, where two came
        super().__init__(signal.Signals(self.signum).name)


def stop_on_signals() -> None:
    """A polite stop for a `kill PID`, systemd (KillMode=process), a container runtime or Ctrl-C;
    a second signal ends this process outright.

    The signal's time is taken by a thread that the signal wakes (signal.set_wakeup_fd), not by the
    handler: while a flow runs, Prefect's engine has its own SIGTERM handler, which unwinds the flow
    as crashed and only then passes the signal on to this one (0.5-0.7 s later on a loaded machine)."""
    def stop(signum, frame):
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, signal.SIG_DFL)
        raise Stopped(signum)

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, stop)
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    threading.Thread(target=note_signals, args=(read_end,), name="signal-clock", daemon=True).start()


def note_signals(read_end: int) -> None:
    """The signal numbers the wakeup pipe receives, noted as they come."""
    while True:
        for signum in os.read(read_end, 64):
            if signum in (signal.SIGTERM, signal.SIGINT):
                note_signal(signum)


def note_signal(signum: int) -> tuple[int, float, list[psutil.Process]]:
    """The first stop signal: its number, its time and this process's descendants then. Noting it
    starts the watchdog (module docstring)."""
    global _first_signal
    with _noting:
        if _first_signal is None:
            _first_signal = (signum, time.monotonic(), psutil.Process().children(recursive=True))
            watchdog = threading.Timer(FORCE_AFTER_S, lambda: end_stopped_run(Stopped(signum), forced=True))
            watchdog.daemon = True
            watchdog.start()
        return _first_signal


def run_began() -> None:
    """The flow run starts now: a stop from here on has a run to mark Cancelled."""
    global _run_began
    _run_began = True


def end_stopped_run(stop: Stopped, forced: bool = False) -> NoReturn:
    """Every process of the run ended (module docstring), the flow run marked Cancelled, one line
    saying how long it took, and the exit. Called by the main thread once the stage has unwound, or
    by the watchdog (`forced`) when it has not; whichever comes second waits here for the exit."""
    _ending.acquire()
    server = prefect_env.RUN_SERVER
    others = [p for p in processes_of_the_run(stop) if server is None or p.pid != server.pid]
    left = end_processes(others, max(0.0, stop.at + KILL_AFTER_S - time.monotonic()))
    if _run_began and not within(CANCEL_TIMEOUT_S, mark_cancelled, str(stop)):
        log.warning("the flow run was not marked Cancelled: its Prefect server did not answer within %.0f s",
                    CANCEL_TIMEOUT_S)
    if server is not None:
        left += end_processes(process_trees([server.pid]), SERVER_GRACE_S)
    took = time.monotonic() - stop.at
    how = f" (ended by force: the run had not unwound {FORCE_AFTER_S:.0f} s after the signal)" if forced else ""
    if left:
        print(f"eagle3-pipeline: stopped by {stop}, but {len(left)} of its processes were still alive "
              f"{took:.1f} s after the signal{how}: pids {', '.join(str(p.pid) for p in left)}", file=sys.stderr)
    elif _run_began:
        print(f"eagle3-pipeline: stopped by {stop}: every process of the run ended after {took:.1f} s{how}; run "
              "the same command to resume", file=sys.stderr)
    else:
        print(f"eagle3-pipeline: stopped by {stop} before the run began; every process it started ended after "
              f"{took:.1f} s{how}", file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(128 + stop.signum)


def processes_of_the_run(stop: Stopped) -> list[psutil.Process]:
    """This process's descendants now and when the signal came, those still alive."""
    seen: dict[int, psutil.Process] = {}
    for process in [*stop.processes, *psutil.Process().children(recursive=True)]:
        if process.pid not in seen and process.is_running():
            seen[process.pid] = process
    return list(seen.values())


def within(seconds: float, call: Callable, *args) -> bool:
    """`call(*args)` in a thread, waited for `seconds` at most: whether it returned."""
    thread = threading.Thread(target=call, args=args, name=getattr(call, "__name__", "call"), daemon=True)
    thread.start()
    thread.join(seconds)
    return not thread.is_alive()


def mark_cancelled(reason: str) -> None:
    """This process's flow run, and its task runs still running, as Cancelled on the run's Prefect
    server (which must still run). Task states reach the server as events: those still queued go
    first, so that a late Crashed does not land after the Cancelled."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.sorting import FlowRunSort
    from prefect.events.worker import EventsWorker
    from prefect.states import Cancelled

    EventsWorker.drain_all(timeout=CANCEL_TIMEOUT_S / 2)
    try:
        with get_client(sync_client=True) as client:
            for flow_run in client.read_flow_runs(sort=FlowRunSort.START_TIME_DESC, limit=1):
                if flow_run.created and flow_run.created < STARTED_AT:
                    continue  # an earlier run's: this one's flow run was not created yet
                only_this_run = FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id]))
                for task_run in client.read_task_runs(flow_run_filter=only_this_run):
                    if not (task_run.state and task_run.state.is_final()):
                        client.set_task_run_state(task_run.id, Cancelled(message=f"stopped by {reason}"), force=True)
                client.set_flow_run_state(flow_run.id, Cancelled(message=f"stopped by {reason}"), force=True)
    except Exception as e:  # the record only: the processes are ended either way
        log.warning("could not mark the flow run Cancelled: %s", e)
