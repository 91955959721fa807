"""Where a training step's time goes: `train.profile_steps: N` profiles N steady-state steps with
torch.profiler (after the first window, which holds torch.compile's compilation) and writes, into
the train stage's folder, `profile.txt` (the operators that took the most device time, or CPU time
without a GPU) and `profile.json` (per step: milliseconds in each phase of the loop: waiting for the
loader, host-to-device copies, forward with the loss, backward, optimizer; CPU time is what the
Python loop spent issuing work, device time what the GPU spent running it; and the 15 operators
with the most self time)."""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule

log = logging.getLogger(__name__)

PHASES = ("data", "to_device", "forward", "backward", "optimizer")
SKIP_STEPS = 20  # past the first log window, where compilation happens


class StepProfiler:
    def __init__(self, out_dir: Path, steps: int, device: torch.device):
        self.out_dir, self.steps, self.cuda = out_dir, steps, device.type == "cuda"
        self.stepped = 0
        self.profiler = None
        if steps:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            # one cycle (repeat=1): profiling the whole run would slow all of it
            self.profiler = profile(activities=activities, on_trace_ready=self._write,
                                    schedule=schedule(wait=SKIP_STEPS, warmup=2, active=steps, repeat=1))
            self.profiler.start()

    def phase(self, name: str):
        """A named range of the loop; free when nothing is profiled."""
        return record_function(name) if self.profiler else contextlib.nullcontext()

    def step(self) -> None:
        if self.profiler:
            self.stepped += 1
            self.profiler.step()

    def close(self) -> None:
        if self.profiler:
            self.profiler.stop()
            self.profiler = None

    def _write(self, prof) -> None:
        if self.stepped < SKIP_STEPS + 2 + self.steps:  # stopped early: a partial window would mislead
            log.warning("train.profile_steps=%d: the run ended %d steps after its start, before the profiled "
                        "window (steps %d to %d): no profile written", self.steps, self.stepped, SKIP_STEPS + 3,
                        SKIP_STEPS + 2 + self.steps)
            return
        events = prof.key_averages()
        sort = "device_time_total" if self.cuda else "cpu_time_total"
        (self.out_dir / "profile.txt").write_text(events.table(sort_by=sort, row_limit=40))
        per_step = {}
        for e in events:
            if e.key in PHASES:
                per_step[e.key] = {"cpu_ms": round(e.cpu_time_total / 1000 / self.steps, 3),
                                   "device_ms": round(e.device_time_total / 1000 / self.steps, 3)}
        self_time = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        top = sorted((e for e in events if e.key not in PHASES), key=lambda e: -getattr(e, self_time))[:15]
        ops = [{"op": e.key, "self_ms_per_step": round(getattr(e, self_time) / 1000 / self.steps, 3), "calls": e.count}
               for e in top]
        (self.out_dir / "profile.json").write_text(json.dumps(
            {"steps": self.steps, "phases_per_step": per_step, "top_ops_by_self_time": ops}, indent=1))
        log.info("profile of %d steps: %s (ms per step, cpu / device) -> %s", self.steps,
                 ", ".join(f"{k} {v['cpu_ms']:.1f}/{v['device_ms']:.1f}" for k, v in per_step.items()),
                 self.out_dir / "profile.txt")
