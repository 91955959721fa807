"""Stage 2, extract: the verifier's hidden states at 3 auxiliary layers plus the last one, in
resumable, fingerprinted shards (format: tasks/shards.py).

    plan -> (load the verifier only if some shard is missing) -> extract pending shards -> verify
         -> manifest

- The plan comes first, before any model loads: tokens, bytes on disk, an estimated time, the
  free disk; it refuses to start when the disk cannot hold the output.
- Shards are cut from the prepared rows in order, so appending data adds shards and leaves the
  existing ones valid. Shard i belongs to worker i % world_size: several processes, GPUs or
  machines fill one folder without coordination.
- A shard's fingerprint covers the verifier, the layers, the dtypes and each sample's tokens: a
  shard made from other inputs is never taken for this one. Existing shards are checked
  (fingerprint, checksum) and skipped; damaged ones are redone.
- Device-to-host copies and file writes run on a background thread while the next batches
  compute, so the disk does not idle the accelerator (and vice versa).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil
import torch
import xxhash

from tasks.progress import Progress, ProgressCallback, ProgressEvent, format_seconds
from tasks.shards import (
    SHARD_FORMAT,
    Journal,
    ShardError,
    ShardSpec,
    fsync_dir,
    read_metadata,
    unchanged_since_journal,
    verify_shard,
    write_shard,
)
from tasks.verifier import VerifierInfo, inspect_verifier, verifier_fingerprint

log = logging.getLogger(__name__)

STORAGE_DTYPE = torch.bfloat16
BYTES_PER_VALUE = 2
LAYERS_STORED = 4  # 3 auxiliary + the last
WRITER_BUFFERS = 3  # shards in host memory per worker: one filling, two queued or being written


class ExtractError(RuntimeError):
    """Extraction cannot start or its output failed verification."""


@dataclass
class ExtractionPlan:
    fingerprint: str  # of the extraction settings; each shard adds its samples
    verifier: str
    verifier_fingerprint: str
    layers: list[int]  # aux ids then N
    hidden_size: int
    samples: int
    tokens: int
    shards: list[ShardSpec]
    done: list[str] = field(default_factory=list)  # names of valid shards already on disk
    stale_bytes: int = 0  # shard files in the folder that belong to other inputs
    free_bytes: int = 0
    est_seconds: float | None = None

    @property
    def bytes_total(self) -> int:
        return self.tokens * LAYERS_STORED * self.hidden_size * BYTES_PER_VALUE

    @property
    def host_buffer_bytes(self) -> int:
        """Host memory one worker's ShardWriter holds: its buffers, each the size of the largest shard."""
        return WRITER_BUFFERS * max(s.tokens for s in self.shards) * LAYERS_STORED * self.hidden_size * BYTES_PER_VALUE

    @property
    def pending(self) -> list[ShardSpec]:
        done = set(self.done)
        return [s for s in self.shards if s.name not in done]

    @property
    def pending_tokens(self) -> int:
        return sum(s.tokens for s in self.pending)

    @property
    def bytes_to_write(self) -> int:
        return self.pending_tokens * LAYERS_STORED * self.hidden_size * BYTES_PER_VALUE

    def summary(self) -> dict:
        return {
            "verifier": self.verifier,
            "layers": self.layers,
            "samples": self.samples,
            "tokens": self.tokens,
            "shards": len(self.shards),
            "shards_done": len(self.done),
            "tokens_to_extract": self.pending_tokens,
            "bytes_total_gb": round(self.bytes_total / 1e9, 3),
            "bytes_to_write_gb": round(self.bytes_to_write / 1e9, 3),
            "free_disk_gb": round(self.free_bytes / 1e9, 1),
            "stale_shards_gb": round(self.stale_bytes / 1e9, 3),
            "host_buffers_gb_per_worker": round(self.host_buffer_bytes / 1e9, 2),
            "estimated_time": format_seconds(self.est_seconds) if self.est_seconds is not None else "n/a",
        }

    def describe(self) -> str:
        s = self.summary()
        return (
            f"extraction plan: {s['samples']:,} samples, {s['tokens']:,} tokens in {s['shards']} shards "
            f"({s['shards_done']} already done); layers {s['layers']} of {self.verifier}\n"
            f"  disk: {s['bytes_total_gb']} GB in all, {s['bytes_to_write_gb']} GB to write, "
            f"{s['free_disk_gb']} GB free" + (f", {s['stale_shards_gb']} GB of stale shards" if self.stale_bytes else "")
            + f"; host memory: {s['host_buffers_gb_per_worker']} GB of shard buffers per worker"
            + f"\n  estimated time for {s['tokens_to_extract']:,} tokens: {s['estimated_time']} (rough: FLOPs of the "
            "weights at 40% of this device's measured matmul rate; progress reports the real rate)"
        )


