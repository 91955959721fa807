"""Where a training step's time goes: `train.profile_steps: N` profiles N steady-state steps with
torch.profiler (after the first window, which holds torch.compile's compilation) and writes, into
the train stage's folder, `profile.txt` (the operators that took the most device time, or CPU time
without a GPU) and `profile.json`, per step in milliseconds:
- `step_ms`: the wall time of a step (under the profiler, which adds a little);
- `device_busy_ms`: the time the GPU ran kernels or copies (the union of their intervals), so
  `step_ms - device_busy_ms` is the GPU waiting on the host: a loop bound by Python and launches;
- each phase of the loop (waiting for the loader, host-to-device copies, forward with the loss,
  backward, optimizer): `cpu_ms` is its range on the host, `device_span_ms` the span of the GPU
  work issued inside it (kernels that autograd's engine thread launches in the backward are not
  attributed to a phase, so backward's span stays near zero on a GPU);
- the 15 kernels (on a GPU) or operators (on a CPU) with the most self time.
`profile_trace.json.gz` is the whole timeline of those steps (chrome://tracing or Perfetto): where
the host waits on the device and where the device waits on the host."""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import torch
from torch.autograd import DeviceType
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
        prof.export_chrome_trace(str(self.out_dir / "profile_trace.json.gz"))
        per_step: dict[str, dict[str, float]] = {}
        for e in events:  # a phase is two rows on a GPU: its host range and its device annotation
            if e.key in PHASES:
                on_device = e.device_type != DeviceType.CPU
                field, total = ("device_span_ms", e.device_time_total) if on_device else ("cpu_ms", e.cpu_time_total)
                per_step.setdefault(e.key, {})[field] = round(total / 1000 / self.steps, 3)
        step_ms, busy_ms = step_and_busy_ms(prof.events(), self.steps)
        self_time = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        host_keys = {e.key for e in events if e.device_type == DeviceType.CPU}
        # on a GPU the kernels themselves (a device row named like a host range is that range's annotation)
        rows = [e for e in events if (e.device_type != DeviceType.CPU and e.key not in host_keys)] if self.cuda else [
            e for e in events if e.key not in PHASES]
        top = sorted(rows, key=lambda e: -getattr(e, self_time))[:15]
        ops = [{"op": e.key, "self_ms_per_step": round(getattr(e, self_time) / 1000 / self.steps, 3), "calls": e.count}
               for e in top]
        (self.out_dir / "profile.json").write_text(json.dumps(
            {"steps": self.steps, "step_ms": step_ms, "device_busy_ms": busy_ms if self.cuda else None,
             "phases_per_step": per_step, "top_ops_by_self_time": ops}, indent=1))
        busy = f", the GPU busy {busy_ms:.1f} ms of it" if self.cuda else ""
        log.info("profile of %d steps: %.1f ms per step%s; host ms per phase: %s -> %s", self.steps, step_ms, busy,
                 ", ".join(f"{k} {v.get('cpu_ms', 0):.1f}" for k, v in per_step.items()), self.out_dir / "profile.txt")


def step_and_busy_ms(events, steps: int) -> tuple[float, float]:
    """Wall time per profiled step, and the time per step the device ran anything: the union of
    its kernels' and copies' intervals (streams that overlap count once; annotations are not work)."""
    step_us = sum(e.time_range.elapsed_us() for e in events
                  if e.key.startswith("ProfilerStep") and e.device_type == DeviceType.CPU)
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False))
    busy_us, covered_to = 0.0, float("-inf")
    for start, end in spans:
        if end > covered_to:
            busy_us += end - max(start, covered_to)
            covered_to = end
    return round(step_us / 1000 / steps, 3), round(busy_us / 1000 / steps, 3)
