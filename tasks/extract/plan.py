"""The extraction plan, made before any model loads: which samples are already extracted and
where, which new shards the others cut into, their fingerprints, the bytes and time it will take,
and whether the disk and host memory can hold it.

- A sample already extracted with the same settings (same tokens, verifier, layers, compute and
  storage dtypes) is read from the shard that holds it, wherever it now falls in source order
  (tasks/extract/content_index.py); only the others are extracted, into new shards cut from them in
  source order, `shard_tokens` each. A run's manifest may so list shards of several extractions.
- A shard's fingerprint covers the verifier, the layers, the compute and storage dtypes (bf16 or
  fp8, tasks/extract/storage_dtype.py) and each sample's id and tokens: a shard made from other
  inputs is never taken for this one. Existing shards are checked (fingerprint, checksum) and
  skipped; damaged ones are redone.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch

from tasks.common.errors import PermanentError
from tasks.common.progress import format_bytes, format_seconds
from tasks.common.verifier import VerifierInfo, verifier_fingerprint
from tasks.extract.content_index import place_by_content, plan_id, plan_shards
from tasks.extract.shards import (
    SHARD_FORMAT,
    ShardError,
    ShardSpec,
    StoredShard,
    journal_line,
    read_metadata,
    shard_journal,
    unchanged_since_journal,
    verify_shard,
)
from tasks.extract.storage_dtype import STORAGE_DTYPES, bytes_per_token

log = logging.getLogger(__name__)

LAYERS_STORED = 4  # 3 auxiliary + the last
DISK_PROBE_BYTES = 64 * 2**20  # written and synced once per plan that writes more than 16 times this
# No extraction measured on a GPU has run faster: SmolLM2-135M with fp8 shards, 431,290 tokens/s
# steady on one H200 (docs/BENCHMARKS.md, 2026-12-04; 310,933 on an H100, 2026-12-06). A small
# verifier's kernels are too short to fill a GPU: its FLOPs promised 545k-705k tokens/s there.
MEASURED_MAX_TOKENS_PER_S = 431_290
WRITER_BUFFERS = 3  # shards in host memory per worker: one filling, two queued or being written


class ExtractError(PermanentError, RuntimeError):
    """Extraction cannot start or its output failed verification."""


@dataclass(frozen=True)
class ShardUse:
    """A shard a run reads, and which of its samples: this run's prepared `rows` at `positions` in the shard."""

    name: str
    fingerprint: str
    tokens: int  # the shard's, all its samples'
    samples: int  # the shard's
    rows: tuple[int, ...]
    positions: tuple[int, ...]

    @property
    def whole(self) -> bool:
        """The run reads every sample of the shard, in the shard's order."""
        return self.positions == tuple(range(self.samples))


