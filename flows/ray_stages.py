"""The `ray` executor (cluster.executor: ray): the data-parallel stages as Prefect tasks on a Ray
cluster, through prefect-ray's `RayTaskRunner`. Design and a worked plan: docs/SCALE.md.

    cluster_for_run            joins the cluster (or starts Ray here) for the whole flow run, and
                               checks that every node sees the output folder (a marker the flow
                               writes, read by a probe task pinned to each node)
    extract_on_ray             the plan here; one `extract-rank` task per rank, each requesting the
                               accelerators its backend needs and running the same worker process
                               as a local run (`python -m tasks.extract.stage --rank r --world-size N`)
                               into the shared folder; then one task verifies the folder and writes
                               the manifest
    regenerate_on_ray          the same shape for answer regeneration (prepare's first step):
                               one `regenerate-rank` task per rank (chunk c by rank c % N), then
                               one task writes the conversations file in source order
    synthesize_on_ray          prompt synthesis (before regeneration) as one rank on the cluster
    train_on_ray               training through Ray Train (tasks/train/on_ray.py); for a streamed
                               extraction, its producers meanwhile, as `extract (streamed)` rank
                               tasks on the accelerators training leaves free (docs/STREAMING.md)

While the ranks run, the flow's process holds the stage folder's lock (tasks/common/folder_lock.py): a
second run on the folder is refused, as locally.

A rank's task retries a transient failure alone, on its node, resuming from its finished shards
(Prefect's retries, as the local stage). Prefect's retries run in the task's own process, so they
cannot outlive the node that runs it: a rank whose node is lost is run again by Ray on another node
that has the resources (Ray's task retries, `max_retries`), as the same task run, and resumes from
the shards on the shared disk. Nothing here is part of a cache key: the output is the same with
either executor and any number of ranks.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger

from flows.task_support import GPU_STAGE, ProgressArtifact
from tasks.common.config import ClusterSettings, PipelineConfig
from tasks.common.errors import PermanentError
from tasks.common.folder_lock import folder_lock
from tasks.common.progress import ProgressCallback, ProgressEvent
from tasks.common.workers import follow, run_processes, worker_command, write_job_file
from tasks.extract.plan import check_disk, make_plan
from tasks.extract.shards import read_manifest
from tasks.extract.stage import ExtractJob, ExtractResult, load_inputs, run_extraction
from tasks.extract.stream import producing
from tasks.prepare.regenerate import RegenerateJob, plan_regeneration, write_regenerated
from tasks.prepare.synthesize import SynthesizeJob, write_synthesized
from tasks.train.job import TrainJob, TrainResult
from tasks.train.on_ray import run_training_on_ray
from tasks.train.stage import stream_report

log = logging.getLogger(__name__)

NODE_LOSS_RETRIES = 3  # Ray re-runs a rank whose node (or worker process) died this many times


class ClusterError(PermanentError, RuntimeError):
    """The Ray cluster cannot run this configuration (a node without the shared folder, no
    accelerator resources); the message says what to change."""


def ray_runner(cluster: ClusterSettings):
    """prefect-ray's task runner on the configured cluster. Entering it joins the cluster (or starts
    Ray on this machine when no address is set) unless this process is already connected."""
    if not cluster.address:
        # A Ray of the run's own serves this machine alone: it stays on the loopback interface, its
        # services unreachable from the network. Ray reads this when it is imported.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    from prefect_ray import RayTaskRunner

    # The dashboard (on 127.0.0.1) serves Ray's State API, which Ray Train's placement-group
    # cleaner queries every second: without it, a warning a second for the whole of training.
    return RayTaskRunner(address=cluster.address, init_kwargs={} if cluster.address else {"include_dashboard": True})


@contextmanager
def cluster_for_run(config: PipelineConfig) -> Iterator[None]:
    """For `cluster.executor: ray`, the Ray cluster for the whole flow run (a Ray started here is
    stopped at its end), its nodes checked to share `output_dir`; for `local`, nothing."""
    if config.cluster.executor != "ray":
        yield
        return
    with ray_runner(config.cluster) as runner:
        check_shared_folder(runner, Path(config.output_dir).resolve())
        yield


# ---------------------------------------------------------------------------- the shared folder


@task(name="probe-shared-folder", task_run_name="probe {node_ip}", cache_policy=NO_CACHE)
def probe_folder(marker: str, node_ip: str) -> dict:
    """What this node reads at the marker's path (None: no such file)."""
    import ray

    path = Path(marker)
    return {"node_id": ray.get_runtime_context().get_node_id(), "ip": node_ip, "host": socket.gethostname(),
            "read": path.read_text() if path.is_file() else None}


