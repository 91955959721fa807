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
- damage: a complete extraction folder with one fault each (flipped byte, truncated, deleted,
  appended garbage, a shard of other layers or other data under its name, a flipped byte with size
  and mtime kept, damaged or deleted manifest and journal). Training is given the damaged folder
  first and must refuse it naming the file; extraction must then redo only what is needed.
- disk: a tmpfs too small for the plan (refused before the verifier loads), and one where the plan
  fits but another writer fills it during the run (a clear error; after space is freed the re-run
  completes, identical). Needs permission to mount (root); skipped with a note otherwise.
- concurrent: two runs of one config on one folder at once, for extraction, training and the flow.

The same functions run a few trials of each kind in CI (tests/test_faults.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Small on purpose (a few shards, checkpoints and chunks: 20 kills of each stage fit in about an hour and
# a half on 2 shared CPU cores); eval_every and log_every are coprime, so log windows straddle
# checkpoints; 3 epochs pack into different step counts. The flow leaves regeneration out (it has its own
# kills): its kills land in prepare, extraction, vocab, training and validation.
EXTRACT = {"batch_tokens": 2048, "shard_tokens": 200}
TRAIN = {"epochs": 3, "total_seq_len": 256, "lr": 2e-3, "eval_every": 4, "log_every": 3, "val_fraction": 0.15,
         "seed": 1, "keep_checkpoints": 2}
REGENERATE = {"enabled": True, "backend": "transformers", "max_new_tokens": 6, "max_turns": 1, "chunk_size": 2,
              "batch_size": 2}
REGENERATE_ROWS, REGENERATE_PROMPT_TOKENS = 6, 128  # 3 chunks
TIMING_FIELDS = ("tokens_per_s",)


@dataclass
class Trial:
    kind: str
    fault: str  # what was done: "kill at 3.2 s", "flipped byte in shard-000002-..."
    identical: bool  # the final output equals the uninterrupted run's
    redone: int = 0  # finished work done again after the fault (shards, conversations, steps)
    temporaries_left: int = 0
    temporaries_read: int | None = 0  # None: atime not tracked on this filesystem
    ok: bool = True  # the fault was handled as promised (detected, refused, clear error...)
    note: str = ""


# ---------------------------------------------------------------- the inputs and the stages as processes


@dataclass
class Inputs:
    """Small real inputs (SmolLM2, ShareGPT) shared by every trial, and the uninterrupted references."""

    work: Path
    smollm2: str = ""
    sharegpt: str = ""
    prepared: object = None
    vocab: object = None
    references: dict = field(default_factory=dict)  # kind -> (output folder, wall seconds)

    def __post_init__(self):
        from tasks.demo_assets import ensure_asset
        from tasks.prepare import prepare
        from tasks.vocab import build_vocab

        self.work.mkdir(parents=True, exist_ok=True)
        self.smollm2, self.sharegpt = str(ensure_asset("smollm2-135m-instruct")), str(ensure_asset("sharegpt"))
        self.prepared = prepare(self.smollm2, [self.sharegpt], self.work / "inputs", max_seq_len=128, max_rows=16)
        self.vocab = build_vocab(self.prepared.path, self.prepared.fingerprint, self.smollm2, self.work / "inputs",
                                 draft_vocab_size=1024)

    def extract_job(self, out: Path, **settings) -> dict:
        from tasks.extract import ExtractJob

        return {"extract": asdict(ExtractJob(self.prepared.path, self.prepared.fingerprint, self.smollm2, str(out),
                                             settings={**EXTRACT, **settings}))}

    def train_job(self, out: Path, manifest: str | None = None) -> dict:
        from tasks.train import TrainJob

        manifest = manifest or str(next(self.reference("extract-1")[0].glob("manifest-*.json")))
        job = TrainJob(manifest, self.prepared.path, self.vocab.path, self.smollm2, str(out), [2, 15, 27],
                       settings=TRAIN)
        return {"train": asdict(job), "manifest_fp": "bench", "vocab_fp": self.vocab.fingerprint}

    def regenerate_job(self, out: Path) -> dict:
        from tasks.regenerate import RegenerateJob

        return {"regenerate": asdict(RegenerateJob([self.sharegpt], REGENERATE_ROWS, self.smollm2, str(out),
                                                    REGENERATE_PROMPT_TOKENS, REGENERATE))}

    def flow_config(self, out: Path) -> dict:
        return {"name": "faults", "output_dir": str(out), "verifier": {"path": self.smollm2},
                "data": {"sources": [self.sharegpt], "max_rows": 8, "max_seq_len": 128},
                "extract": EXTRACT, "vocab": {"draft_vocab_size": 512}, "train": TRAIN, "validation": {"live": "skip"}}

    def command(self, kind: str, out: Path) -> list[str]:
        """The stage as a process: `faults.py stage JOB` (extract, train, regenerate) or the CLI."""
        out.mkdir(parents=True, exist_ok=True)
        if kind == "flow":
            config = out.parent / f"{out.name}.yaml"
            config.write_text(json.dumps(self.flow_config(out)))
            return [sys.executable, "-m", "flows.cli", "run", str(config)]
        stage = kind.split("-")[0]
        job = {"extract": lambda: self.extract_job(out, workers=int(kind.split("-")[1])),
               "train": lambda: self.train_job(out), "regenerate": lambda: self.regenerate_job(out)}[stage]()
        job_file = out.parent / f"{out.name}.job.json"
        job_file.write_text(json.dumps(job))
        return [sys.executable, str(Path(__file__).resolve()), "stage", str(job_file)]

    def reference(self, kind: str) -> tuple[Path, float]:
        """An uninterrupted run of `kind` (done once): its output folder and wall time."""
        if kind not in self.references:
            out = self.work / f"reference-{kind}"
            shutil.rmtree(out, ignore_errors=True)
            t0 = time.monotonic()
            proc = run_stage(self.command(kind, out), out.with_suffix(".log"))
            if proc.returncode != 0:
                raise RuntimeError(f"the uninterrupted {kind} run failed: see {out.with_suffix('.log')}")
            wall = time.monotonic() - t0
            self.references[kind] = (out, wall)
            log(f"reference {kind}: {wall:.1f} s")
        return self.references[kind]


ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
ENV.pop("PREFECT_HOME", None)  # each flow run keeps its Prefect database under its own output folder
ENV.pop("PREFECT_API_URL", None)


def run_stage(cmd: list[str], log_file: Path, kill_at: float | None = None) -> subprocess.Popen:
    """Run a stage in its own process group; with `kill_at`, SIGKILL the whole group then (unless it
    ended before). `returncode` is -9 when it was killed."""
    with log_file.open("a") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=ENV, cwd=ROOT, start_new_session=True)
        try:
            proc.wait(timeout=kill_at)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            wait_group_gone(proc.pid)
    return proc


def wait_group_gone(pgid: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            return
        time.sleep(0.05)


def stage_main(job_file: str) -> int:
    """One stage, as the pipeline runs it (workers and training in their own subprocesses)."""
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    job = json.loads(Path(job_file).read_text())
    if "extract" in job:
        from tasks.extract import ExtractJob, run_extraction

        result = run_extraction(ExtractJob(**job["extract"]))
    elif "train" in job:
        from tasks.train import TrainJob, run_training

        result = run_training(TrainJob(**job["train"]), job["manifest_fp"], job["vocab_fp"])
    else:
        from tasks.regenerate import RegenerateJob, regenerate

        result = regenerate(RegenerateJob(**job["regenerate"]))
    print("RESULT " + json.dumps(asdict(result) if hasattr(result, "__dataclass_fields__") else str(result)))
    return 0


# ---------------------------------------------------------------- comparing outputs


def shard_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("shard-*.safetensors"))}


