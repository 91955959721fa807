"""What a fault left and whether the re-run's output equals the uninterrupted run's: shards and
regenerated data byte for byte, the draft tensor for tensor, the metrics log record for record; the
finished work a re-run did again; temporary files a kill left and whether the re-run read any."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path

TIMING_FIELDS = ("tokens_per_s",)


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
    from tasks.train.tracking import read_metrics

    return [{k: v for k, v in m.items() if k not in TIMING_FIELDS} for m in read_metrics(folder)]


def same_training(folder: Path, reference: Path) -> tuple[bool, str]:
    if not (folder / "draft").is_dir():
        return False, "no draft"
    draft, metrics = same_draft(folder / "draft", reference / "draft"), metrics_records(folder) == metrics_records(
        reference)
    return draft and metrics, "" if draft and metrics else f"draft identical: {draft}, metrics log identical: {metrics}"


def train_folder(flow_out: Path) -> Path:
    return next(train_runs(flow_out))


def train_runs(flow_out: Path):
    """The training runs of a flow's output folder (train/.compile-cache beside them is not one)."""
    return (p for p in sorted((flow_out / "train").glob("*")) if not p.name.startswith("."))


# ---------------------------------------------------------------- temporaries and what a kill left


TEMPORARY = re.compile(r"^\.tmp-|^\.[0-9a-f]{16}\.\w+$")  # ours, and tempfile.mkdtemp's of prepare and vocab


class Temporaries:
    """Temporary files a kill left, hard-linked aside (the inode outlives its removal) with atime reset:
    after the re-run, an atime that moved means the file was read."""

    def __init__(self, out: Path, watch: Path):
        self.links: list[Path] = []
        watch.mkdir(parents=True, exist_ok=True)
        self.atime_works = atime_tracks_reads(watch)
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
        return sum(link.stat().st_atime_ns != 0 for link in self.links) if self.atime_works else None


def atime_tracks_reads(folder: Path) -> bool:
    """Whether reading a file in `folder` moves its atime (not under noatime)."""
    probe = folder / ".atime-probe"
    probe.write_bytes(b"x")
    os.utime(probe, ns=(0, probe.stat().st_mtime_ns))
    probe.read_bytes()
    works = probe.stat().st_atime_ns != 0
    probe.unlink()
    return works


def snapshot(stage: str, out: Path) -> dict:
    """What a kill left finished: shard files (inode, mtime), conversations written, the training log."""
    from tasks.train.checkpoints import checkpoint_dirs

    hidden = out / "hidden_states" if stage in ("flow", "stream") else out
    state = {"shards": {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in hidden.glob("shard-*.safetensors")}}
    if stage == "regenerate":
        state["recorded"] = recorded_conversations(out)
    trains = ([out] if stage == "train" else list(train_runs(out)) if stage == "flow" else
              [out / "train"] if stage == "stream" else [])
    if trains and (trains[0] / "metrics.jsonl").is_file():
        steps = [json.loads(line)["step"] for line in (trains[0] / "metrics.jsonl").read_text().splitlines()
                 if line.endswith("}")]
        checkpoints = checkpoint_dirs(trains[0])
        resume = int(checkpoints[-1].name.removeprefix("step-")) if checkpoints else 0
        # a checkpoint past the last log record (a stream checkpoints at block ends too): none redone
        state["steps_past_checkpoint"] = max(0, max(steps, default=0) - resume)
    return state


def redone(stage: str, before: dict, out: Path) -> int:
    """Finished work the re-run did again: shards rewritten, conversations written again, steps
    logged before the kill past the checkpoint it resumed from (the log's granularity is log_every)."""
    hidden = out / "hidden_states" if stage in ("flow", "stream") else out
    rewritten = sum(1 for name, ident in before["shards"].items()
                    if (p := hidden / name).is_file() and (p.stat().st_ino, p.stat().st_mtime_ns) != ident)
    again = 0
    if "recorded" in before:  # records of a conversation recorded before the kill, written again
        after = recorded_conversations(out)
        again = sum(after.count(row_id) - 1 for row_id in set(before["recorded"]))
    return rewritten + again + before.get("steps_past_checkpoint", 0)


def recorded_conversations(out: Path) -> list[str]:
    """The ids of the conversations regeneration recorded (complete lines of its part files,
    tasks/prepare/regenerate.py)."""
    return [json.loads(line)["key"] for part in sorted((out / "parts").glob("*.jsonl"))
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