def check_shared_folder(runner, folder: Path) -> None:
    """Every alive node reads the marker the flow wrote into `folder`, or ClusterError names the
    nodes that do not (a node-local disk, a mount missing or at another path)."""
    import ray
    from prefect_ray.context import remote_options
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    folder.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex
    marker = folder / f".cluster-probe-{token[:12]}"
    marker.write_text(token)
    try:
        futures = []
        nodes = [n for n in ray.nodes() if n["Alive"]]
        for node in nodes:
            strategy = NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
            with remote_options(num_cpus=0, scheduling_strategy=strategy, max_retries=0):
                futures.append(runner.submit(probe_folder, {"marker": str(marker),
                                                            "node_ip": node["NodeManagerAddress"]}))
        seen = [f.result(timeout=300) for f in futures]
    finally:
        marker.unlink(missing_ok=True)
    blind = [s for s in seen if s["read"] != token]
    if blind:
        names = ", ".join(f"{s['ip']} ({s['host']}, node {s['node_id'][:8]}): "
                          + ("no such file" if s["read"] is None else "another file") for s in blind)
        raise ClusterError(
            f"{len(blind)} of {len(seen)} Ray nodes do not see the output folder {folder} the flow writes: they "
            f"cannot read the marker {marker.name} it wrote there ({names}). Every node must mount the same shared "
            "filesystem (NFS, Lustre, a mounted bucket) at the same path; set output_dir to a folder there.")
    get_run_logger().info("all %d Ray nodes see the output folder %s", len(seen), folder)


# ---------------------------------------------------------------------------- extraction


def rank_resources(cluster: ClusterSettings, accelerators: int) -> dict:
    """Ray options for one rank: its accelerators (GPUs, the configured custom resource, or CPUs on a
    cluster without accelerators) and a CPU."""
    if cluster.accelerator == "CPU":
        return {"num_cpus": accelerators}
    if cluster.accelerator == "GPU":
        return {"num_cpus": 1, "num_gpus": accelerators}
    return {"num_cpus": 1, "resources": {cluster.accelerator: accelerators}}


def rank_count(cluster: ClusterSettings, accelerators: int) -> int:
    import ray

    if cluster.ranks:
        return cluster.ranks
    total = int(ray.cluster_resources().get(cluster.accelerator, 0))
    if total < accelerators:
        raise ClusterError(f"the Ray cluster advertises {total} '{cluster.accelerator}' resources, a rank needs "
                           f"{accelerators}: start its nodes with their GPUs (or set cluster.accelerator to the "
                           "resource they advertise)")
    return total // accelerators


@task(name="rank", task_run_name="{stage} rank {rank} of {world_size}", cache_policy=NO_CACHE, **GPU_STAGE)
def rank_task(stage: str, module: str, job_file: str, rank: int, world_size: int) -> dict:
    """Rank `rank` of `world_size` of a stage: the local stage's worker process (`python -m
    module`) on this node, writing its part of the work into the shared folder; a retry resumes
    from what it finished."""
    import ray

    progress_file = Path(job_file).with_name(f"rank-{rank}.jsonl")
    node = ray.get_runtime_context().get_node_id()
    get_run_logger().info("rank %d of %d on node %s (%s)", rank, world_size, node[:12], socket.gethostname())
    t0 = time.monotonic()
    run_processes([worker_command(module, Path(job_file), rank, world_size, progress_file)], [progress_file],
                  ProgressArtifact(f"{stage} rank {rank}"), label=f"{stage} rank {rank}")
    return {"rank": rank, "node_id": node, "host": socket.gethostname(), "wall_s": round(time.monotonic() - t0, 2)}