def same_extraction(folder: Path, reference: Path) -> bool:
    manifests = sorted(p.name for p in folder.glob("manifest-*.json"))
    return shard_files(folder) == shard_files(reference) and manifests == sorted(
        p.name for p in reference.glob("manifest-*.json")) and all(
        (folder / m).read_bytes() == (reference / m).read_bytes() for m in manifests)


def same_draft(a: Path, b: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    x, y = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def metrics_records(folder: Path) -> list[dict]:
    from tasks.tracking import read_metrics

    return [{k: v for k, v in m.items() if k not in TIMING_FIELDS} for m in read_metrics(folder)]


def same_training(folder: Path, reference: Path) -> tuple[bool, str]:
    if not (folder / "draft").is_dir():
        return False, "no draft"
    draft, metrics = same_draft(folder / "draft", reference / "draft"), metrics_records(folder) == metrics_records(
        reference)
    return draft and metrics, "" if draft and metrics else f"draft identical: {draft}, metrics log identical: {metrics}"


def train_folder(flow_out: Path) -> Path:
    return next((flow_out / "train").iterdir())


# ---------------------------------------------------------------- temporaries and what a kill left


TEMPORARY = re.compile(r"^\.tmp-|^\.[0-9a-f]{16}\.\w+$")  # ours, and tempfile.mkdtemp's of prepare and vocab


class Temporaries:
    """Temporary files a kill left, hard-linked aside (the inode outlives its removal) with atime reset:
    after the re-run, an atime that moved means the file was read."""

    def __init__(self, out: Path, watch: Path):
        self.links: list[Path] = []
        watch.mkdir(parents=True, exist_ok=True)
        for path in out.rglob("*"):
            if ".prefect" in path.parts or not TEMPORARY.match(path.name):
                continue
            for f in [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]:
                link = watch / f"{len(self.links)}-{f.name}"
                os.link(f, link)
                os.utime(link, ns=(0, f.stat().st_mtime_ns))
                self.links.append(link)
        self.left = len([p for p in out.rglob("*") if ".prefect" not in p.parts and TEMPORARY.match(p.name)])

    def read(self) -> int | None:
        return sum(link.stat().st_atime_ns != 0 for link in self.links) if ATIME_WORKS else None


def atime_tracks_reads(folder: Path) -> bool:
    probe = folder / ".atime-probe"
    probe.write_bytes(b"x")
    os.utime(probe, ns=(0, probe.stat().st_mtime_ns))
    probe.read_bytes()
    works = probe.stat().st_atime_ns != 0
    probe.unlink()
    return works


ATIME_WORKS = True


# ---------------------------------------------------------------- kills


def kill_trials(inputs: Inputs, kind: str, kills: int, rng: random.Random) -> list[Trial]:
    """Trials until `kills` kills landed while the stage ran (a drawn time past the run's end, on a
    machine busier for the reference than for the trial, is recorded too; at most 2 * kills trials).
    Times are drawn up to the shortest uninterrupted run seen: the reference's, or a trial's that
    ended before its kill (on a shared machine the reference may have run slower than the trials)."""
    stage = kind.removeprefix("kill-")
    ref_out, wall = inputs.reference(stage)
    out_of = {"flow": train_folder}.get(stage.split("-")[0], lambda out: out)
    results: list[Trial] = []
    landed = 0
    for i in range(2 * kills):
        if landed == kills:
            break
        out = inputs.work / f"{kind}-{i}"
        shutil.rmtree(out, ignore_errors=True)
        kill_at = rng.uniform(0, wall)
        logfile = out.with_suffix(".log")
        logfile.unlink(missing_ok=True)
        t0 = time.monotonic()
        killed = run_stage(inputs.command(stage, out), logfile, kill_at).returncode == -signal.SIGKILL
        if not killed:
            wall = min(wall, time.monotonic() - t0)
        before = snapshot(stage, out)
        temporaries = Temporaries(out, inputs.work / f"watch-{kind}-{i}")
        rerun = run_stage(inputs.command(stage, out), logfile)
        trial = Trial(kind, f"kill at {kill_at:.1f} s" + ("" if killed else " (after the run ended)"), False,
                      temporaries_left=temporaries.left, temporaries_read=temporaries.read())
        if rerun.returncode != 0:
            trial.ok, trial.note = False, f"re-run failed (exit {rerun.returncode}), see {logfile}"
        else:
            trial.identical, trial.note = compare(stage, out, ref_out, out_of)
            trial.redone = redone(stage, before, out)
        results.append(trial)
        landed += killed
        log(f"{kind} {landed}/{kills}: {trial}")
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(inputs.work / f"watch-{kind}-{i}", ignore_errors=True)
    return results


def snapshot(stage: str, out: Path) -> dict:
    """What a kill left finished: shard files (inode, mtime), conversations written, the training log."""
    from tasks.checkpoints import checkpoint_dirs

    hidden = out / "hidden_states" if stage == "flow" else out
    state = {"shards": {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in hidden.glob("shard-*.safetensors")}}
    if stage == "regenerate":
        state["recorded"] = recorded_conversations(out)
    trains = [out] if stage == "train" else list((out / "train").glob("*")) if stage == "flow" else []
    if trains and (trains[0] / "metrics.jsonl").is_file():
        steps = [json.loads(line)["step"] for line in (trains[0] / "metrics.jsonl").read_text().splitlines()
                 if line.endswith("}")]
        checkpoints = checkpoint_dirs(trains[0])
        resume = int(checkpoints[-1].name.removeprefix("step-")) if checkpoints else 0
        state["steps_past_checkpoint"] = max(steps, default=0) - resume
    return state


def redone(stage: str, before: dict, out: Path) -> int:
    """Finished work the re-run did again: shards rewritten, conversations written again, steps
    logged before the kill past the checkpoint it resumed from (the log's granularity is log_every)."""
    hidden = out / "hidden_states" if stage == "flow" else out
    rewritten = sum(1 for name, ident in before["shards"].items()
                    if (p := hidden / name).is_file() and (p.stat().st_ino, p.stat().st_mtime_ns) != ident)
    again = 0
    if "recorded" in before:  # records of a conversation recorded before the kill, written again
        after = recorded_conversations(out)
        again = sum(after.count(row_id) - 1 for row_id in set(before["recorded"]))
    return rewritten + again + before.get("steps_past_checkpoint", 0)


def recorded_conversations(out: Path) -> list[str]:
    """The ids of the conversations regeneration recorded (complete lines of its part files, tasks/regenerate.py)."""
    return [json.loads(line)["id"] for part in sorted((out / "parts").glob("*.jsonl"))
            for line in part.read_bytes().split(b"\n")[:-1]]


def compare(stage: str, out: Path, ref_out: Path, out_of: Callable) -> tuple[bool, str]:
    if stage.startswith("extract"):
        return same_extraction(out, ref_out), ""
    if stage == "regenerate":
        files = ("conversations.jsonl", "failed.jsonl")
        same = all((out / f).read_bytes() == (ref_out / f).read_bytes() for f in files)
        return same, ""
    if stage == "flow" and not same_extraction(out / "hidden_states", ref_out / "hidden_states"):
        return False, "extraction differs"
    return same_training(out_of(out), out_of(ref_out))


# ---------------------------------------------------------------- damage


def damage_cases(inputs: Inputs) -> dict[str, tuple[Callable[[Path], Path], int]]:
    """name -> (damage the folder, returning the file a reader must name; shards extraction redoes)."""
    from tasks.extract import ExtractJob, run_extraction

    def other_layers() -> Path:  # a shard of an extraction with other layers (made once, when first needed)
        other = inputs.work / "other-layers"
        if not list(other.glob("manifest-*.json")):
            run_extraction(ExtractJob(**inputs.extract_job(other, aux_layers=[3, 14, 26])["extract"]),
                           in_process=True)
        return shard(other)

    def shard(folder: Path, n: int = 2) -> Path:
        return sorted(folder.glob("shard-*.safetensors"))[n]

    def flip(folder: Path, keep_times: bool = False) -> Path:
        path = shard(folder)
        stat = path.stat()
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x04
        path.write_bytes(bytes(data))
        if keep_times:
            os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        return path

    def edit(change: Callable[[Path], None], target: Callable[[Path], Path]) -> Callable[[Path], Path]:
        def apply(folder: Path) -> Path:
            path = target(folder)
            change(path)
            return path
        return apply

    manifest = lambda folder: next(folder.glob("manifest-*.json"))  # noqa: E731
    journal = lambda folder: next((folder / "journal").glob("*.jsonl"))  # noqa: E731
    return {
        "flipped byte in a shard": (flip, 1),
        "flipped byte, size and mtime kept": (lambda f: flip(f, keep_times=True), 1),
        "truncated shard": (edit(lambda p: os.truncate(p, p.stat().st_size // 2), shard), 1),
        "deleted shard": (edit(Path.unlink, shard), 1),
        "garbage appended to a shard": (edit(lambda p: p.write_bytes(p.read_bytes() + os.urandom(999)), shard), 1),
        "shard of other layers swapped in": (edit(lambda p: shutil.copyfile(other_layers(), p), shard), 1),
        "shard of other data swapped in": (lambda f: edit(lambda p: shutil.copyfile(shard(f, 3), p), shard)(f), 1),
        "garbage manifest": (edit(lambda p: p.write_bytes(os.urandom(4096)), manifest), 0),
        "truncated manifest": (edit(lambda p: os.truncate(p, p.stat().st_size // 2), manifest), 0),
        "deleted manifest": (edit(Path.unlink, manifest), 0),
        "journal of random bytes": (edit(lambda p: p.write_bytes(os.urandom(2048)), journal), 0),
        "journal line not an object": (edit(lambda p: p.write_bytes(b"[1]\n" + p.read_bytes()), journal), 0),
        "journal entry missing a field": (edit(lambda p: p.write_bytes(b'{"name": "x"}\n' + p.read_bytes()), journal),
                                          0),
        "deleted journal": (lambda f: (shutil.rmtree(f / "journal"), f / "journal")[1], 0),
    }


def damage_trials(inputs: Inputs, only: list[str] | None = None) -> list[Trial]:
    """Each damage to a copy of the complete reference extraction: training must refuse the folder
    naming the file (where training reads it), then extraction must redo only what is needed."""
    from tasks.shards import ShardError
    from tasks.train import TrainJob, run_training

    ref_out, _ = inputs.reference("extract-1")
    manifest = next(ref_out.glob("manifest-*.json"))
    results = []
    for case, (damage, expect_redone) in damage_cases(inputs).items():
        if only and case not in only:
            continue
        folder = inputs.work / "damaged"
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(ref_out, folder)
        named = damage(folder)
        trial = Trial("damage", case, False)
        if "journal" not in case:  # training reads shards and the manifest, never the journal
            job = TrainJob(**{**inputs.train_job(inputs.work / "damaged-train")["train"],
                              "manifest": str(folder / manifest.name)})
            try:
                run_training(job, "bench", inputs.vocab.fingerprint, in_process=True)
                trial.ok, trial.note = False, "training accepted the damaged folder"
            except ShardError as e:
                trial.note = f"training refused: {str(e)[:160]}"
                trial.ok = str(named) in str(e)
            shutil.rmtree(inputs.work / "damaged-train", ignore_errors=True)
        proc = run_stage(inputs.command("extract-1", folder), folder.with_suffix(".log"))
        result = stage_result(folder.with_suffix(".log"))
        trial.identical = proc.returncode == 0 and same_extraction(folder, ref_out)
        trial.redone = (result or {}).get("shards_extracted", -1)
        trial.ok = trial.ok and trial.identical and trial.redone == expect_redone
        results.append(trial)
        log(f"damage: {trial}")
        folder.with_suffix(".log").unlink(missing_ok=True)
    return results


def stage_result(logfile: Path) -> dict | None:
    lines = [line for line in logfile.read_text().splitlines() if line.startswith("RESULT ")]
    return json.loads(lines[-1].removeprefix("RESULT ")) if lines else None


# ---------------------------------------------------------------- disk


def disk_trials(inputs: Inputs) -> list[Trial]:
    """Extraction into a small tmpfs: one that cannot hold the plan, one another writer fills."""
    ref_out, _ = inputs.reference("extract-1")
    need = sum(p.stat().st_size for p in ref_out.glob("shard-*.safetensors"))
    results = []
    with tmpfs(inputs.work / "small-disk", need // 2) as disk:
        if disk is None:
            return [Trial("disk", "tmpfs", False, ok=False, note="cannot mount a tmpfs here (needs root): not run")]
        out = disk / "hidden_states"
        logfile = inputs.work / "disk-small.log"
        logfile.unlink(missing_ok=True)
        proc = run_stage(without_reserve(inputs.command("extract-1", out)), logfile)
        text = logfile.read_text()
        refused = proc.returncode != 0 and "not enough disk" in text and "weight bytes" not in text  # no load
        results.append(Trial("disk", f"plan ({need / 1e6:.1f} MB) larger than the disk ({need // 2 / 1e6:.1f} MB)",
                             identical=not list(out.glob("shard-*")), ok=refused, note=last_error(text)))
    with tmpfs(inputs.work / "filled-disk", need + 8 * 2**20) as disk:
        out = disk / "hidden_states"
        logfile = inputs.work / "disk-filled.log"
        logfile.unlink(missing_ok=True)
        cmd = without_reserve(inputs.command("extract-1", out))
        with logfile.open("a") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=ENV, cwd=ROOT, start_new_session=True)
        while not list(out.glob("shard-*")) and proc.poll() is None:
            time.sleep(0.05)
        filler = disk / "filler"
        with filler.open("wb") as f:  # another writer takes every free byte
            try:
                while True:
                    f.write(b"\0" * 2**20)
                    f.flush()
            except OSError:
                pass
        proc.wait()
        text = logfile.read_text()
        clear = proc.returncode != 0 and "No space left on device" in text and str(out) in text
        filler.unlink()
        rerun = run_stage(cmd, logfile)
        note = next((line for line in text.splitlines() if "No space left on device" in line), last_error(text))
        results.append(Trial("disk", "another writer fills the disk during the run", rerun.returncode == 0 and
                             same_extraction(out, ref_out), ok=clear, note=note[-240:]))
    for trial in results:
        log(f"disk: {trial}")
    return results


def without_reserve(cmd: list[str]) -> list[str]:
    """The extraction command with extract.reserve_disk_gb=0: the plan alone decides what fits."""
    job = json.loads(Path(cmd[-1]).read_text())
    job["extract"]["settings"]["reserve_disk_gb"] = 0
    Path(cmd[-1]).write_text(json.dumps(job))
    return cmd


def last_error(text: str) -> str:
    errors = [line for line in text.splitlines() if re.search(r"Error\b.*:", line)]
    return errors[-1][-220:] if errors else ""


class tmpfs:
    """A tmpfs of `size` bytes mounted at `path` for the block (None where mounting is not allowed)."""

    def __init__(self, path: Path, size: int):
        self.path, self.size = path, size

    def __enter__(self) -> Path | None:
        self.path.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size}", "tmpfs", str(self.path)],
                              capture_output=True)
        self.mounted = proc.returncode == 0
        return self.path if self.mounted else None

    def __exit__(self, *exc) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], check=False)


# ---------------------------------------------------------------- two runs at once


def concurrent_trials(inputs: Inputs, trials: int, kinds=("extract-2", "train", "flow")) -> list[Trial]:
    """Two runs of one config on one folder, started together: one runs, the other is refused at
    once naming the first's process and host; the folder ends identical to the reference."""
    import socket

    results = []
    for kind in kinds:
        ref_out, _ = inputs.reference(kind)
        for i in range(trials):
            out = inputs.work / f"concurrent-{kind}-{i}"
            shutil.rmtree(out, ignore_errors=True)
            cmd = inputs.command(kind, out)
            logs = [inputs.work / f"concurrent-{kind}-{i}-{n}.log" for n in (0, 1)]
            procs = []
            for logfile in logs:
                with logfile.open("w") as f:
                    procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=ENV, cwd=ROOT,
                                                  start_new_session=True))
            for p in procs:
                p.wait()
            refused = [n for n, p in enumerate(procs) if p.returncode != 0]
            ok = len(refused) == 1
            note = ""
            if ok:
                text, other = logs[refused[0]].read_text(), procs[1 - refused[0]].pid
                ok = f"pid {other} on host {socket.gethostname()}" in text
                note = next(iter(re.findall(r"is in use by another .*? run \(pid \d+ on host [^,]+", text)), "")
            identical = not refused or procs[1 - refused[0]].returncode == 0
            identical = identical and compare(kind, out, ref_out, train_folder if kind == "flow" else lambda o: o)[0]
            results.append(Trial("concurrent", f"two {kind} runs on one folder", identical, ok=ok, note=note))
            log(f"concurrent: {results[-1]}")
            shutil.rmtree(out, ignore_errors=True)
    return results


# ---------------------------------------------------------------- report


KINDS = ("kill-regenerate", "kill-extract-1", "kill-extract-2", "kill-train", "kill-flow", "damage", "disk",
         "concurrent")


def summarize(trials: list[Trial]) -> list[dict]:
    rows = []
    for kind in dict.fromkeys(t.kind for t in trials):
        ts = [t for t in trials if t.kind == kind]
        reads = [t.temporaries_read for t in ts if t.temporaries_read is not None]
        rows.append({"kind": kind, "trials": len(ts),
                     "faults injected": sum("after the run ended" not in t.fault for t in ts),
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
    lines += ["", "Every trial:", "",
              "| kind | fault | identical | redone | temporaries left / read | handled | note |",
              "|---|---|---|---|---|---|---|"]
    lines += [f"| {t.kind} | {t.fault} | {t.identical} | {t.redone} | {t.temporaries_left} / {t.temporaries_read} | "
              f"{t.ok} | {t.note.replace('|', '/')} |" for t in trials]
    return "\n".join(lines) + "\n"


def log(message: str) -> None:
    print(f"[faults {time.strftime('%H:%M:%S')}] {message}", flush=True)


def run_suite(inputs: Inputs, kinds: list[str], trials: int, seed: int, trials_for: dict[str, int]) -> list[Trial]:
    global ATIME_WORKS
    ATIME_WORKS = atime_tracks_reads(inputs.work)
    rng = random.Random(seed)
    results: list[Trial] = []
    for kind in kinds:
        if kind.startswith("kill-"):
            results += kill_trials(inputs, kind, trials_for.get(kind, trials), rng)
        elif kind == "damage":
            results += damage_trials(inputs)
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
    if a.write:
        write_figures(Path(a.write), text)
    if not a.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(t.ok and t.identical for t in trials if t.kind != "disk" or "not run" not in t.note) else 1


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


def command_line(a: argparse.Namespace) -> str:
    return f"python bench/faults.py --seed {a.seed} --trials {a.trials}" + "".join(
        f" --trials-for {item}" for item in a.trials_for) + (f" --kinds {a.kinds}" if a.kinds != ",".join(KINDS) else "")


def write_figures(path: Path, figures: str) -> None:
    """Replace the figures between the markers in docs/RELIABILITY.md, keeping the prose around them."""
    start, end = "<!-- faults:begin -->", "<!-- faults:end -->"
    text = path.read_text() if path.is_file() else f"# Reliability\n\n{start}\n{end}\n"
    before, rest = text.split(start, 1)
    path.write_text(before + start + "\n" + figures + end + rest.split(end, 1)[1])


if __name__ == "__main__":
    raise SystemExit(main())
