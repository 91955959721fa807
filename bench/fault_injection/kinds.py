"""The trial kinds (bench/faults.py's docstring says what each promises): a stage killed or stopped at a
random time, then run again; a complete extraction folder damaged; a checkpoint or a regeneration part
file damaged; a full disk; two runs on one folder."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from bench.fault_injection.outputs import (
    Temporaries,
    compare,
    recorded_conversations,
    redone,
    same_extraction,
    same_training,
    snapshot,
    train_folder,
)
from bench.fault_injection.stages import ENV, POLITE_STOP_S, ROOT, Inputs, cpu_burner, log, run_stage


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
    stop_s: float | None = None  # a polite stop: the signal to every process of the run gone (the CLI included)
    said_s: float | None = None  # the time the CLI's stop line said


# ---------------------------------------------------------------- kills


STOPS = {"kill": ("kill", signal.SIGKILL), "term": ("SIGTERM to the CLI alone", signal.SIGTERM),
         "int": ("SIGINT to the group", signal.SIGINT)}


def kill_trials(inputs: Inputs, kind: str, kills: int, rng: random.Random) -> list[Trial]:
    """Trials until `kills` kills landed while the stage ran (a drawn time past the run's end, on a
    machine busier for the reference than for the trial, is recorded too; at most 2 * kills trials).
    Times are drawn up to the shortest uninterrupted run seen: the reference's, or a trial's that
    ended before its kill (on a shared machine the reference may have run slower than the trials).
    `term-flow` and `int-flow` stop the CLI politely instead (run_stage's `how`), a CPU burner
    spinning on every core meanwhile: the trial also requires exit 128 + the signal, every process
    of the run gone within POLITE_STOP_S, and the CLI's stop line within 1 s of the time measured here."""
    how, stage = kind.split("-", 1)
    what, signum = STOPS[how]
    ref_out, wall = inputs.reference(stage)
    out_of = {"flow": train_folder, "stream": lambda out: out / "train"}.get(stage.split("-")[0], lambda out: out)
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
        with cpu_burner() if how != "kill" else contextlib.nullcontext():
            stopped = run_stage(inputs.command(stage, out), logfile, kill_at, how)
        # a polite stop that came after the CLI said it was done (while it exited) stopped no work
        killed = stopped.stopped and not (how != "kill" and "eagle3-pipeline: done in" in logfile.read_text())
        if not killed:
            wall = min(wall, time.monotonic() - t0)
        before = snapshot(stage, out)
        temporaries = Temporaries(out, inputs.work / f"watch-{kind}-{i}")
        rerun = run_stage(inputs.command(stage, out), logfile)
        trial = Trial(kind, f"{what} at {kill_at:.1f} s" + ("" if killed else " (after the run ended)"), False,
                      temporaries_left=temporaries.left, temporaries_read=temporaries.read())
        polite = how != "kill" and killed
        if polite:
            said = re.findall(r"stopped by SIG\w+\b[^\n]*? ended after ([\d.]+) s", logfile.read_text())
            trial.stop_s, trial.said_s = stopped.stop_s, float(said[-1]) if said else None
            gone = (f"processes left after {POLITE_STOP_S:.0f} s" if stopped.stop_s is None else
                    f"every process gone in {stopped.stop_s:.1f} s") + (
                    f" (the CLI said {trial.said_s:.1f} s)" if said else " (the CLI's stop line missing)")
            trial.ok = (stopped.returncode == 128 + signum and stopped.stop_s is not None and bool(said)
                        and abs(trial.said_s - stopped.stop_s) <= 1.0)
            trial.note = gone + ("; " if trial.ok else f"; exit {stopped.returncode} (expected {128 + signum}), "
                                                        f"see {logfile}; ")
        if rerun.returncode != 0:
            trial.ok, trial.note = False, trial.note + f"re-run failed (exit {rerun.returncode}), see {logfile}"
        else:
            trial.identical, compared = compare(stage, out, ref_out, out_of)
            trial.note += compared
            trial.redone = redone(stage, before, out)
        results.append(trial)
        landed += killed
        log(f"{kind} {landed}/{kills}: {trial}")
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(inputs.work / f"watch-{kind}-{i}", ignore_errors=True)
    return results


def producer_trials(inputs: Inputs, kills: int, rng: random.Random) -> list[Trial]:
    """A streamed training whose producer processes alone get SIGKILL at a drawn time: the stage must
    start them again, alone, and end with the uninterrupted streamed run's draft, without a re-run."""
    ref_out, wall = inputs.reference("stream")
    results = []
    for i in range(kills):
        out = inputs.work / f"producer-{i}"
        shutil.rmtree(out, ignore_errors=True)
        logfile = out.with_suffix(".log")
        logfile.unlink(missing_ok=True)
        kill_at = rng.uniform(0, wall)
        with logfile.open("a") as sink:
            stage = subprocess.Popen(inputs.command("stream", out), stdout=sink, stderr=subprocess.STDOUT, env=ENV,
                                     cwd=ROOT, start_new_session=True)
            time.sleep(kill_at)
            killed = [p for p in psutil.process_iter(["cmdline"]) if stage.poll() is None
                      and "tasks.extract.stream" in " ".join(p.info["cmdline"] or []) and p.pid != stage.pid]
            for p in killed:
                with contextlib.suppress(psutil.Error):
                    p.kill()
            code = stage.wait()
        trial = Trial("producer", f"producer killed at {kill_at:.1f} s" + ("" if killed else " (none running)"), False)
        restarted = "started again, alone" in logfile.read_text()
        if code != 0:
            trial.ok, trial.note = False, f"the stage failed (exit {code}), see {logfile}"
        else:
            trial.identical, trial.note = same_training(out / "train", ref_out / "train")
            trial.ok = restarted or not killed
            trial.note += "producer started again" if restarted else ""
        results.append(trial)
        log(f"producer {i + 1}/{kills}: {trial}")
        shutil.rmtree(out, ignore_errors=True)
    return results


# ---------------------------------------------------------------- damage


def damage_cases(inputs: Inputs) -> dict[str, tuple[Callable[[Path], Path], int]]:
    """name -> (damage the folder, returning the file a reader must name; shards extraction redoes)."""
    from tasks.extract.stage import ExtractJob, run_extraction

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
    from tasks.extract.shards import ShardError
    from tasks.train.job import TrainJob
    from tasks.train.stage import run_training

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


# ---------------------------------------------------------------- checkpoints and part files


def kill_once(inputs: Inputs, kind: str, out: Path, ready: Callable[[Path], bool]) -> None:
    """Run `kind` into `out` and SIGKILL its whole group once `ready(out)` holds."""
    shutil.rmtree(out, ignore_errors=True)
    with out.with_suffix(".log").open("a") as f:
        proc = subprocess.Popen(inputs.command(kind, out), stdout=f, stderr=subprocess.STDOUT, env=ENV, cwd=ROOT,
                                start_new_session=True)
    while proc.poll() is None and not ready(out):
        time.sleep(0.05)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def flip_middle_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


CHECKPOINT_DAMAGE: dict[str, tuple[str, Callable[[Path], None]]] = {  # name -> (file of the latest, damage)
    "training_state.pt truncated": ("training_state.pt", truncate),
    "model.safetensors truncated": ("model.safetensors", truncate),
    "byte flipped in model.safetensors": ("model.safetensors", flip_middle_byte),
    "byte flipped in training_state.pt": ("training_state.pt", flip_middle_byte),
}


def checkpoint_trials(inputs: Inputs) -> list[Trial]:
    """Training killed once two checkpoints exist; then a file of the newest is damaged. The re-run
    must skip it with a warning naming the file, resume from the one before, and end identical."""
    from tasks.train.checkpoints import checkpoint_dirs

    ref_out, _ = inputs.reference("train")
    results = []
    for case, (name, damage) in CHECKPOINT_DAMAGE.items():
        out = inputs.work / "checkpoint-damage"
        kill_once(inputs, "train", out, lambda o: len(checkpoint_dirs(o)) >= 2)
        checkpoints = checkpoint_dirs(out)
        if len(checkpoints) < 2:
            results.append(Trial("checkpoint", case, False, ok=False, note="the run ended before two checkpoints"))
            continue
        damaged = checkpoints[-1] / name
        damage(damaged)
        logfile = out.with_suffix(".log")
        rerun = run_stage(inputs.command("train", out), logfile)
        text = logfile.read_text()
        named = f"checkpoint {checkpoints[-1].name} is damaged: {damaged}" in text
        identical, note = same_training(out, ref_out) if rerun.returncode == 0 else (False, f"exit {rerun.returncode}")
        line = next((x for x in text.splitlines() if "is damaged" in x), "")
        results.append(Trial("checkpoint", case, identical, ok=named and rerun.returncode == 0,
                             note=(note or line[line.find("checkpoint "):][:200])))
        log(f"checkpoint: {results[-1]}")
        shutil.rmtree(out, ignore_errors=True)
        logfile.unlink(missing_ok=True)
    return results


PART_DAMAGE: dict[str, Callable[[Path], None]] = {  # a regeneration part file's records
    "an answer's text edited (still valid JSON)": lambda p: p.write_bytes(
        p.read_bytes().replace(b'"content": "', b'"content": "Edited. ', 1)),
    "a record cut short": truncate,
    "a line of garbage in the middle": lambda p: p.write_bytes(
        p.read_bytes().replace(b"\n", b"\n\x00garbage{\n", 1)),
}


def part_trials(inputs: Inputs) -> list[Trial]:
    """A complete regeneration whose part file is then damaged: the re-run must regenerate exactly
    the conversations whose records no longer check, and write the reference's bytes."""
    ref_out, _ = inputs.reference("regenerate")
    results = []
    for case, damage in PART_DAMAGE.items():
        out = inputs.work / "part-damage"
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(ref_out, out)
        part = sorted((out / "parts").glob("*.jsonl"))[0]
        recorded = len(recorded_conversations(out))
        damage(part)
        logfile = out.with_suffix(".log")
        rerun = run_stage(inputs.command("regenerate", out), logfile)
        identical, _ = compare("regenerate", out, ref_out, lambda o: o) if rerun.returncode == 0 else (False, "")
        answered = re.findall(r"regenerate: (\d+) conversations in \d+ chunks to answer", logfile.read_text())
        results.append(Trial("parts", case, identical, redone=int(answered[-1]) if answered else 0,
                             ok=rerun.returncode == 0 and identical and bool(answered),
                             note=f"{recorded} conversations were recorded; the re-run answered the ones counted "
                                  "in 'redone'"))
        log(f"parts: {results[-1]}")
        shutil.rmtree(out, ignore_errors=True)
        logfile.unlink(missing_ok=True)
    return results


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