def extraction_fingerprint(verifier_fp: str, layers: list[int], compute_dtype: str) -> str:
    parts = {"format": SHARD_FORMAT, "verifier": verifier_fp, "layers": layers,
             "compute_dtype": compute_dtype, "storage_dtype": str(STORAGE_DTYPE)}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def plan_shards(prepared, extraction_fp: str, shard_tokens: int) -> list[ShardSpec]:
    """Consecutive prepared rows, cut every `shard_tokens` tokens; inside a shard the rows are
    ordered longest first, the order in which they are batched and stored."""
    shards: list[ShardSpec] = []
    rows: list[int] = []
    h = xxhash.xxh3_128()
    tokens = 0

    def close() -> None:
        nonlocal rows, tokens, h
        order = sorted(rows, key=lambda r: (-lengths[r], r))
        shards.append(ShardSpec(len(shards), tuple(order), tuple(sample_ids[r] for r in order), tokens,
                                hashlib.sha256(f"{extraction_fp}:{h.hexdigest()}".encode()).hexdigest()))
        rows, tokens, h = [], 0, xxhash.xxh3_128()

    lengths = prepared["seq_len"]
    sample_ids = prepared["sample_id"]
    for r, ids in enumerate(prepared.with_format("numpy")["input_ids"]):
        rows.append(r)
        tokens += lengths[r]
        h.update(sample_ids[r].encode() + b"\0")
        h.update(ids.astype("int32").tobytes())
        if tokens >= shard_tokens:
            close()
    if rows:
        close()
    return shards


def make_plan(prepared, verifier: VerifierInfo, layers: list[int], out_dir: Path, *, compute_dtype: str,
              shard_tokens: int, check_existing: bool = True) -> ExtractionPlan:
    verifier_fp = verifier_fingerprint(verifier.path)
    fp = extraction_fingerprint(verifier_fp, layers, compute_dtype)
    shards = plan_shards(prepared, fp, shard_tokens)
    plan = ExtractionPlan(fp, str(verifier.path), verifier_fp, layers, verifier.hidden_size, len(prepared),
                          sum(s.tokens for s in shards), shards)
    out_dir.mkdir(parents=True, exist_ok=True)
    plan.free_bytes = shutil.disk_usage(out_dir).free
    if check_existing:
        plan.done, plan.stale_bytes = existing_shards(out_dir, shards)
    plan.est_seconds = estimate_seconds(verifier, plan.pending_tokens, compute_dtype)
    return plan


def existing_shards(out_dir: Path, shards: list[ShardSpec]) -> tuple[list[str], int]:
    """Names of planned shards on disk and valid, and the bytes of shard files of other inputs.
    A shard unchanged since its journal line was verified when written; others are read in full."""
    journal = Journal(out_dir).entries()
    planned = {s.name: s for s in shards}
    done = []
    for spec in shards:
        path = out_dir / spec.name
        if not path.exists():
            continue
        if unchanged_since_journal(path, journal.get(spec.name)):
            done.append(spec.name)
            continue
        try:
            verify_shard(path, spec)
            done.append(spec.name)
        except ShardError as e:
            log.warning("redoing %s", e)
            path.unlink()
    stale = sum(p.stat().st_size for p in out_dir.glob("shard-*.safetensors") if p.name not in planned)
    return done, stale


