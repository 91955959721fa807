"""Progress for long stages: a log line every few seconds, a bar on a terminal, and a callback
(the Prefect task turns it into a progress artifact). Rates and ETAs are measured on the run
itself, never extrapolated from a toy run.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import psutil

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProgressEvent:
    stage: str
    done: float
    total: float
    unit: str
    rate: float | None  # units per second, over the later half of the time since the first unit
    eta_s: float | None
    elapsed_s: float
    note: str = ""

    @property
    def fraction(self) -> float:
        return min(1.0, self.done / self.total) if self.total else 1.0

    def describe(self) -> str:
        if not self.unit:  # a step without countable units (an engine starting): how long it has run
            return f"{self.stage}: {format_seconds(self.elapsed_s)} elapsed" + (f" ({self.note})" if self.note else "")
        rate = f", {number(self.rate)} {self.unit}/s" if self.rate else ""
        eta = f", ETA {format_seconds(self.eta_s)}" if self.eta_s is not None else ""
        note = f" ({self.note})" if self.note else ""
        return (f"{self.stage}: {number(self.done)}/{number(self.total)} {self.unit} ({100 * self.fraction:.1f}%)"
                f"{rate}{eta}, {format_seconds(self.elapsed_s)} elapsed{note}")


ProgressCallback = Callable[[ProgressEvent], None]


def number(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def format_seconds(s: float) -> str:
    if 0 < s < 1:  # "0s" would read as nothing at all
        return "under 1s"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def format_bytes(n: float) -> str:
    """GB, or MB below 1 GB (a small run's sizes would all read "0.0 GB")."""
    return f"{n / 1e9:,.1f} GB" if n >= 1e9 else f"{n / 1e6:,.1f} MB"


class Progress:
    def __init__(self, stage: str, total: float, unit: str, callback: ProgressCallback | None = None,
                 log_every_s: float = 10.0, done: float = 0.0, bar: bool = True, rate_from_start: bool = False):
        self.stage, self.total, self.unit = stage, total, unit
        self.callback = callback
        self.log_every_s = log_every_s
        self.start = time.monotonic()
        self.done = done
        self._rate_start: float | None = None  # when measuring began: after the first unit (the clock() time)
        self._samples: deque[tuple[float, float]] = deque()  # (clock(), done) since then, thinned to one a second
        self._paused = 0.0  # seconds left out of the rate (exclude): validation, checkpoints
        self._recurring = 0.0  # of them, those the ETA adds back (since the last one-off wait)
        self._done_at_start = done
        self._recurring_from = done  # units done at the last one-off wait (a start-up) or the start
        self._paused_over = 0.0  # units done since then by the last pause: the pauses came once per this many
        self._first_estimate: tuple[float, float] | None = None  # (done, elapsed + ETA) of the first ETA given
        if rate_from_start:  # no warm-up to leave out: the units are worked on side by side from the start
            self._rate_start = self.clock(self.start)
            self._samples.append((self._rate_start, done))
        self._last_log = 0.0
        self._bar = None
        if bar and sys.stderr.isatty():  # bar False: another's lines carry this one (RoundHeartbeat)
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=done, unit=unit, desc=stage, unit_scale=True, dynamic_ncols=True)

    def clock(self, now: float) -> float:
        """Time spent on the work itself: the pauses `exclude` was told about left out."""
        return now - self._paused

    def exclude(self, seconds: float, recurs: bool = True) -> None:
        """Leave `seconds` just spent on something else (validation, a checkpoint) out of the rate.
        The ETA adds such pauses back at their measured cost per unit of work, so it neither falls
        after one nor jumps during one; with `recurs` False (a one-off: waiting for another process
        to start) it leaves them out of the ETA too."""
        self._paused += seconds
        if recurs:
            self._recurring += seconds
            self._paused_over = self.done - self._recurring_from
        else:  # the work before it came before the steady state: the recurring pauses are measured after it
            self._recurring, self._paused_over, self._recurring_from = 0.0, 0.0, self.done

    def rate(self, now: float) -> float | None:
        """Units per second over the later half of the working time measured so far: a slow start
        (allocation, compilation, caches) fades out of the estimate instead of weighing on it to the
        end, and a long run averages over many periods."""
        now = self.clock(now)
        if self._rate_start is None or now <= self._rate_start:
            return None
        cut = self._rate_start + (now - self._rate_start) / 2
        while len(self._samples) > 1 and self._samples[1][0] <= cut:
            self._samples.popleft()
        t, done = self._samples[0]
        return (self.done - done) / (now - t) if now > t else None

    def event(self, note: str = "") -> ProgressEvent:
        now = time.monotonic()
        rate = self.rate(now)
        left = self.total - self.done
        pause_per_unit = self._recurring / self._paused_over if self._paused_over else 0.0
        eta = left / rate + left * pause_per_unit if rate else None
        if eta is not None and self._first_estimate is None and self.done < self.total:
            self._first_estimate = (self.done, now - self.start + eta)
        return ProgressEvent(self.stage, self.done, self.total, self.unit, rate, eta, now - self.start, note)

    def update(self, n: float, note: str = "", force: bool = False) -> None:
        now = time.monotonic()
        self.done += n
        if self._rate_start is None and self.done > self._done_at_start:
            # The first unit includes warm-up (allocation, compilation) and any wait before it (a note
            # with nothing done: streamed training waiting for its first block): rates start after it.
            self._rate_start = self.clock(now)
        if self._rate_start is not None and (not self._samples or self.clock(now) - self._samples[-1][0] >= 1.0):
            self._samples.append((self.clock(now), self.done))  # one sample a second is plenty
        if self._bar is not None:
            self._bar.update(n)
        if force or now - self._last_log >= self.log_every_s or self.done >= self.total:
            self._last_log = now
            ev = self.event(note)
            log.info("%s", ev.describe())
            if self.callback is not None:
                self.callback(ev)

    def close(self) -> None:
        """Ends the bar; says how the first time estimate compared with the time it took."""
        if self._bar is not None:
            self._bar.close()
        if self._first_estimate is not None and self.done >= self.total:
            done, estimate = self._first_estimate
            took = time.monotonic() - self.start
            log.info("%s: took %s; the first estimate, after %s %s, was %s (%.2fx)", self.stage, format_seconds(took),
                     number(done), self.unit, format_seconds(estimate), estimate / took)


