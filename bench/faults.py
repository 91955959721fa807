"""Fault injection: random SIGKILLs, damaged files, full disks and concurrent runs against every stage,
each compared with an uninterrupted run. Prints the figures and writes them to docs/RELIABILITY.md.

    .venv/bin/python bench/faults.py --seed 17 --trials 20

Kinds (`--kinds`, default all):
- kill-regenerate, kill-extract-1, kill-extract-2, kill-train, kill-flow: the stage's whole process
  group (the stage, its workers, the flow's Prefect server) gets SIGKILL at a time drawn uniformly
  from [0, the uninterrupted run's wall time), until `--trials` kills landed while it ran (a time past
  its end is recorded as a trial too, and that run's wall time bounds later draws); the stage then
  runs again to completion. Per trial:
  whether the final output is identical to the uninterrupted run's (bytes for shards and
  regenerated data, tensors for the draft, records for the metrics log), the finished work the
  re-run did again (shards rewritten, conversations regenerated, training steps past the
  checkpoint resumed from), temporary files the kill left and whether the re-run read any (hard
  links keep each one's inode after it is removed; its atime, reset after the kill, tells).
- term-flow, int-flow: the same draws, but a polite stop: SIGTERM to the CLI's process alone (`kill PID`,
  systemd's KillMode=process, a container runtime) or SIGINT to its whole group (a terminal's Ctrl-C).
  Each trial also requires the CLI's exit code 128 + the signal and every process of the run gone
  within 10 s; then the re-run must end identical, as after a kill.
- kill-stream: the same for a streamed training (extract.mode 'stream', docs/STREAMING.md: the verifier
  extracts while the draft trains, two shards on disk at a time, every epoch extracted again); the
  shards a re-run extracted again count as redone.
- producer: a streamed training whose producer processes alone get SIGKILL at a drawn time: the stage
  must start them again, alone, and end with the uninterrupted streamed run's draft without a re-run.
- damage: a complete extraction folder with one fault each (flipped byte, truncated, deleted,
  appended garbage, a shard of other layers or other data under its name, a flipped byte with size
  and mtime kept, damaged or deleted manifest and journal). Training is given the damaged folder
  first and must refuse it naming the file; extraction must then redo only what is needed.
- checkpoint: training killed once two checkpoints exist, then a file of the newest damaged (training
  state or weights cut short, a byte flipped in either): the re-run must skip it with a warning naming
  it, resume from the one before and end identical.
- parts: a complete regeneration's part file damaged (an answer's text edited, still valid JSON; a
  record cut short; a line of garbage): the re-run must answer those conversations again and write
  the uninterrupted run's bytes.
- disk: a tmpfs too small for the plan (refused before the verifier loads), and one where the plan
  fits but another writer fills it during the run (a clear error; after space is freed the re-run
  completes, identical). Needs permission to mount (root); skipped with a note otherwise.
- concurrent: two runs of one config on one folder at once, for extraction, training and the flow.

The same functions run a few trials of each kind in CI (tests/pipeline/test_faults.py). This file is the entry point;
the suite's parts are in bench/fault_injection/ (the stages as processes, comparing outputs, the trial kinds,
the report).
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.fault_injection.kinds import (  # noqa: E402
    Trial,
    checkpoint_trials,
    concurrent_trials,
    damage_trials,
    disk_trials,
    kill_trials,
    part_trials,
    producer_trials,
)
from bench.fault_injection.report import from_logs, markdown, summarize, write_figures  # noqa: E402
from bench.fault_injection.stages import Inputs, log, stage_main  # noqa: E402

KINDS = ("kill-regenerate", "kill-extract-1", "kill-extract-2", "kill-train", "kill-stream", "kill-flow", "term-flow",
         "int-flow", "producer", "damage", "checkpoint", "parts", "disk", "concurrent")


def run_suite(inputs: Inputs, kinds: list[str], trials: int, seed: int, trials_for: dict[str, int]) -> list[Trial]:
    rng = random.Random(seed)
    results: list[Trial] = []
    for kind in kinds:
        if kind.startswith(("kill-", "term-", "int-")):
            results += kill_trials(inputs, kind, trials_for.get(kind, trials), rng)
        elif kind == "producer":
            results += producer_trials(inputs, trials_for.get(kind, trials), rng)
        elif kind == "damage":
            results += damage_trials(inputs)
        elif kind == "checkpoint":
            results += checkpoint_trials(inputs)
        elif kind == "parts":
            results += part_trials(inputs)
        elif kind == "disk":
            results += disk_trials(inputs)
        elif kind == "concurrent":
            results += concurrent_trials(inputs, max(1, trials // 10))
    return results


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["stage"]:
        return stage_main(sys.argv[2])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--seed", type=int, default=17)
    p.add_argument("--trials", type=int, default=20,
                   help="kills that land while the stage runs, per stage (concurrent runs: trials // 10)")
    p.add_argument("--trials-for", action="append", default=[], metavar="KIND=N",
                   help="another number of kills for one kind, e.g. kill-flow=8 (repeatable)")
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--work", default=None, help="scratch folder (default: a temporary one, removed after)")
    p.add_argument("--write", default=str(ROOT / "docs" / "RELIABILITY.md"), help="'' to skip writing")
    p.add_argument("--render", metavar="LOG", nargs="+",
                   help="only write the figures of earlier runs from their logs (a run cut short, then the rest)")
    a = p.parse_args(argv)
    if a.render:
        trials, commands, wall = from_logs([Path(log) for log in a.render])
        write_figures(Path(a.write), markdown(summarize(trials), trials, commands, wall))
        return 0
    t0 = time.monotonic()
    log(f"command: {command_line(a)}")
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="eagle3-faults-"))
    inputs = Inputs(work)
    trials_for = {k: int(n) for k, n in (item.split("=") for item in a.trials_for)}
    trials = run_suite(inputs, a.kinds.split(","), a.trials, a.seed, trials_for)
    rows = summarize(trials)
    print(f"took {time.monotonic() - t0:.0f} s")
    text = markdown(rows, trials, [command_line(a)], time.monotonic() - t0)
    print(text)
    if a.write:  # a run of some kinds keeps the full run's figures: it writes a block of its own
        write_figures(Path(a.write), text, "faults" if a.kinds == ",".join(KINDS) else f"faults {a.kinds}")
    if not a.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(t.ok and t.identical for t in trials if t.kind != "disk" or "not run" not in t.note) else 1


def command_line(a: argparse.Namespace) -> str:
    return f"python bench/faults.py --seed {a.seed} --trials {a.trials}" + "".join(
        f" --trials-for {item}" for item in a.trials_for) + (f" --kinds {a.kinds}" if a.kinds != ",".join(KINDS) else "")


if __name__ == "__main__":
    raise SystemExit(main())