def estimate_seconds(verifier: VerifierInfo, tokens: int, compute_dtype: str) -> float | None:
    """2 x parameters FLOPs per token at 40% of a matmul rate measured here in a fraction of a
    second. An overestimate for MoE verifiers (only the active experts compute)."""
    if not tokens:
        return 0.0
    bytes_per_param = {".gguf": 0.6}.get(Path(verifier.weight_files[0]).suffix, 2) if verifier.weight_files else 2
    params = verifier.weight_bytes / bytes_per_param
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, compute_dtype) if device == "cuda" else torch.float32
    n = 4096 if device == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    (a @ a).sum().item()  # warm-up
    t0, reps = time.perf_counter(), 3
    for _ in range(reps):
        b = a @ a
    b.sum().item()
    flops = 2 * n**3 * reps / (time.perf_counter() - t0)
    return 2 * params * tokens / (0.4 * flops)


def batches(spec: ShardSpec, lengths, batch_tokens: int) -> list[list[int]]:
    """Rows of a shard (longest first) grouped so that rows x longest <= batch_tokens."""
    out: list[list[int]] = []
    for r in spec.rows:
        if out and (len(out[-1]) + 1) * lengths[out[-1][0]] <= batch_tokens:
            out[-1].append(r)
        else:
            out.append([r])
    return out


class ShardWriter:
    """Assembles each shard in a host buffer and writes it on a background thread.

    Captured states go from the device straight into the shard's buffer (pinned memory and a
    copy stream on CUDA, so the copy overlaps the next forward). Three buffers: the next shards
    compute while earlier ones are written; if the disk falls behind, `begin` waits, and the
    time it waited is reported (`disk_wait_s`: a disk-bound extraction shows it here).
    """

    def __init__(self, out_dir: Path, max_tokens: int, hidden_size: int, device: str, metadata: dict[str, str]):
        self.out_dir = out_dir
        self.metadata = metadata
        self.journal = Journal(out_dir)
        self.cuda = device.startswith("cuda")
        shape = (max_tokens, LAYERS_STORED, hidden_size)
        self.free: queue.Queue = queue.Queue()
        for _ in range(WRITER_BUFFERS):
            self.free.put(torch.empty(shape, dtype=STORAGE_DTYPE, pin_memory=self.cuda))
        self.disk_wait_s = self.write_s = 0.0
        self.copy_stream = torch.cuda.Stream() if self.cuda else None
        self.jobs: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.written: list[dict] = []
        self.thread = threading.Thread(target=self._run, daemon=True, name="shard-writer")
        self.thread.start()

    def begin(self, spec: ShardSpec, input_ids: list[list[int]]) -> None:
        self._raise_if_failed()
        self.spec = spec
        t0 = time.monotonic()
        self.buffer = self.free.get()
        self.disk_wait_s += time.monotonic() - t0
        self.cursor = 0
        self.finite = torch.ones((), dtype=torch.bool)
        self.ids = input_ids

    def add(self, states: torch.Tensor) -> None:
        n = states.shape[0]
        target = self.buffer[self.cursor: self.cursor + n]
        if self.cuda:
            self.finite = self.finite.to(states.device) & torch.isfinite(states).all()
            self.copy_stream.wait_stream(torch.cuda.current_stream(states.device))
            with torch.cuda.stream(self.copy_stream):
                target.copy_(states, non_blocking=True)
                states.record_stream(self.copy_stream)  # keep `states` alive until the copy ran
        else:
            self.finite &= torch.isfinite(states).all()
            target.copy_(states)
        self.cursor += n

    def finish(self) -> None:
        event = None
        if self.cuda:
            event = torch.cuda.Event()
            event.record(self.copy_stream)
        if self.cursor != self.spec.tokens:
            raise ExtractError(f"shard {self.spec.index}: captured {self.cursor} tokens, planned {self.spec.tokens}")
        self.jobs.put((self.spec, self.buffer, self.ids, self.finite, event))

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            spec, buffer, ids, finite, event = job
            t0 = time.monotonic()
            try:
                if event is not None:
                    event.synchronize()
                if not bool(finite):
                    raise ExtractError(f"shard {spec.index}: non-finite hidden states (samples {spec.sample_ids[:3]}...)")
                lengths = torch.tensor([0] + [len(x) for x in ids])
                entry = write_shard(
                    self.out_dir / spec.name, spec, buffer[: spec.tokens],
                    torch.tensor([t for x in ids for t in x], dtype=torch.int32), lengths.cumsum(0), self.metadata,
                )
                self.journal.append(entry)
                self.written.append(entry)
            except BaseException as e:  # surfaced on the main thread by the next begin/close
                self.error = e
            finally:
                self.write_s += time.monotonic() - t0
                self.free.put(buffer)

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join()
        self._raise_if_failed()


