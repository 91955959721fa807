"""Stage 2, extract: the verifier's hidden states at 3 auxiliary layers plus the last one, in
resumable, fingerprinted shards (format: tasks/extract/shards.py).

    plan -> (load the verifier only if some shard is missing) -> extract pending shards -> verify
         -> manifest

- The plan (tasks/extract/plan.py) comes first, before any model loads: tokens, bytes on disk, an
  estimated time, the free disk; it refuses to start when the disk or host memory cannot hold it.
  The estimate is corrected (and logged, planned vs measured) from the first measured batches.
- Shard i belongs to worker i % world_size: several processes, GPUs or machines fill one folder
  without coordination. Worker processes run `python -m tasks.extract.stage` (tasks/common/workers.py
  launches and follows them); each writes its shards with tasks/extract/writer.py.
- Samples already extracted with the same settings are read from the shards that hold them, wherever
  they now fall in the data (tasks/extract/content_index.py): only new samples are extracted, and the
  result says how many samples and tokens were reused and how many extracted.
- Verification checks every sample once, with its tokens, before the manifest is written.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

import torch

from tasks.common.folder_lock import folder_lock
from tasks.common.progress import ProgressCallback, ProgressEvent, format_bytes
from tasks.common.sealed import fsync_path
from tasks.common.verifier import verifier_fingerprint
from tasks.common.workers import rank_worker_main
from tasks.extract.content_index import rows_token_ids
from tasks.extract.job import (
    ExtractJob,
    ExtractResult,
    load_inputs,
    make_backend,
    manifest_content,
    manifest_path,
    run_worker_processes,
)
from tasks.extract.plan import (
    LAYERS_STORED,
    ExtractError,
    ExtractionPlan,
    ShardUse,
    check_disk,
    check_host_memory,
    extraction_fingerprint,
    make_plan,
    shards_on_disk,
)
from tasks.extract.shards import (
    ShardError,
    read_metadata,
    shard_journal,
    unchanged_since_journal,
    verify_shard,
)
from tasks.extract.storage_dtype import all_finite
from tasks.extract.stream import write_stream_manifest
from tasks.extract.writer import extract_shards

log = logging.getLogger(__name__)


def verify_extraction(plan: ExtractionPlan, prepared, out_dir: Path, *, full: bool = True) -> list[str]:
    """Every prepared sample read exactly once, from a shard the plan wrote or reuses, shaped [T, 4, H],
    finite, with the stored token ids equal to the prepared input_ids. `full` re-reads every
    byte against its checksum; otherwise a shard unchanged since its journal line is trusted
    (its states were checked finite and checksummed when written). Returns the names of the
    shards that fail (each is logged with the reason): damaged since written, to be redone."""
    journal = shard_journal(out_dir).entries()
    seen: dict[int, int] = {}
    bad: list[str] = []
    for use in plan.uses():
        path = out_dir / use.name
        try:
            check_shard(use, path, plan, prepared, full or not unchanged_since_journal(path, journal.get(use.name)))
        except ShardError as e:
            log.warning("verification: %s", e)
            bad.append(use.name)
            continue
        for row in use.rows:
            seen[row] = seen.get(row, 0) + 1
    missing = len(prepared) - len(seen)
    doubled = [r for r, n in seen.items() if n > 1]
    if not bad and (missing or doubled):
        raise ExtractError(f"verification: {missing} samples missing, {len(doubled)} present more than once")
    return bad


def check_shard(use: ShardUse, path: Path, plan: ExtractionPlan, prepared, full: bool) -> None:
    """One shard the plan reads, in full against its checksum or (not `full`) its header, and the token
    ids of the samples read from it."""
    if not path.is_file():
        raise ShardError(f"{use.name} is missing")
    if full:
        tensors = verify_shard(path, use.fingerprint)
    else:
        from safetensors import safe_open

        if read_metadata(path).get("fingerprint") != use.fingerprint:
            raise ShardError(f"{use.name} has another fingerprint")
        with safe_open(str(path), "pt") as f:
            tensors = {k: f.get_tensor(k) for k in ("input_ids", "offsets")}
            tensors["hidden_states"] = f.get_slice("hidden_states")
    hs = tensors["hidden_states"]
    shape = list(hs.shape) if isinstance(hs, torch.Tensor) else hs.get_shape()
    if shape != [use.tokens, LAYERS_STORED, plan.hidden_size]:
        raise ShardError(f"{use.name} hidden_states {shape}, expected [{use.tokens}, {LAYERS_STORED}, "
                         f"{plan.hidden_size}]")
    if isinstance(hs, torch.Tensor) and not all_finite(tensors):
        raise ShardError(f"{use.name} holds non-finite values")
    offsets = tensors["offsets"].tolist()
    if len(offsets) != use.samples + 1:
        raise ShardError(f"{use.name} holds {len(offsets) - 1} samples, expected {use.samples}")
    stored = tensors["input_ids"]
    prepared_ids = rows_token_ids(prepared, use.rows)
    for position, r in zip(use.positions, use.rows):
        expected = torch.from_numpy(prepared_ids[r].astype("int32"))
        if not torch.equal(stored[offsets[position]: offsets[position + 1]], expected):
            raise ShardError(f"{use.name} sample {prepared[r]['sample_id']}: token ids differ from the prepared "
                             "input_ids")


def write_manifest(plan: ExtractionPlan, prepared_fp: str, out_dir: Path, lengths) -> Path:
    manifest = manifest_content(plan, prepared_fp, lengths, lambda use: read_metadata(out_dir / use.name)["checksum"])
    path = manifest_path(out_dir, plan.fingerprint, prepared_fp)
    tmp = path.with_name(f".tmp-{path.name}")
    with tmp.open("w") as f:
        f.write(json.dumps(manifest))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(out_dir)
    return path


def run_worker(job: ExtractJob, rank: int = 0, world_size: int = 1,
               callback: ProgressCallback | None = None) -> list[dict]:
    """Extract the pending shards that belong to `rank`; returns their journal lines. Every worker's plan
    is its parent's, whatever shards the others wrote meanwhile (tasks/extract/content_index.py)."""
    s = job.extract_settings
    prepared, verifier, layers = load_inputs(job)
    out_dir = Path(job.out_dir)
    plan = make_plan(prepared, verifier, layers, out_dir, compute_dtype=job.compute_dtype,
                     shard_tokens=s.shard_tokens, storage_dtype=s.storage_dtype, estimate=False)
    mine = [spec for spec in plan.pending if spec.index % world_size == rank]
    if not mine:
        log.info("worker %d/%d: no shard to extract, verifier not loaded", rank, world_size)
        return []
    backend = make_backend(job, verifier, layers)
    backend.load(callback)
    try:
        return extract_shards(mine, plan, prepared, out_dir, backend, batch_tokens=s.batch_tokens,
                              label=f"extract[{rank}/{world_size}]", callback=callback)
    finally:
        backend.close()