class Heartbeat:
    """A log line (and a callback event) every `every_s` while a step without countable units runs,
    and one when it ends: a minute of silence is indistinguishable from a hang."""

    def __init__(self, stage: str, callback: ProgressCallback | None = None, every_s: float = 10.0):
        self.stage, self.callback, self.every_s = stage, callback, every_s
        self._stop = threading.Event()

    def event(self, elapsed: float, final: bool | None) -> ProgressEvent:
        """`final`: None while running, True when the step succeeded, False when it failed."""
        note = {None: "", True: "done", False: "failed"}[final]
        return ProgressEvent(self.stage, 0, 0, "", None, None, elapsed, note)

    def _report(self, final: bool | None = None) -> None:
        ev = self.event(time.monotonic() - self._t0, final)
        log.info("%s", ev.describe())
        if self.callback is not None:
            self.callback(ev)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self._report()

    def __enter__(self):
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True, name="heartbeat")
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._report(final=exc[0] is None)


class RoundHeartbeat(Heartbeat):
    """A Heartbeat for a step done in rounds of countable units (a regeneration chunk: the first answer of
    every conversation, then every second one...): while a round runs, each line and callback event is
    the round's Progress, its units done of its total, their rate and the round's ETA, as the step counts
    them (`count`, from the step's thread); before the first round, and when the step ends, a Heartbeat's
    elapsed time. A round's last count logs (and calls back) at once."""

    def __init__(self, stage: str, unit: str, callback: ProgressCallback | None = None, every_s: float = 10.0):
        super().__init__(stage, callback, every_s)
        self.unit = unit
        self._round: Progress | None = None
        self._note = ""
        self._lock = threading.Lock()  # the step counts in its thread, the heartbeat reads in its own

    def start_round(self, name: str, total: float) -> None:
        with self._lock:
            # no lines of its own but its last (the heartbeat's thread writes them every `every_s`); its rate
            # counts from its start, not from its first unit: a round's units are worked on together from
            # the start (vLLM's requests, a batch's rows) and several may end at once
            self._round = Progress(f"{self.stage}, {name}", total, self.unit, self.callback,
                                   log_every_s=float("inf"), bar=False, rate_from_start=True)
            self._note = ""

    def count(self, done: float, note: str = "") -> None:
        """The round's units done so far; `note` (what else was measured) goes with its lines."""
        with self._lock:
            self._note = note
            self._round.update(done - self._round.done, note)

    def event(self, elapsed: float, final: bool | None) -> ProgressEvent:
        if final is None and self._round is not None:
            return self._round.event(self._note)
        return super().event(elapsed, final)

    def _report(self, final: bool | None = None) -> None:
        with self._lock:
            super()._report(final)


class LoadMonitor(Heartbeat):
    """Logs while a model loads: elapsed time, bytes read from disk, bytes materialized (GPU
    memory allocated, or resident memory on CPU) against the size of the weight files. A
    22-minute load with nothing in the log is indistinguishable from a hang."""

    def __init__(self, what: str, weight_bytes: int, callback: ProgressCallback | None = None,
                 every_s: float = 10.0):
        super().__init__(f"load {what}", callback, every_s)
        self.what, self.weight_bytes = what, weight_bytes
        self._proc = psutil.Process()

    def _read_bytes(self) -> int:
        try:
            return self._proc.io_counters().read_bytes
        except (psutil.AccessDenied, AttributeError):
            return 0

    def _materialized(self) -> int:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return sum(torch.cuda.memory_allocated(d) for d in range(torch.cuda.device_count()))
        return max(0, self._proc.memory_info().rss - self._rss0)

    def event(self, elapsed: float, final: bool | None) -> ProgressEvent:
        read = self._read_bytes() - self._read0
        # While loading, what is materialized shows how far it got; once loaded, all of it is (memory
        # mapped weights, shared pages and a CPU's page cache make the measure undercount).
        loaded = self.weight_bytes if final else self._materialized()
        return ProgressEvent(self.stage, loaded / 1e9, self.weight_bytes / 1e9, "GB", None, None, elapsed,
                             note=f"{read / 1e9:.1f} GB read from disk" + (", done" if final else ""))

    def __enter__(self) -> LoadMonitor:
        self._read0 = self._read_bytes()
        self._rss0 = self._proc.memory_info().rss
        log.info("loading %s: %d weight bytes (%.1f GB)", self.what, self.weight_bytes, self.weight_bytes / 1e9)
        return super().__enter__()