def extract_shards(shards: list[ShardSpec], plan: ExtractionPlan, prepared, out_dir: Path, backend, *,
                   batch_tokens: int, label: str = "extract", callback: ProgressCallback | None = None) -> list[dict]:
    """Capture and write `shards` with a loaded backend; returns their journal lines."""
    for spec in shards:  # partial files of an earlier, killed attempt at these shards
        for partial in out_dir.glob(f".tmp-{spec.name}.*"):
            partial.unlink(missing_ok=True)
    lengths = prepared["seq_len"]
    all_ids = prepared["input_ids"]
    metadata = {"layers": json.dumps(plan.layers), "hidden_size": str(plan.hidden_size),
                "extraction_fingerprint": plan.fingerprint, "verifier": plan.verifier}
    writer = ShardWriter(out_dir, max(s.tokens for s in shards), plan.hidden_size, backend.device, metadata)
    progress = Progress(label, sum(s.tokens for s in shards), "tok", callback)
    try:
        for spec in shards:
            ids = [all_ids[r] for r in spec.rows]
            writer.begin(spec, ids)
            position = {r: i for i, r in enumerate(spec.rows)}
            for batch in batches(spec, lengths, batch_tokens):
                writer.add(backend.capture([ids[position[r]] for r in batch]))
                progress.update(sum(lengths[r] for r in batch), note=f"shard {spec.index + 1}/{len(plan.shards)}")
            writer.finish()
        t_last_batch = time.monotonic()
    finally:
        writer.close()
        progress.close()
    written_gb = sum(e["size"] for e in writer.written) / 1e9
    log.info("writer: %.2f GB in %.1f s of writing (%.2f GB/s); computing waited %.1f s for the disk; "
             "the last shard's write took %.1f s after the last batch", written_gb, writer.write_s,
             written_gb / max(writer.write_s, 1e-9), writer.disk_wait_s, time.monotonic() - t_last_batch)
    return writer.written


def verify_extraction(plan: ExtractionPlan, prepared, out_dir: Path, *, full: bool = True) -> None:
    """Every prepared sample present exactly once, in shards of this plan, shaped [T, 4, H],
    finite, with the stored token ids equal to the prepared input_ids. `full` re-reads every
    byte against its checksum; otherwise a shard unchanged since its journal line is trusted
    (its states were checked finite and checksummed when written)."""
    journal = Journal(out_dir).entries()
    seen: dict[str, int] = {}
    for spec in plan.shards:
        path = out_dir / spec.name
        if not path.is_file():
            raise ExtractError(f"verification: {spec.name} is missing")
        if full or not unchanged_since_journal(path, journal.get(spec.name)):
            tensors = verify_shard(path, spec)
        else:
            from safetensors import safe_open

            if read_metadata(path).get("fingerprint") != spec.fingerprint:
                raise ExtractError(f"verification: {spec.name} has another fingerprint")
            with safe_open(str(path), "pt") as f:
                tensors = {k: f.get_tensor(k) for k in ("input_ids", "offsets")}
                tensors["hidden_states"] = f.get_slice("hidden_states")
        hs = tensors["hidden_states"]
        shape = list(hs.shape) if isinstance(hs, torch.Tensor) else hs.get_shape()
        if shape != [spec.tokens, LAYERS_STORED, plan.hidden_size]:
            raise ExtractError(f"verification: {spec.name} hidden_states {shape}, "
                               f"expected [{spec.tokens}, {LAYERS_STORED}, {plan.hidden_size}]")
        if isinstance(hs, torch.Tensor) and not torch.isfinite(hs).all():
            raise ExtractError(f"verification: {spec.name} holds non-finite values")
        offsets = tensors["offsets"].tolist()
        stored = tensors["input_ids"]
        for i, r in enumerate(spec.rows):
            expected = torch.tensor(prepared[r]["input_ids"], dtype=torch.int32)
            if not torch.equal(stored[offsets[i]: offsets[i + 1]], expected):
                raise ExtractError(f"verification: {spec.name} sample {spec.sample_ids[i]} token ids differ "
                                   "from the prepared input_ids")
            seen[spec.sample_ids[i]] = seen.get(spec.sample_ids[i], 0) + 1
    missing = set(prepared["sample_id"]) - set(seen)
    doubled = [s for s, n in seen.items() if n > 1]
    if missing or doubled or len(seen) != len(prepared):
        raise ExtractError(f"verification: {len(missing)} samples missing, {len(doubled)} present more than once")