def run_extraction(job: ExtractJob, *, in_process: bool = False, callback: ProgressCallback | None = None,
                   on_plan=None) -> ExtractResult:
    """The whole stage: plan (refusing if the disk cannot hold it), extract the pending shards
    with `settings.workers` worker processes (or here, `in_process`), verify (redoing a shard
    damaged since it was written), write the manifest. One run per output folder at a time.
    `on_plan(plan)` is called with the plan before any model loads, and again once the first
    measured batches have corrected its time estimate."""
    with folder_lock(job.out_dir, "extraction") as lock_fd:
        return _run_extraction(job, in_process, callback, on_plan, lock_fd)


def _run_extraction(job: ExtractJob, in_process: bool, callback: ProgressCallback | None, on_plan,
                    lock_fd: int) -> ExtractResult:
    t0 = time.monotonic()
    s = job.extract_settings
    out_dir = Path(job.out_dir)
    for partial in out_dir.glob(".tmp-*"):  # left by a killed run; no other run writes here (the lock)
        partial.unlink(missing_ok=True)
    prepared, verifier, layers = load_inputs(job)
    fingerprint = extraction_fingerprint(verifier_fingerprint(verifier.path), layers, job.compute_dtype,
                                         s.storage_dtype)
    offline_manifest = manifest_path(out_dir, fingerprint, job.prepared_fingerprint)
    # a streamed extraction plans every sample as before (no reuse); a finished offline one is read as it is
    streamed = s.mode == "stream" and not offline_manifest.is_file()

    def plan_now(estimate: bool) -> ExtractionPlan:
        return make_plan(prepared, verifier, layers, out_dir, compute_dtype=job.compute_dtype,
                         shard_tokens=s.shard_tokens, storage_dtype=s.storage_dtype, by_content=not streamed,
                         estimate=estimate, gpus=s.gpus)

    plan = plan_now(estimate=True)
    log.info("%s", plan.describe())
    if on_plan is not None:
        on_plan(plan)
    if streamed:
        return stream_result(job, plan, prepared, offline_manifest.with_name(f"stream-{offline_manifest.name}"), t0)
    check_disk(plan, out_dir, s.reserve_disk_gb)
    if plan.pending:  # a complete folder allocates no buffers
        check_host_memory(plan, s.workers)
    existed = set(plan.done) | {shard.name for shard in plan.reused}  # on disk before this run
    pending_tokens, shards_pending = plan.pending_tokens, len(plan.pending)
    last: list[ProgressEvent] = []

    def remember(event: ProgressEvent) -> None:
        if event.stage.startswith("extract"):
            last[:] = [event]
            if plan.calibrate(event) and on_plan is not None:
                on_plan(plan)  # the plan again, with the measured estimate
        if callback is not None:
            callback(event)

    t_extract = time.monotonic()
    if not plan.pending:
        log.info("all %d samples are in shards on disk: the verifier is not loaded", plan.samples)
    else:
        extract_pending(job, plan, out_dir, in_process, remember, lock_fd)
    extract_s = time.monotonic() - t_extract
    steady = last[0].rate if last else None
    if pending_tokens:
        log.info("extracted %s tokens in %.1f s wall (%s tokens/s; start-up and verifier load included), steady "
                 "state %s", f"{pending_tokens:,}", extract_s, f"{pending_tokens / extract_s:,.0f}",
                 f"{steady:,.0f} tokens/s" if steady else "not measured (too few batches)")
    t_verify = time.monotonic()
    damaged = verify_extraction(plan, prepared, out_dir, full=s.verify == "full")
    if damaged:  # changed since written (bit rot, a copy that kept size and mtime): redone, never used
        log.warning("final verification: %d shard(s) damaged since they were written are redone: %s",
                    len(damaged), ", ".join(damaged))
        for name in damaged:
            (out_dir / name).unlink(missing_ok=True)
        existed -= set(damaged)
        plan = plan_now(estimate=False)  # their samples planned again: a reused shard's may go into new shards
        shards_pending += len(plan.pending)
        pending_tokens += plan.pending_tokens
        extract_pending(job, plan, out_dir, in_process, remember, lock_fd)
        if still := verify_extraction(plan, prepared, out_dir, full=True):
            raise ExtractError(f"verification: {', '.join(still)} failed again after being redone (see the log)")
    manifest = write_manifest(plan, job.prepared_fingerprint, out_dir, prepared["seq_len"])
    shards = len(plan.uses())
    log.info("extraction verified in %.1f s (%s): %d samples, %d tokens, %d shards -> %s",
             time.monotonic() - t_verify, "every byte" if s.verify == "full" else "journal + tokens",
             plan.samples, plan.tokens, shards, manifest)
    counts = work_counts(plan, existed, prepared["seq_len"][:])
    log.info("extraction: %s samples (%s tokens) reused from shards on disk, %s samples (%s tokens) extracted in "
             "this run", f"{counts['samples_reused']:,}", f"{counts['tokens_reused']:,}",
             f"{counts['samples_extracted']:,}", f"{counts['tokens_extracted']:,}")
    return ExtractResult(
        manifest=str(manifest),
        fingerprint=result_fingerprint(plan, job),
        layers=plan.layers, samples=plan.samples, tokens=plan.tokens, shards=shards,
        shards_extracted=shards_pending,
        verifier_loaded=pending_tokens > 0,
        wall_s=round(time.monotonic() - t0, 2),
        steady_tokens_per_s=round(steady, 1) if steady else None,
        wall_tokens_per_s=round(pending_tokens / extract_s, 1) if pending_tokens else None,
        **counts,
    )