@dataclass
class ExtractionPlan:
    fingerprint: str  # of the extraction settings; each shard adds its samples
    verifier: str
    verifier_fingerprint: str
    layers: list[int]  # aux ids then N
    hidden_size: int
    samples: int
    tokens: int
    shards: list[ShardSpec]  # planned: the new samples' shards (or, by name, older-format shards)
    done: list[str] = field(default_factory=list)  # names of planned shards already on disk and valid
    stale_bytes: int = 0  # shard files in the folder this plan does not read
    reused: list[StoredShard] = field(default_factory=list)  # shards of earlier plans it reads samples from
    # each prepared row's (shard name, position in that shard); None: the planned shards hold every row
    placement: list[tuple[str, int]] | None = None
    sample_ids: list[str] = field(default_factory=list)  # of the prepared rows (with `placement`)
    sample_keys: list[str] = field(default_factory=list)
    plan_id: str = ""  # recorded in its new shards (tasks/extract/content_index.py)
    free_bytes: int = 0
    est_seconds: float | None = None  # planned, before any model loads: the slower of FLOPs and the disk
    disk_bytes_per_s: float | None = None  # what the output folder's disk took in a short synced write
    measured_seconds: float | None = None  # calibrated from the first measured batches (`calibrate`)
    measured_tokens_per_s: float | None = None
    storage_dtype: str = "bf16"  # extract.storage_dtype

    @property
    def bytes_per_token(self) -> int:
        return bytes_per_token(self.storage_dtype, LAYERS_STORED, self.hidden_size)

    @property
    def bytes_total(self) -> int:
        return self.tokens * self.bytes_per_token

    @property
    def host_buffer_bytes(self) -> int:
        """Host memory one worker's ShardWriter holds: its buffers, each the size of the largest shard."""
        return WRITER_BUFFERS * max((s.tokens for s in self.pending), default=0) * self.bytes_per_token

    @property
    def pending(self) -> list[ShardSpec]:
        done = set(self.done)
        return [s for s in self.shards if s.name not in done]

    @property
    def pending_tokens(self) -> int:
        return sum(s.tokens for s in self.pending)

    @property
    def bytes_to_write(self) -> int:
        return self.pending_tokens * self.bytes_per_token

    @property
    def samples_to_extract(self) -> int:
        return sum(len(s.rows) for s in self.pending)

    def work_counts(self) -> dict[str, int]:
        """Samples and tokens already extracted (read from shards on disk before this run) and to extract
        now, under ExtractResult's names."""
        return {"samples_reused": self.samples - self.samples_to_extract,
                "tokens_reused": self.tokens - self.pending_tokens,
                "samples_extracted": self.samples_to_extract, "tokens_extracted": self.pending_tokens}

    def uses(self) -> list[ShardUse]:
        """The shards a run of this plan reads (planned and reused), in source order of their first row;
        in each, the rows in the order the shard stores them."""
        if self.placement is None:
            return [ShardUse(s.name, s.fingerprint, s.tokens, len(s.rows), s.rows, tuple(range(len(s.rows))))
                    for s in self.shards]
        shards = {s.name: (s.fingerprint, s.tokens, len(s.rows)) for s in self.shards}
        shards.update({s.name: (s.fingerprint, s.tokens, len(s.sample_keys)) for s in self.reused})
        read: dict[str, list[tuple[int, int]]] = {}
        for row, (name, position) in enumerate(self.placement):
            read.setdefault(name, []).append((position, row))
        uses = []
        for name, pairs in sorted(read.items(), key=lambda item: min(row for _, row in item[1])):
            pairs.sort()
            uses.append(ShardUse(name, *shards[name], tuple(r for _, r in pairs), tuple(p for p, _ in pairs)))
        return uses

    def summary(self) -> dict:
        return {
            "verifier": self.verifier,
            "layers": self.layers,
            "samples": self.samples,
            "tokens": self.tokens,
            "shards": len(self.shards) + len(self.reused),
            "shards_done": len(self.shards) + len(self.reused) - len(self.pending),
            "samples_reused": self.samples - self.samples_to_extract,
            "tokens_reused": self.tokens - self.pending_tokens,
            "samples_to_extract": self.samples_to_extract,
            "tokens_to_extract": self.pending_tokens,
            "storage_dtype": self.storage_dtype,
            "bytes_total_gb": round(self.bytes_total / 1e9, 3),
            "bytes_to_write_gb": round(self.bytes_to_write / 1e9, 3),
            "free_disk_gb": round(self.free_bytes / 1e9, 1),
            "stale_shards_gb": round(self.stale_bytes / 1e9, 3),
            "host_buffers_gb_per_worker": round(self.host_buffer_bytes / 1e9, 2),
            "estimated_time": self.estimate_text(),
            "planned_estimate": format_seconds(self.est_seconds) if self.est_seconds is not None else None,
            "disk_write_gb_per_s": round(self.disk_bytes_per_s / 1e9, 2) if self.disk_bytes_per_s else None,
            "measured_tokens_per_s": round(self.measured_tokens_per_s) if self.measured_tokens_per_s else None,
        }

    def estimate_text(self) -> str:
        if self.measured_seconds is not None:
            return f"{format_seconds(self.measured_seconds)} (measured)"
        return format_seconds(self.est_seconds) if self.est_seconds is not None else "not estimated"

    def calibrate(self, event) -> bool:
        """Correct the estimate from the first extraction progress with a measured rate (the first
        batch, warm-up, excluded); True the first time, when it changed."""
        if self.measured_seconds is not None or not event.rate or event.eta_s is None:
            return False
        self.measured_tokens_per_s = event.rate
        self.measured_seconds = event.elapsed_s + event.eta_s
        planned = f"{format_seconds(self.est_seconds)} planned, " if self.est_seconds else ""
        log.info("extraction time: %s%s measured (%s tokens/s after %s tokens)%s", planned,
                 format_seconds(self.measured_seconds), f"{event.rate:,.0f}", f"{event.done:,.0f}",
                 f": the plan was {self.est_seconds / self.measured_seconds:.1f}x the measured time"
                 if self.est_seconds else "")
        return True

    def describe(self, estimate: bool = True) -> str:
        """The plan in words; with `estimate`, the time on this machine too."""
        s = self.summary()
        text = (
            f"extraction plan: {s['samples']:,} samples, {s['tokens']:,} tokens in {s['shards']} shards "
            f"({s['shards_done']} already done); layers {s['layers']} of {self.verifier}\n"
            f"  {s['samples_reused']:,} samples ({s['tokens_reused']:,} tokens) already extracted, "
            f"{s['samples_to_extract']:,} samples ({s['tokens_to_extract']:,} tokens) to extract\n"
            f"  disk ({self.storage_dtype}): {s['bytes_total_gb']} GB in all, {s['bytes_to_write_gb']} GB to write, "
            f"{s['free_disk_gb']} GB free" + (f", {s['stale_shards_gb']} GB of stale shards" if self.stale_bytes else "")
            + f"; host memory: {s['host_buffers_gb_per_worker']} GB of shard buffers per worker"
        )
        if not estimate:
            return text
        return text + (
            f"\n  estimated time for {s['tokens_to_extract']:,} tokens: {s['estimated_time']} (rough: the slower of "
            "the weights' FLOPs at 40% of this device's matmul rate in the compute dtype (on a GPU, at most "
            f"{MEASURED_MAX_TOKENS_PER_S:,} tokens/s a GPU, the fastest extraction measured, each GPU its share)"
            + (f" and the writes at the {s['disk_write_gb_per_s']} GB/s this disk took" if self.disk_bytes_per_s else "")
            + "; corrected from the first measured batches)"
        )