def write_manifest(plan: ExtractionPlan, prepared_fp: str, out_dir: Path, lengths) -> Path:
    journal = Journal(out_dir).entries()
    manifest = {
        "format": SHARD_FORMAT,
        "extraction_fingerprint": plan.fingerprint,
        "prepared_fingerprint": prepared_fp,
        "verifier": plan.verifier,
        "verifier_fingerprint": plan.verifier_fingerprint,
        "layers": plan.layers,
        "hidden_size": plan.hidden_size,
        "dtype": str(STORAGE_DTYPE).removeprefix("torch."),
        "samples": plan.samples,
        "tokens": plan.tokens,
        "shards": [
            {"name": s.name, "fingerprint": s.fingerprint, "checksum": journal.get(s.name, {}).get("checksum"),
             "tokens": s.tokens, "rows": list(s.rows), "sample_ids": list(s.sample_ids),
             "lengths": [lengths[r] for r in s.rows]}
            for s in plan.shards
        ],
    }
    path = manifest_path(out_dir, plan.fingerprint, prepared_fp)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest))
    os.replace(tmp, path)
    fsync_dir(out_dir)
    return path


def manifest_path(out_dir: Path, extraction_fp: str, prepared_fp: str) -> Path:
    return out_dir / f"manifest-{hashlib.sha256((extraction_fp + prepared_fp).encode()).hexdigest()[:16]}.json"


@dataclass(frozen=True)
class ExtractJob:
    """Everything an extraction needs, JSON-serializable: worker subprocesses get it whole."""

    prepared_path: str
    prepared_fingerprint: str
    verifier_path: str
    out_dir: str
    compute_dtype: str = "bfloat16"
    trust_remote_code: bool = False
    settings: dict = field(default_factory=dict)  # ExtractSettings fields

    @property
    def extract_settings(self):
        from tasks.config import ExtractSettings

        return ExtractSettings.model_validate(self.settings)


@dataclass(frozen=True)
class ExtractResult:
    manifest: str
    fingerprint: str  # of the extraction settings and the prepared data: what the manifest holds
    layers: list[int]
    samples: int
    tokens: int
    shards: int
    shards_extracted: int
    verifier_loaded: bool
    wall_s: float  # the whole stage: plan, worker start-up, verifier load, extraction, verification
    steady_tokens_per_s: float | None  # forward passes and capture, first batch (warm-up) and last write excluded
    wall_tokens_per_s: float | None  # tokens extracted / the extraction's wall time (start-up and load included)


def load_inputs(job: ExtractJob):
    """The prepared data, the verifier's description and the layers; fails before any model load."""
    from tasks.prepare import load_prepared

    s = job.extract_settings
    verifier = inspect_verifier(job.verifier_path)
    layers = verifier.aux_layers(s.aux_layers) + [verifier.num_layers]
    if not Path(job.prepared_path).is_dir():
        raise ExtractError(f"prepared data not found at {job.prepared_path} (deleted after it was cached? "
                           "re-run with --refresh)")
    prepared = load_prepared(job.prepared_path)
    if len(prepared) == 0:
        raise ExtractError(f"prepared data at {job.prepared_path} is empty")
    if max(prepared["seq_len"]) > s.batch_tokens:
        raise ExtractError(f"a sample of {max(prepared['seq_len'])} tokens exceeds extract.batch_tokens={s.batch_tokens}")
    return prepared, verifier, layers


def check_disk(plan: ExtractionPlan, out_dir: Path, reserve_gb: float) -> None:
    if plan.free_bytes < plan.bytes_to_write + reserve_gb * 1e9:
        raise ExtractError(
            f"not enough disk in {out_dir}: {plan.bytes_to_write / 1e9:.1f} GB to write + {reserve_gb} GB "
            f"reserve > {plan.free_bytes / 1e9:.1f} GB free"
            + (f" ({plan.stale_bytes / 1e9:.1f} GB are shards of other inputs: `eagle3-pipeline prune-shards "
               f"{out_dir}` frees them)" if plan.stale_bytes else "")
        )


