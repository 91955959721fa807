"""Training across the nodes of a Ray cluster, through Ray Train's `TorchTrainer` (docs/SCALE.md
says why this launcher rather than torchrun with a rendezvous endpoint).

Each Ray Train worker runs the training process a local run starts (`tasks.train.loop.main`: the same
loop, checkpoints in the shared output folder, progress file, error report); Ray places the
`nodes x nproc` workers (one accelerator each, packed onto as few nodes as hold them), gives them
their rank and rendezvous, and initializes the process group (NCCL on GPUs, gloo otherwise), which
the loop finds already set up. The global batch stays the configured one: `nproc x
grad_accum_steps` micro-batches, each process accumulating `grad_accum_steps / nodes` of them, so
the run follows the trajectory one node would.

Ray Train does not restart a failed worker group here (`max_failures=0`): the stage's Prefect task
retries a transient failure and resumes from the last checkpoint, and a deterministic one (a
worker's `TrainDataError`, ...) is raised as the worker raised it, which the task does not retry.
"""

from __future__ import annotations

import json
import threading
from dataclasses import asdict, replace
from pathlib import Path

from tasks.common.errors import describe
from tasks.common.folder_lock import folder_lock
from tasks.common.progress import ProgressCallback
from tasks.common.workers import WorkerLost, errors_file, follow, read_errors, rebuild
from tasks.extract.shards import read_manifest
from tasks.train.data import check_inputs
from tasks.train.job import TrainJob, TrainResult, train_fingerprint


def train_process(config: dict) -> None:
    """One Ray Train worker: a training process, its rank and process group set up by Ray Train."""
    from tasks.train.loop import main

    main(config["argv"])


def run_training_on_ray(job: TrainJob, manifest_fp: str, vocab_fp: str, *, nodes: int, accelerator: str = "GPU",
                        callback: ProgressCallback | None = None) -> TrainResult:
    """The train stage on the Ray cluster this process is connected to (or a local Ray it starts)."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig, TrainingFailedError
    from ray.train.torch import TorchConfig, TorchTrainer

    s = job.train_settings
    check_inputs(job, read_manifest(job.manifest))  # a mismatch fails before any worker starts
    out_dir = Path(job.out_dir).resolve()
    with folder_lock(out_dir, "training"):  # one training per folder, as locally: held while the workers run
        # the configured run, whatever `nodes`
        fingerprint = train_fingerprint(manifest_fp, vocab_fp, job.settings, job.init_from, job.parent_manifest)
        per_process = replace(job, out_dir=str(out_dir),
                              settings={**job.settings, "grad_accum_steps": s.grad_accum_steps // nodes})
        job_file, result_file, progress_file = out_dir / "job.json", out_dir / "result.json", out_dir / "progress.jsonl"
        job_file.write_text(json.dumps(asdict(per_process)))
        for stale in (result_file, progress_file, errors_file(progress_file)):  # an earlier attempt's
            stale.unlink(missing_ok=True)
        gpu, cpu_only = accelerator == "GPU", accelerator == "CPU"
        trainer = TorchTrainer(
            train_process,
            train_loop_config={"argv": ["--job", str(job_file), "--result", str(result_file),
                                        "--progress-file", str(progress_file)]},
            torch_config=TorchConfig(backend="nccl" if gpu else "gloo"),
            scaling_config=ScalingConfig(num_workers=nodes * s.nproc, use_gpu=gpu,
                                         resources_per_worker={"CPU": 1} if cpu_only else {"CPU": 1, accelerator: 1}),
            run_config=RunConfig(name=f"train-{fingerprint[:16]}", storage_path=str(out_dir / "ray-train"),
                                 failure_config=FailureConfig(max_failures=0)),
        )
        failure: list[BaseException] = []

        def fit() -> None:
            try:
                trainer.fit()
            except TrainingFailedError as e:
                failure.append(e)

        fitting = threading.Thread(target=fit, name="ray-train-fit", daemon=True)
        fitting.start()
        follow(fitting.is_alive, [progress_file], callback, poll_s=2.0)
        if failure:
            raise worker_error(failure[0], progress_file) from failure[0]
        result = TrainResult(**json.loads(result_file.read_text()))
        return TrainResult(**{**asdict(result), "fingerprint": fingerprint})


def worker_error(failure: BaseException, progress_file: Path) -> Exception:
    """The first exception a training process reported, as it raised it (its type, message and
    deterministic/transient verdict), else a transient WorkerLost carrying Ray Train's message."""
    records = sorted(read_errors(progress_file), key=lambda r: r["rank"])
    if records:
        exc = rebuild(records[0])
        exc.add_note(f"raised in training process {records[0]['rank']} (pid {records[0]['pid']}) on the Ray "
                     f"cluster; its traceback:\n{records[0]['traceback'].rstrip()}")
        return exc
    return WorkerLost(f"training on the Ray cluster failed without a process reporting an exception "
                      f"({describe(failure)}); a retry resumes from the last checkpoint")