def extraction_fingerprint(verifier_fp: str, layers: list[int], compute_dtype: str, storage_dtype: str = "bf16") -> str:
    # storage dtypes enter as torch's names ("torch.bfloat16"): bf16 fingerprints are those of
    # shards written before fp8 storage existed, which stay valid
    parts = {"format": SHARD_FORMAT, "verifier": verifier_fp, "layers": layers,
             "compute_dtype": compute_dtype, "storage_dtype": str(STORAGE_DTYPES[storage_dtype])}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def make_plan(prepared, verifier: VerifierInfo, layers: list[int], out_dir: Path, *, compute_dtype: str,
              shard_tokens: int, storage_dtype: str = "bf16", check_existing: bool = True, by_content: bool = True,
              estimate: bool = True, gpus: int = 1) -> ExtractionPlan:
    """The plan for `out_dir`. With `check_existing` and `by_content`, samples that shards in the folder
    already hold are read from them and only the others are planned (module docstring); with
    `check_existing` alone, every sample is planned and a planned shard on disk is found by its name (a
    streamed extraction's plan). `estimate`: time it (a matmul timing, and a disk probe for plans over
    1 GiB) for `gpus` GPUs computing (the disk is one, shared by them); the parent that reports the
    plan does, the worker processes that only need its shards do not."""
    verifier_fp = verifier_fingerprint(verifier.path)
    fp = extraction_fingerprint(verifier_fp, layers, compute_dtype, storage_dtype)
    every = plan_shards(prepared, fp, shard_tokens)  # all rows: the plan of a folder with nothing to reuse
    lengths, sample_ids = prepared["seq_len"][:], prepared["sample_id"][:]
    keys = [""] * len(prepared)
    for spec in every:
        for r, key in zip(spec.rows, spec.sample_keys):
            keys[r] = key
    plan = ExtractionPlan(fp, str(verifier.path), verifier_fp, layers, verifier.hidden_size, len(prepared),
                          sum(lengths), every, storage_dtype=storage_dtype, sample_ids=sample_ids, sample_keys=keys,
                          plan_id=plan_id(fp, shard_tokens, sample_ids, keys, range(len(prepared))))
    out_dir.mkdir(parents=True, exist_ok=True)
    plan.free_bytes = shutil.disk_usage(out_dir).free
    if check_existing and by_content:
        placed = place_by_content(prepared, fp, shard_tokens, out_dir, every, sample_ids, keys)
        plan.shards, plan.reused, plan.placement, plan.done, plan.plan_id = (
            placed.shards, placed.reused, placed.placement, placed.done, placed.plan_id)
    else:  # every row in the plan of all rows
        plan.placement = [("", 0)] * len(prepared)
        for spec in every:
            for position, r in enumerate(spec.rows):
                plan.placement[r] = (spec.name, position)
        if check_existing:
            plan.done = shards_on_disk(out_dir, plan.shards)
    if check_existing:
        used = {use.name for use in plan.uses()}
        plan.stale_bytes = sum(p.stat().st_size for p in out_dir.glob("shard-*.safetensors") if p.name not in used)
    if not estimate:
        return plan
    plan.est_seconds = estimate_seconds(verifier, plan.pending_tokens, compute_dtype, gpus)
    if plan.bytes_to_write > 16 * DISK_PROBE_BYTES:
        # A small verifier's extraction writes faster than most disks take it (SmolLM2: 4.6 KB per
        # token at 600k+ tokens/s of forward): the plan is the slower of the two.
        plan.disk_bytes_per_s = disk_write_rate(out_dir)
        if plan.disk_bytes_per_s:
            plan.est_seconds = max(plan.est_seconds or 0.0, plan.bytes_to_write / plan.disk_bytes_per_s)
    return plan