def check_host_memory(plan: ExtractionPlan, workers: int) -> None:
    """Shard buffers are pinned on CUDA; pinning more than half the free memory starves the host
    (and the verifier's own loading), so such a config is refused before any model loads."""
    need, available = plan.host_buffer_bytes * workers, psutil.virtual_memory().available
    if need > available / 2:
        raise ExtractError(
            f"shard buffers need {need / 1e9:.1f} GB of host memory ({workers} worker(s) x {WRITER_BUFFERS} "
            f"shards of {plan.host_buffer_bytes / WRITER_BUFFERS / 1e9:.2f} GB), more than half of the "
            f"{available / 1e9:.1f} GB available: lower extract.shard_tokens"
        )


def make_backend(job: ExtractJob, verifier: VerifierInfo, layers: list[int]):
    s = job.extract_settings
    if s.backend == "vllm":
        from tasks.vllm_backend import VllmBackend

        return VllmBackend(verifier, layers, job.compute_dtype, s, job.trust_remote_code)
    from tasks.hf_backend import TransformersBackend

    return TransformersBackend(verifier, layers, job.compute_dtype, s.device, job.trust_remote_code)


def run_worker(job: ExtractJob, rank: int = 0, world_size: int = 1,
               callback: ProgressCallback | None = None) -> list[dict]:
    """Extract the pending shards that belong to `rank`; returns their journal lines."""
    s = job.extract_settings
    prepared, verifier, layers = load_inputs(job)
    out_dir = Path(job.out_dir)
    plan = make_plan(prepared, verifier, layers, out_dir, compute_dtype=job.compute_dtype,
                     shard_tokens=s.shard_tokens)
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
    with `settings.workers` worker processes (or here, `in_process`), verify, write the manifest."""
    t0 = time.monotonic()
    s = job.extract_settings
    out_dir = Path(job.out_dir)
    prepared, verifier, layers = load_inputs(job)
    plan = make_plan(prepared, verifier, layers, out_dir, compute_dtype=job.compute_dtype,
                     shard_tokens=s.shard_tokens)
    log.info("%s", plan.describe())
    if on_plan is not None:
        on_plan(plan)
    check_disk(plan, out_dir, s.reserve_disk_gb)
    if plan.pending:  # a complete folder allocates no buffers
        check_host_memory(plan, s.workers)
    pending_tokens, shards_pending = plan.pending_tokens, len(plan.pending)
    last: list[ProgressEvent] = []

    def remember(event: ProgressEvent) -> None:
        if event.stage.startswith("extract"):
            last[:] = [event]
        if callback is not None:
            callback(event)

    t_extract = time.monotonic()
    if not plan.pending:
        log.info("all %d shards are complete: the verifier is not loaded", len(plan.shards))
    elif in_process:
        run_worker(job, callback=remember)
    else:
        run_worker_processes(job, s.workers, remember)
    extract_s = time.monotonic() - t_extract
    steady = last[0].rate if last else None
    if pending_tokens:
        log.info("extracted %s tokens in %.1f s wall (%s tokens/s; start-up and verifier load included), steady "
                 "state %s tokens/s", f"{pending_tokens:,}", extract_s, f"{pending_tokens / extract_s:,.0f}",
                 f"{steady:,.0f}" if steady else "n/a")
    plan.done, plan.stale_bytes = existing_shards(out_dir, plan.shards)
    if plan.pending:
        raise ExtractError(f"{len(plan.pending)} shards are still missing after extraction, e.g. {plan.pending[0].name}")
    t_verify = time.monotonic()
    verify_extraction(plan, prepared, out_dir, full=s.verify == "full")
    manifest = write_manifest(plan, job.prepared_fingerprint, out_dir, prepared["seq_len"])
    log.info("extraction verified in %.1f s (%s): %d samples, %d tokens, %d shards -> %s",
             time.monotonic() - t_verify, "every byte" if s.verify == "full" else "journal + tokens",
             plan.samples, plan.tokens, len(plan.shards), manifest)
    return ExtractResult(
        manifest=str(manifest),
        fingerprint=hashlib.sha256((plan.fingerprint + job.prepared_fingerprint).encode()).hexdigest(),
        layers=plan.layers, samples=plan.samples, tokens=plan.tokens, shards=len(plan.shards),
        shards_extracted=shards_pending,
        verifier_loaded=pending_tokens > 0,
        wall_s=round(time.monotonic() - t0, 2),
        steady_tokens_per_s=round(steady, 1) if steady else None,
        wall_tokens_per_s=round(pending_tokens / extract_s, 1) if pending_tokens else None,
    )


def run_worker_processes(job: ExtractJob, workers: int, callback: ProgressCallback | None) -> None:
    """`workers` subprocesses (`python -m tasks.extract`), each its own GPUs; their progress
    files are followed and merged into one report. A crash, OOM or CUDA abort fails this call,
    not the caller's process, and the shards already written stay valid for the retry."""
    out_dir = Path(job.out_dir)
    progress_dir = out_dir / "progress"
    progress_dir.mkdir(parents=True, exist_ok=True)
    job_file = progress_dir / "job.json"
    job_file.write_text(json.dumps(asdict(job)))
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = gpus.split(",") if gpus else [str(i) for i in range(torch.cuda.device_count())]
    procs = []
    for rank in range(workers):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(workers))
        if visible and len(visible) >= workers:
            per = len(visible) // workers
            env["CUDA_VISIBLE_DEVICES"] = ",".join(visible[rank * per: (rank + 1) * per])
        elif not visible:
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))
        progress_file = progress_dir / f"rank-{rank}.jsonl"
        progress_file.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "tasks.extract", "--job", str(job_file), "--rank", str(rank),
               "--world-size", str(workers), "--progress-file", str(progress_file)]
        procs.append(subprocess.Popen(cmd, env=env))
    followers = [ProgressFile(progress_dir / f"rank-{r}.jsonl") for r in range(workers)]
    last = None
    while True:
        running = any(p.poll() is None for p in procs)
        merged = merge_progress([f.latest() for f in followers])
        if callback is not None and merged is not None and merged != last:
            callback(merged)
            last = merged
        if not running:
            break  # read once more after the last exit: the workers' final events
        time.sleep(2)
    failed = {rank: p.returncode for rank, p in enumerate(procs) if p.returncode != 0}
    if failed:
        raise ExtractError(f"extraction workers failed (rank: exit code) {failed}; finished shards are kept")