def run_ranks(runner, cluster: ClusterSettings, stage: str, module: str, job, ranks: int, accelerators: int,
              callback: ProgressCallback | None) -> None:
    """One `rank_task` per rank on the cluster, each requesting `accelerators`; their progress files
    merged into `callback` while they run. Raises the first failed rank's exception, as it was
    raised, once all have ended."""
    from prefect_ray.context import remote_options

    job_file = write_job_file(job)
    log.info("%s: %d ranks on the Ray cluster, %d %s each", stage, ranks, accelerators, cluster.accelerator)
    with remote_options(**rank_resources(cluster, accelerators), max_retries=NODE_LOSS_RETRIES):
        futures = [runner.submit(rank_task.with_options(name=f"{stage}-rank"),
                                 {"stage": stage, "module": module, "job_file": str(job_file), "rank": r,
                                  "world_size": ranks})
                   for r in range(ranks)]
    follow(lambda: not all_done(futures), [job_file.with_name(f"rank-{r}.jsonl") for r in range(ranks)], callback,
           poll_s=2.0, work=stage)
    ranks_run = [f.result() for f in futures]  # the first failed rank's exception, as it was raised
    log.info("%s ranks done: %s", stage, ", ".join(f"{r['rank']} on {r['host']} ({r['node_id'][:8]}) in "
                                                   f"{r['wall_s']} s" for r in ranks_run))


@task(name="verify-extraction", cache_policy=NO_CACHE)
def verify_extraction_task(job: ExtractJob) -> ExtractResult:
    """Every shard present: the local stage plans, finds nothing to extract (the verifier is not
    loaded), verifies the whole folder and writes the manifest."""
    return run_extraction(job, in_process=True)


def extract_on_ray(cluster: ClusterSettings, job: ExtractJob, *, on_plan=None,
                   callback: ProgressCallback | None = None) -> ExtractResult:
    """The extract stage on the cluster (module docstring); the result a local run returns."""
    t0 = time.monotonic()
    s = job.extract_settings
    out_dir = Path(job.out_dir).resolve()
    job = replace(job, out_dir=str(out_dir), prepared_path=str(Path(job.prepared_path).resolve()))
    if s.mode == "stream":  # only the manifest of the shards to come: train_on_ray runs their producers
        return run_extraction(job, on_plan=on_plan, callback=callback)
    prepared, verifier, layers = load_inputs(job)
    plan = make_plan(prepared, verifier, layers, out_dir, compute_dtype=job.compute_dtype, shard_tokens=s.shard_tokens,
                     storage_dtype=s.storage_dtype)
    log.info("%s", plan.describe())
    if on_plan is not None:
        on_plan(plan)
    check_disk(plan, out_dir, s.reserve_disk_gb)
    pending_shards, pending_tokens, work = len(plan.pending), plan.pending_tokens, plan.work_counts()
    last: list[ProgressEvent] = []

    def report(event: ProgressEvent) -> None:
        if event.stage.startswith("extract"):
            last[:] = [event]
            if plan.calibrate(event) and on_plan is not None:
                on_plan(plan)
        if callback is not None:
            callback(event)

    t_extract = time.monotonic()
    if plan.pending:
        accelerators = s.tensor_parallel_size if s.backend == "vllm" else 1
        with folder_lock(out_dir, "extraction"), ray_runner(cluster) as runner:
            run_ranks(runner, cluster, "extract", "tasks.extract.stage", job, rank_count(cluster, accelerators),
                      accelerators, report)
    extract_s = time.monotonic() - t_extract
    verified = verify_extraction_task(job)
    steady = last[0].rate if last else None
    return replace(verified, shards_extracted=pending_shards, verifier_loaded=pending_tokens > 0,
                   wall_s=round(time.monotonic() - t0, 2), steady_tokens_per_s=round(steady, 1) if steady else None,
                   wall_tokens_per_s=round(pending_tokens / extract_s, 1) if pending_tokens else None, **work)


# ---------------------------------------------------------------------------- training