def work_counts(plan: ExtractionPlan, existed: set[str], lengths: list[int]) -> dict[str, int]:
    """Samples and tokens the manifest reads from shards that were on disk before this run (`existed`),
    and those extracted in it (ExtractResult's fields)."""
    reused = [r for use in plan.uses() if use.name in existed for r in use.rows]
    reused_tokens = sum(lengths[r] for r in reused)
    return {"samples_reused": len(reused), "tokens_reused": reused_tokens,
            "samples_extracted": plan.samples - len(reused), "tokens_extracted": plan.tokens - reused_tokens}


def result_fingerprint(plan: ExtractionPlan, job: ExtractJob) -> str:
    """What a manifest holds (the extraction settings and the prepared data), offline or streamed alike:
    training's cache key, so a streamed and an offline run of the same inputs share a draft."""
    return hashlib.sha256((plan.fingerprint + job.prepared_fingerprint).encode()).hexdigest()


def stream_result(job: ExtractJob, plan: ExtractionPlan, prepared, path: Path, t0: float) -> ExtractResult:
    """extract.mode 'stream': nothing is extracted here. The manifest of the shards to come (the training
    stage produces them while it trains, tasks/extract/stream.py), once the disk is known to hold the window."""
    s = job.extract_settings
    window_bytes = s.stream_window * max(spec.tokens for spec in plan.shards) * plan.bytes_per_token
    if plan.free_bytes < window_bytes + s.reserve_disk_gb * 1e9:
        raise ExtractError(f"not enough disk in {path.parent} for a window of {s.stream_window} shards: "
                           f"{format_bytes(window_bytes)} + {format_bytes(s.reserve_disk_gb * 1e9)} reserve > "
                           f"{format_bytes(plan.free_bytes)} free")
    write_stream_manifest(plan, job.prepared_fingerprint, prepared["seq_len"], job, path)
    log.info("extraction streamed while the draft trains: %d shards of %s tokens, at most %d on disk at a time "
             "(%s, besides the validation shards) -> %s", len(plan.shards), f"{plan.tokens:,}", s.stream_window,
             format_bytes(window_bytes), path)
    return ExtractResult(
        manifest=str(path),
        fingerprint=result_fingerprint(plan, job),
        layers=plan.layers, samples=plan.samples, tokens=plan.tokens, shards=len(plan.shards), shards_extracted=0,
        verifier_loaded=False, wall_s=round(time.monotonic() - t0, 2), steady_tokens_per_s=None,
        wall_tokens_per_s=None, streamed=True)


def extract_pending(job: ExtractJob, plan: ExtractionPlan, out_dir: Path, in_process: bool,
                    callback: ProgressCallback, lock_fd: int) -> None:
    """Extract the shards missing from `out_dir` (here or in worker processes); all present after."""
    if in_process:
        run_worker(job, callback=callback)
    else:
        run_worker_processes("tasks.extract.stage", "extraction worker", job, job.extract_settings.workers, callback,
                             lock_fd)
    plan.done = shards_on_disk(out_dir, plan.shards)
    if plan.pending:
        raise ExtractError(f"{len(plan.pending)} shards are still missing after extraction, e.g. {plan.pending[0].name}")


def main(argv: list[str] | None = None) -> int:
    """One extraction worker process: `python -m tasks.extract.stage --job JOB.json --rank R --world-size W`."""
    if "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    return rank_worker_main("tasks.extract.stage", ExtractJob, run_worker, argv)


if __name__ == "__main__":
    raise SystemExit(main())
