"""What an extraction is and what every way of running it shares: its job and result, the inputs it
checks before any model loads, the verifier backend, the manifest's name, and its worker processes
(the offline stage, tasks/extract/stage.py, and the streamed one, tasks/extract/stream.py).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tasks.common.progress import ProgressCallback
from tasks.common.verifier import VerifierInfo, inspect_verifier
from tasks.common.workers import run_processes, worker_command, write_job_file
from tasks.extract.plan import ExtractError, ExtractionPlan, ShardUse
from tasks.extract.shards import SHARD_FORMAT, STORED_DTYPES, ShardSpec


def manifest_path(out_dir: Path, extraction_fp: str, prepared_fp: str) -> Path:
    return out_dir / f"manifest-{hashlib.sha256((extraction_fp + prepared_fp).encode()).hexdigest()[:16]}.json"


def manifest_content(plan: ExtractionPlan, prepared_fp: str, lengths,
                     checksum: Callable[[ShardUse], str | None]) -> dict:
    """A manifest: the shards the plan reads (its own and those of earlier extractions), each with its
    fingerprint, `checksum(use)` (None for a streamed shard not written yet: checked against its own
    when read), its whole token count, and the samples read from it: rows, sample ids, lengths, content
    keys and, where the run reads only some of the shard's samples or in another order, their positions."""
    specs = {s.name: s for s in plan.shards}
    return {
        "format": SHARD_FORMAT,
        "extraction_fingerprint": plan.fingerprint,
        "prepared_fingerprint": prepared_fp,
        "verifier": plan.verifier,
        "verifier_fingerprint": plan.verifier_fingerprint,
        "layers": plan.layers,
        "hidden_size": plan.hidden_size,
        "dtype": STORED_DTYPES[plan.storage_dtype],
        "samples": plan.samples,
        "tokens": plan.tokens,
        "shards": [shard_entry(use, plan, specs.get(use.name), lengths, checksum(use)) for use in plan.uses()],
    }


def shard_entry(use: ShardUse, plan: ExtractionPlan, spec: ShardSpec | None, lengths, checksum: str | None) -> dict:
    if plan.placement is None:  # a plan of its own whole shards only (a benchmark's): their ids and keys
        sample_ids, keys = list(spec.sample_ids), list(spec.sample_keys)
    else:
        sample_ids, keys = [plan.sample_ids[r] for r in use.rows], [plan.sample_keys[r] for r in use.rows]
    entry = {"name": use.name, "fingerprint": use.fingerprint, "checksum": checksum, "tokens": use.tokens,
             "rows": list(use.rows), "sample_ids": sample_ids, "lengths": [lengths[r] for r in use.rows],
             "sample_keys": keys}
    if not use.whole:
        entry["positions"] = list(use.positions)
    return entry


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
        from tasks.common.config import ExtractSettings

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
    streamed: bool = False  # extract.mode 'stream': the manifest lists shards the training stage has produced
    # what was new and what was reused: samples and tokens read from shards on disk before this run
    # (earlier extractions, or this one's before a resume), and those extracted in this run
    samples_reused: int = 0
    tokens_reused: int = 0
    samples_extracted: int = 0
    tokens_extracted: int = 0


def load_inputs(job: ExtractJob):
    """The prepared data, the verifier's description and the layers; fails before any model load."""
    from tasks.prepare.dataset import load_prepared

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


def make_backend(job: ExtractJob, verifier: VerifierInfo, layers: list[int]):
    s = job.extract_settings
    if s.backend == "vllm":
        from tasks.extract.backends.vllm import VllmBackend

        return VllmBackend(verifier, layers, job.compute_dtype, s, job.trust_remote_code)
    from tasks.extract.backends.hf import TransformersBackend

    return TransformersBackend(verifier, layers, job.compute_dtype, s.device, job.trust_remote_code, s.compile)


def run_worker_processes(module: str, label: str, job: ExtractJob, workers: int, callback: ProgressCallback | None,
                         lock_fd: int | None = None) -> None:
    """`workers` subprocesses (`python -m <module>`: the offline or the streamed extraction), each its own
    GPUs; their progress files are followed and merged into one report. A crash, OOM or CUDA abort fails this call,
    not the caller's process, and the shards already written stay valid for the retry; a
    worker's exception is raised here as it was raised there (tasks/common/workers.py). The
    workers inherit the folder's lock (`lock_fd`): it is held while any of them runs."""
    job_file = write_job_file(job)
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = gpus.split(",") if gpus else [str(i) for i in range(torch.cuda.device_count())]
    commands, envs, progress_files = [], [], []
    for rank in range(workers):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(workers))
        if visible and len(visible) >= workers:
            per = len(visible) // workers
            env["CUDA_VISIBLE_DEVICES"] = ",".join(visible[rank * per: (rank + 1) * per])
        elif not visible:  # the cores this process may use (a Slurm or container cpuset, taskset), not the host's
            env["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // workers))
        progress_file = job_file.with_name(f"rank-{rank}.jsonl")
        commands.append(worker_command(module, job_file, rank, workers, progress_file))
        envs.append(env)
        progress_files.append(progress_file)
    run_processes(commands, progress_files, callback, envs, label=label,
                  pass_fds=(lock_fd,) if lock_fd else ())