def train_on_ray(cluster: ClusterSettings, job: TrainJob, manifest_fp: str, vocab_fp: str, *,
                 callback: ProgressCallback | None = None,
                 stream_callback: ProgressCallback | None = None) -> TrainResult:
    """The train stage on the cluster: Ray Train's processes on cluster.train_nodes nodes. For a streamed
    extraction, its producers run meanwhile as rank tasks (chunk of shards i by rank i % N, each on the
    accelerators its backend needs) wherever the cluster has accelerators training does not take: the
    shared shard folder is their only meeting point, and the flow holds its lock while they run."""
    manifest = read_manifest(job.manifest)
    if "stream" not in manifest:
        return run_training_on_ray(job, manifest_fp, vocab_fp, nodes=cluster.train_nodes,
                                   accelerator=cluster.accelerator, callback=callback)
    s = ExtractJob(**manifest["stream"]["job"]).extract_settings
    per_rank = s.tensor_parallel_size if s.backend == "vllm" else 1
    with folder_lock(Path(job.manifest).parent, "extraction"), ray_runner(cluster) as runner:
        ranks = producer_ranks(cluster, per_rank, cluster.train_nodes * job.train_settings.nproc)

        def run_producers(extract_job: ExtractJob, progress: ProgressCallback | None) -> None:
            run_ranks(runner, cluster, "extract (streamed)", "tasks.extract.stream", extract_job, ranks, per_rank,
                      progress)

        with producing(manifest, run_producers, stream_callback) as control:
            result = run_training_on_ray(job, manifest_fp, vocab_fp, nodes=cluster.train_nodes,
                                         accelerator=cluster.accelerator, callback=callback)
    return replace(result, stream=stream_report(control.reports(), manifest))


def producer_ranks(cluster: ClusterSettings, per_rank: int, training: int) -> int:
    """Producer ranks for streaming beside `training` accelerators: cluster.ranks, or as many as the rest
    hold. Both must fit at once (a trainer waiting for a producer Ray cannot place would wait forever)."""
    import ray

    total = int(ray.cluster_resources().get(cluster.accelerator, 0))
    ranks = cluster.ranks or (total - training) // per_rank
    if ranks < 1 or ranks * per_rank + training > total:
        raise ClusterError(
            f"streaming on Ray runs training ({training} '{cluster.accelerator}') and the verifier's producer ranks "
            f"({max(ranks, 1)} x {per_rank}) at once, but the cluster advertises {total} '{cluster.accelerator}': add "
            "nodes, lower cluster.train_nodes or cluster.ranks, or extract offline (extract.mode: offline)")
    return ranks


# ---------------------------------------------------------------------------- regeneration


@task(name="merge-regenerated", cache_policy=NO_CACHE)
def merge_regenerated_task(job: RegenerateJob, world_size: int) -> Path:
    """Every conversation regenerated: the outputs in source order, the ranks' reports summed."""
    return write_regenerated(job, world_size)


def regenerate_on_ray(cluster: ClusterSettings, job: RegenerateJob, *,
                      callback: ProgressCallback | None = None) -> Path:
    """Answer regeneration on the cluster: the run planned here (its conversations new to the answer
    store, in chunks), then one `rank_task` per rank (chunk c by rank c % N, each on
    regenerate.tensor_parallel_size accelerators: one vLLM engine, or one transformers model spread
    over them), then one task writes the conversations file, the same file a local run writes."""
    job = replace(job, out_dir=str(Path(job.out_dir).resolve()),
                  store_dir=str(Path(job.store_dir).resolve()) if job.store_dir else "",
                  sources=[str(Path(p).resolve()) if isinstance(p, str) and Path(p).exists() else p
                           for p in job.sources])
    accelerators = job.regenerate_settings.tensor_parallel_size or 1
    with folder_lock(job.store, "regeneration"):
        plan_regeneration(job)  # before any rank starts: every rank reads the same chunks
        with ray_runner(cluster) as runner:
            ranks = rank_count(cluster, accelerators)
            run_ranks(runner, cluster, "regenerate", "tasks.prepare.regenerate", job, ranks, accelerators, callback)
        return merge_regenerated_task(job, ranks)


def synthesize_on_ray(cluster: ClusterSettings, job: SynthesizeJob, *,
                      callback: ProgressCallback | None = None) -> Path:
    """Prompt synthesis on the cluster: one `rank_task` (chunks are sampled in order until enough
    prompts are kept) on regenerate.tensor_parallel_size accelerators, then the prompts file a local
    run writes."""
    job = replace(job, out_dir=str(Path(job.out_dir).resolve()))
    with folder_lock(job.out_dir, "prompt synthesis"):
        with ray_runner(cluster) as runner:
            run_ranks(runner, cluster, "synthesize", "tasks.prepare.synthesize", job, 1,
                      job.generation["tensor_parallel_size"] or 1, callback)
        return write_synthesized(job)


def all_done(futures) -> bool:
    import ray

    refs = [f.wrapped_future for f in futures]
    return len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) == len(refs)