class ProgressFile:
    def __init__(self, path: Path):
        self.path, self.last = path, None

    def latest(self):
        if self.path.is_file():
            lines = self.path.read_text().splitlines()
            for line in reversed(lines):
                try:
                    self.last = ProgressEvent(**json.loads(line))
                    break
                except (json.JSONDecodeError, TypeError):
                    continue
        return self.last


def merge_progress(events: list) -> ProgressEvent | None:
    """One event for all workers: their extraction summed, or while none extracts yet, a load."""
    started = [e for e in events if e is not None]
    events = [e for e in started if e.stage.startswith("extract")]
    if not events:
        return started[0] if started else None
    rate = sum(e.rate or 0 for e in events) or None
    done, total = sum(e.done for e in events), sum(e.total for e in events)
    return ProgressEvent("extract", done, total, "tok", rate, (total - done) / rate if rate else None,
                         max(e.elapsed_s for e in events), f"{len(events)} workers")


def progress_file_callback(path: str | Path) -> ProgressCallback:
    """Progress events as JSON lines, for the parent process to follow."""
    path = Path(path)

    def write(event) -> None:
        with path.open("a") as f:
            f.write(json.dumps(asdict(event)) + "\n")

    return write


def main(argv: list[str] | None = None) -> int:
    """One extraction worker process: `python -m tasks.extract --job JOB.json --rank R --world-size W`."""
    p = argparse.ArgumentParser(prog="python -m tasks.extract", description=main.__doc__)
    p.add_argument("--job", required=True, help="an ExtractJob as JSON")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--progress-file")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s [rank {a.rank}] %(name)s: %(message)s")
    job = ExtractJob(**json.loads(Path(a.job).read_text()))
    if "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    run_worker(job, a.rank, a.world_size, progress_file_callback(a.progress_file) if a.progress_file else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