def disk_write_rate(folder: Path) -> float | None:
    """Bytes/s the folder's disk took for DISK_PROBE_BYTES written and synced (a fraction of a
    second); None where it could not write them (a full disk is check_disk's to report)."""
    probe = folder / f".disk-probe-{os.getpid()}"
    data = os.urandom(DISK_PROBE_BYTES)  # incompressible
    try:
        t0 = time.perf_counter()
        with open(probe, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return DISK_PROBE_BYTES / (time.perf_counter() - t0)
    except OSError:
        return None
    finally:
        probe.unlink(missing_ok=True)


def shards_on_disk(out_dir: Path, shards: list[ShardSpec]) -> list[str]:
    """Names of planned shards on disk and valid. A shard unchanged since its journal line was verified
    when written; others are read in full, and journaled again when they pass (a lost or damaged
    journal is rebuilt this way); those that fail are deleted, to be redone."""
    journal = shard_journal(out_dir)
    entries = journal.entries()
    done = []
    for spec in shards:
        path = out_dir / spec.name
        if not path.exists():
            continue
        if unchanged_since_journal(path, entries.get(spec.name)):
            done.append(spec.name)
            continue
        try:
            verify_shard(path, spec.fingerprint)
        except ShardError as e:
            log.warning("redoing %s", e)
            path.unlink(missing_ok=True)
            continue
        checksum = read_metadata(path)["checksum"]
        journal.append(journal_line(path, checksum, spec.fingerprint, spec.tokens, len(spec.rows)))
        done.append(spec.name)
    return done


def estimate_seconds(verifier: VerifierInfo, tokens: int, compute_dtype: str, gpus: int = 1) -> float | None:
    """The compute time of `tokens` (compute_seconds) at a matmul rate measured here in the compute
    dtype (bf16 matmuls run 2.5x faster than fp32 on a CPU with AVX512-BF16), in a fraction of a
    second. `gpus`: the GPUs the extraction computes on (ExtractSettings.gpus)."""
    if not tokens:
        return 0.0
    bytes_per_param = {".gguf": 0.6}.get(Path(verifier.weight_files[0]).suffix, 2) if verifier.weight_files else 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    flops = matmul_flops_per_s(device, getattr(torch, compute_dtype), 4096 if device == "cuda" else 1024, reps=3)
    return compute_seconds(verifier.weight_bytes / bytes_per_param, tokens, flops, gpus if device == "cuda" else None)


def compute_seconds(parameters: float, tokens: int, flops_per_s: float, gpus: int | None) -> float:
    """2 x parameters FLOPs per token at 40% of `flops_per_s` (one device's matmul rate); on `gpus`
    GPUs, each its share of the tokens and no faster than any extraction was measured to run on one
    (MEASURED_MAX_TOKENS_PER_S). `gpus` None: the CPU, whose workers share its cores and its rate.
    An overestimate for MoE verifiers (only the active experts compute)."""
    seconds = 2 * parameters * tokens / (0.4 * flops_per_s)
    if gpus is None:
        return seconds
    return max(seconds, tokens / MEASURED_MAX_TOKENS_PER_S) / gpus


def bf16_matmul_peak(device: str) -> float:
    """The bf16 matmul rate the benchmarks' utilization figures divide by (8192^3 products on a GPU)."""
    cuda = device == "cuda"
    return matmul_flops_per_s(device, torch.bfloat16, 8192 if cuda else 1024, reps=20 if cuda else 3)


def matmul_flops_per_s(device: str, dtype: torch.dtype, n: int, reps: int) -> float:
    """The rate of n x n matrix products measured here: one warm-up, then `reps` timed."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    (a @ a).sum().item()
    t0 = time.perf_counter()
    for _ in range(reps):
        b = a @ a
    b.sum().item()
    return 2 * n**3 * reps / (time.perf_counter() - t0)


def check_disk(plan: ExtractionPlan, out_dir: Path, reserve_gb: float) -> None:
    if plan.free_bytes < plan.bytes_to_write + reserve_gb * 1e9:
        raise ExtractError(
            f"not enough disk in {out_dir}: {format_bytes(plan.bytes_to_write)} to write + "
            f"{format_bytes(reserve_gb * 1e9)} reserve > {format_bytes(plan.free_bytes)} free"
            + (f" ({format_bytes(plan.stale_bytes)} are shards of other inputs: `eagle3-pipeline prune-shards "
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
