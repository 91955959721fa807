"""The suite's figures: a summary row per kind, every trial, as markdown between the markers in
docs/RELIABILITY.md; and the trials recorded in earlier runs' logs (`--render`)."""

from __future__ import annotations

import os
import re
import statistics
import time
from pathlib import Path

from bench.fault_injection.kinds import Trial


def summarize(trials: list[Trial]) -> list[dict]:
    rows = []
    for kind in dict.fromkeys(t.kind for t in trials):
        ts = [t for t in trials if t.kind == kind]
        reads = [t.temporaries_read for t in ts if t.temporaries_read is not None]
        rows.append({"kind": kind, "trials": len(ts),
                     "faults injected": sum(not any(s in t.fault for s in ("after the run ended", "none running"))
                                            for t in ts),
                     "identical": sum(t.identical for t in ts),
                     "handled as promised": sum(t.ok for t in ts),
                     "most finished work redone": max(t.redone for t in ts),
                     "temporaries left (most)": max(t.temporaries_left for t in ts),
                     "temporaries read": sum(reads) if reads else "n/a"})
    return rows


def markdown(rows: list[dict], trials: list[Trial], commands: list[str], wall_s: float) -> str:
    head = list(rows[0])
    lines = [f"Measured {time.strftime('%Y-%m-%d')} on this machine ({os.cpu_count()} CPU cores, no GPU), "
             f"{wall_s / 60:.0f} min:", "", *(f"    {command}" for command in commands), "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(r[k]) for k in head) + " |" for r in rows]
    lines += stop_times(trials)
    lines += ["", "Every trial:", "",
              "| kind | fault | identical | redone | temporaries left / read | handled | note |",
              "|---|---|---|---|---|---|---|"]
    lines += [f"| {t.kind} | {t.fault} | {t.identical} | {t.redone} | {t.temporaries_left} / {t.temporaries_read} | "
              f"{t.ok} | {t.note.replace('|', '/')} |" for t in trials]
    return "\n".join(lines) + "\n"


def stop_times(trials: list[Trial]) -> list[str]:
    """For the polite stops (term-flow, int-flow, a CPU burner on every core): the seconds from the signal
    until every process of the run was gone, as distributed, and how far the CLI's own line was from them."""
    lines = []
    for kind in dict.fromkeys(t.kind for t in trials if t.stop_s is not None):
        times = sorted(t.stop_s for t in trials if t.kind == kind and t.stop_s is not None)
        off = [abs(t.said_s - t.stop_s) for t in trials if t.kind == kind and t.stop_s is not None and t.said_s]
        lines.append(f"- {kind}, every process gone after (s, {len(times)} stops): min {times[0]:.1f}, median "
                     f"{statistics.median(times):.1f}, max {times[-1]:.1f} (promise: 10); the CLI's line within "
                     f"{max(off, default=float('nan')):.1f} s of it")
    return ["", "Polite stops, a process spinning on every core beside each:", "", *lines] if lines else []


def from_logs(logs: list[Path]) -> tuple[list[Trial], list[str], float]:
    """The trials, commands and wall time (summed) that the logs of earlier runs recorded."""
    trials, commands, wall = [], [], 0.0
    for path in logs:
        text = path.read_text()
        found = re.findall(r"^\[faults [\d:]+\] [\w -/]+: (Trial\(.*\))$", text, re.M)
        trials += [eval(t, {"Trial": Trial, "__builtins__": {}}) for t in found]  # our own log's reprs
        commands += re.findall(r"^\[faults [\d:]+\] command: (.*)$", text, re.M)
        took = re.search(r"^took (\d+) s$", text, re.M)
        stamps = [time.strptime(t, "%H:%M:%S") for t in re.findall(r"^\[faults ([\d:]+)\]", text, re.M)]
        wall += int(took[1]) if took else (time.mktime(stamps[-1]) - time.mktime(stamps[0])) % 86400
    return trials, commands, wall


def write_figures(path: Path, figures: str, block: str = "faults") -> None:
    """Replace the figures between the block's markers in docs/RELIABILITY.md, keeping the prose around
    them; a block not there yet is added at the end."""
    start, end = f"<!-- {block}:begin -->", f"<!-- {block}:end -->"
    text = path.read_text() if path.is_file() else "# Reliability\n"
    if start not in text:
        text = text.rstrip("\n") + f"\n\n{start}\n{end}\n"
    before, rest = text.split(start, 1)
    path.write_text(before + start + "\n" + figures + end + rest.split(end, 1)[1])
