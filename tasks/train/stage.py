"""Stage 4, train: an EAGLE-3 draft with speculators' model, losses and checkpoint format.

    check the inputs belong together (data.py; a warm start's draft too: warm_start.py) -> one training
    process, or `nproc` under torchrun (loop.py: the loop) -> the best checkpoint exported as `draft/`,
    what vLLM loads
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

from tasks.common.folder_lock import folder_lock
from tasks.common.progress import ProgressCallback
from tasks.common.workers import run_processes
from tasks.extract.shards import read_manifest
from tasks.extract.stream import local_producers, producing
from tasks.train.data import check_inputs
from tasks.train.job import TrainJob, TrainResult, train_fingerprint
from tasks.train.loop import train_worker


def run_training(job: TrainJob, manifest_fp: str, vocab_fp: str, *, in_process: bool = False,
                 callback: ProgressCallback | None = None,
                 stream_callback: ProgressCallback | None = None) -> TrainResult:
    """The stage: one process, or `nproc` under torchrun, in a subprocess unless `in_process`.
    Inputs are checked here first, so a mismatch fails before any process starts. A streamed
    extraction's manifest (extract.mode 'stream') has its shards produced meanwhile, by processes
    that report to `stream_callback` (tasks/extract/stream.py); the shard folder's lock is held."""
    manifest = read_manifest(job.manifest)
    check_inputs(job, manifest)
    with folder_lock(job.out_dir, "training") as lock_fd:
        if "stream" not in manifest:
            result = _run_training(job, in_process, callback, lock_fd)
        else:
            with (folder_lock(Path(job.manifest).parent, "extraction") as shard_lock,
                  producing(manifest, local_producers(shard_lock), stream_callback) as control):
                result = _run_training(job, in_process, callback, lock_fd)
            result = replace(result, stream=stream_report(control.reports(), manifest))  # the producers have ended
    fingerprint = train_fingerprint(manifest_fp, vocab_fp, job.settings, job.init_from, job.parent_manifest)
    return TrainResult(**{**asdict(result), "fingerprint": fingerprint})


def stream_report(reports: list[dict], manifest: dict) -> dict:
    """What the producers report, summed: shards produced and deleted, and the most bytes of shards on disk."""
    return {"window_shards": manifest["stream"]["window"],
            "high_water_bytes": max((r["high_water_bytes"] for r in reports), default=0),
            "largest_shard_bytes": max((r["largest_shard_bytes"] for r in reports), default=0),
            "shards_produced": sum(r["shards_produced"] for r in reports),
            "shards_deleted": sum(r["shards_deleted"] for r in reports)}


def _run_training(job: TrainJob, in_process: bool, callback: ProgressCallback | None, lock_fd: int) -> TrainResult:
    s = job.train_settings
    out_dir = Path(job.out_dir)
    if in_process:
        result = train_worker(job, callback)
    else:
        job_file, result_file = out_dir / "job.json", out_dir / "result.json"
        job_file.write_text(json.dumps(asdict(job)))
        result_file.unlink(missing_ok=True)
        progress_file = out_dir / "progress.jsonl"
        args = ["-m", "tasks.train.loop", "--job", str(job_file), "--result", str(result_file),
                "--progress-file", str(progress_file)]
        cmd = [sys.executable, *args] if s.nproc == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={s.nproc}", *args]
        run_processes([cmd], [progress_file], callback, label="training process", pass_fds=(lock_fd,))
        result = TrainResult(**json.loads(result_file.read_text()))
    return result
