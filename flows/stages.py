"""The stages as Prefect tasks: content-keyed caching, retries, tags and artifacts.

The work is done by plain functions in tasks/; this module only adds orchestration.

Cache keys are the *content* fingerprints of a stage's inputs (data bytes, tokenizer, verifier
identity, upstream results, settings) plus the source of the code that does the work, never a
run id or a path string: re-running with the same inputs is a cache hit in any later run, and
an edited dataset re-runs prepare and everything downstream. Results are small dataclasses
(paths, fingerprints, counts), never tensors.

GPU-heavy stages (extract, train, validate) run their work in subprocesses (tasks/extract.py,
tasks/train.py and tasks/vllm_live.py launch them), so a CUDA abort, OOM kill or segfault fails
the task, which retries and resumes from the shards or checkpoints on disk, instead of crashing
the flow. Only such transient failures are retried: a deterministic one (tasks/errors.py), raised
here or in a worker process, fails the task at once with the worker's exception type and message.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from functools import cache
from pathlib import Path

from prefect import task
from prefect.artifacts import (
    create_image_artifact,
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.logging import get_run_logger
from prefect.tasks import exponential_backoff

import tasks.acceptance
import tasks.chat_data
import tasks.chat_template
import tasks.checkpoints
import tasks.decode_attention
import tasks.draft_check
import tasks.extract
import tasks.extract_plan
import tasks.generators
import tasks.hf_backend
import tasks.plots
import tasks.prepare
import tasks.regenerate
import tasks.shard_writer
import tasks.shards
import tasks.subprocess_runs
import tasks.tracking
import tasks.train
import tasks.train_data
import tasks.train_eval
import tasks.train_model
import tasks.validate
import tasks.vllm_live
import tasks.vocab
from tasks.config import PipelineConfig
from tasks.errors import describe, is_deterministic
from tasks.extract import ExtractJob, ExtractResult, run_extraction
from tasks.prepare import PreparedData, prepare, prepare_fingerprint, read_report
from tasks.progress import ProgressEvent
from tasks.regenerate import RegenerateJob, regenerate, regeneration_job
from tasks.train import TrainJob, TrainResult, run_training
from tasks.validate import ValidationResult, validate
from tasks.verifier import inspect_verifier, verifier_fingerprint
from tasks.vocab import VocabResult, build_vocab

def retry_transient(task, task_run, state) -> bool:
    """Prefect's retry condition: retry what a retry can change, never a deterministic error
    (bad input or settings, a verifier the backend cannot load: tasks/errors.py)."""
    exc = state.result(raise_on_failure=False)
    if isinstance(exc, BaseException) and is_deterministic(exc):
        get_run_logger().error("%s: not retried, the same inputs would fail the same way", describe(exc))
        return False
    return True


RETRY_TRANSIENT = {"retry_condition_fn": retry_transient}
GPU_STAGE = {"retries": 2, "retry_delay_seconds": exponential_backoff(backoff_factor=10), "retry_jitter_factor": 0.2,
             **RETRY_TRANSIENT}


@cache
def code_fingerprint(*code) -> str:
    return hashlib.sha256("".join(inspect.getsource(c) for c in code).encode()).hexdigest()


def cache_key(ctx, *parts, modules: tuple = ()) -> str:
    """The task's name and source, the source of the modules doing its work, and its inputs' content."""
    code = code_fingerprint(ctx.task.fn, *modules)
    blob = json.dumps([ctx.task.name, code, *parts], sort_keys=True, default=str)
    return f"{ctx.task.name}-{hashlib.sha256(blob.encode()).hexdigest()}"


def stage_dir(config: PipelineConfig, stage: str) -> Path:
    return Path(config.output_dir) / stage


class ProgressArtifact:
    """A Prefect progress artifact updated in place from progress events, and a line in the run's
    log once a minute (the stage's subprocess already prints every event to the console)."""

    def __init__(self, description: str, log_every_s: float = 60.0):
        self.id = create_progress_artifact(progress=0.0, description=description)
        self.logger = get_run_logger()
        self.log_every_s, self.last_log = log_every_s, -float("inf")

    def __call__(self, event: ProgressEvent) -> None:
        update_progress_artifact(self.id, 100 * event.fraction, description=event.describe())
        if event.elapsed_s - self.last_log >= self.log_every_s or event.fraction >= 1:
            self.last_log = event.elapsed_s
            self.logger.info(event.describe())


def result_storage(config: PipelineConfig):
    """Where task results (the cache) go: the configured block, or a local one under the outputs.

    Keeping the cache next to the outputs it describes means deleting an output folder also
    forgets its cached results, whichever way the flow was started (CLI, deployment, schedule)."""
    if config.result_storage:
        return config.result_storage
    from prefect.filesystems import LocalFileSystem

    path = (Path(config.output_dir) / ".prefect" / "results").resolve()
    block = LocalFileSystem(basepath=str(path))
    block.save(f"eagle3-results-{hashlib.sha256(str(path).encode()).hexdigest()[:12]}", overwrite=True)
    return block


def run_name() -> str:
    """Flow run names say which verifier and data: 'smollm2-135m-instruct on sharegpt_v3.json (demo)'."""
    from prefect.runtime import flow_run

    config = flow_run.parameters["config"]
    config = config if isinstance(config, PipelineConfig) else PipelineConfig.model_validate(config)
    data = ", ".join(Path(s.removeprefix("demo://")).name for s in config.data.sources)
    return f"{Path(config.verifier.path.removeprefix('demo://')).name} on {data} ({config.name})"


def show_picture(path: Path, key: str, description: str) -> None:
    """A PNG (tasks/plots.py) as an image artifact holding it as a data: URL, which both of Prefect
    3.7's UIs show without a file server. Not inside a markdown artifact: the new UI's markdown
    renderer blanks data: URLs (react-markdown's default URL filter)."""
    create_image_artifact(image_url=tasks.plots.data_uri(path), key=key, description=description)
    get_run_logger().info("%s: %s", description, path)


def table(rows: dict) -> list[dict]:
    return [{"item": k, "value": json.dumps(v) if isinstance(v, dict | list) else v} for k, v in rows.items()]


# ---------------------------------------------------------------------------------- prepare


def _prepare_key(ctx, p) -> str:
    c: PipelineConfig = p["config"]
    regenerate = ({**c.data.regenerate.output_settings(), "verifier": verifier_fingerprint(c.verifier.path)}
                  if c.data.regenerate.enabled else None)
    fp = prepare_fingerprint(c.verifier.path, c.data.sources, c.data.max_rows, c.data.max_seq_len, regenerate,
                             c.data.supervise_end_of_turn)
    return cache_key(ctx, fp, c.output_dir,
                     modules=(tasks.prepare, tasks.chat_data, tasks.chat_template, tasks.regenerate, tasks.generators,
                              tasks.decode_attention))


@task(name="prepare", cache_key_fn=_prepare_key, retries=1, retry_delay_seconds=5, **RETRY_TRANSIENT)
def prepare_task(config: PipelineConfig) -> PreparedData:
    sources, max_rows = config.data.sources, config.data.max_rows
    regeneration = regeneration_job(config)  # the verifier's own answers, when enabled
    if regeneration is not None:
        sources, max_rows = [str(_regenerate(config, regeneration))], None
    result = prepare(config.verifier.path, sources, config.output_dir, max_seq_len=config.data.max_seq_len,
                     max_rows=max_rows, supervise_end_of_turn=config.data.supervise_end_of_turn)
    report = read_report(result.path)
    create_table_artifact(
        table=table({k: v for k, v in report.items() if k != "dropped_examples"}), key="prepare-report",
        description=f"prepare: {result.rows} rows kept of {report['rows_read']}, "
                    f"{result.supervised_tokens:,} supervised tokens",
    )
    get_run_logger().info("prepared data: %s", result.path)
    return result


def _regenerate(config: PipelineConfig, job: RegenerateJob) -> Path:
    progress = ProgressArtifact("answer regeneration")
    if config.cluster.executor == "ray":  # one task per rank on the cluster (flows/ray_stages.py)
        from flows.ray_stages import regenerate_on_ray

        return regenerate_on_ray(config.cluster, job, callback=progress)
    return regenerate(job, callback=progress)


# ---------------------------------------------------------------------------------- extract


def _extract_job(config: PipelineConfig, prepared: PreparedData) -> ExtractJob:
    return ExtractJob(prepared.path, prepared.fingerprint, config.verifier.path,
                      str(stage_dir(config, "hidden_states")), config.verifier.dtype,
                      config.verifier.trust_remote_code, config.extract.model_dump())


def _extract_key(ctx, p) -> str:
    c: PipelineConfig = p["config"]
    return cache_key(ctx, p["prepared"].fingerprint, verifier_fingerprint(c.verifier.path), c.verifier.dtype,
                     c.extract.output_settings(), c.output_dir,
                     modules=(tasks.extract, tasks.extract_plan, tasks.shard_writer, tasks.shards,
                              tasks.subprocess_runs, tasks.hf_backend))


@task(name="extract", cache_key_fn=_extract_key, tags=["gpu"], **GPU_STAGE)
def extract_task(config: PipelineConfig, prepared: PreparedData) -> ExtractResult:
    planned_rate: list[float | None] = []  # tokens/s; the first call's is the plan's, before any model loads

    def show_plan(plan) -> None:  # again once the first batches corrected the estimate: the latest version shows
        create_table_artifact(table=table(plan.summary()), key="extraction-plan",
                              description=f"{plan.describe().splitlines()[0]}; estimated time {plan.estimate_text()}")
        planned_rate.append(plan.pending_tokens / plan.est_seconds if plan.est_seconds else None)

    job, progress = _extract_job(config, prepared), ProgressArtifact("hidden-state extraction")
    if config.cluster.executor == "ray":  # one task per rank on the cluster (flows/ray_stages.py)
        from flows.ray_stages import extract_on_ray

        result = extract_on_ray(config.cluster, job, on_plan=show_plan, callback=progress)
    else:
        result = run_extraction(job, on_plan=show_plan, callback=progress)
    get_run_logger().info("extraction: %s", result)
    if result.shards_extracted:  # nothing measured when every shard was already on disk
        manifest = Path(result.manifest)
        png = tasks.plots.extraction_rate(planned_rate[0], result.steady_tokens_per_s, result.wall_tokens_per_s,
                                          manifest.with_name(f"{manifest.stem}-rate.png"))
        show_picture(png, "extraction-rate", "extraction rate, tokens/s: planned "
                     f"{planned_rate[0] or 0:,.0f}, measured {result.steady_tokens_per_s or 0:,.0f} (steady state), "
                     f"{result.wall_tokens_per_s or 0:,.0f} (wall)")
    return result


# ---------------------------------------------------------------------------------- vocab


def _vocab_key(ctx, p) -> str:
    c: PipelineConfig = p["config"]
    return cache_key(ctx, p["prepared"].fingerprint, c.vocab.draft_vocab_size,
                     inspect_verifier(c.verifier.path).vocab_size, c.output_dir, modules=(tasks.vocab,))


@task(name="vocab", cache_key_fn=_vocab_key, retries=1, retry_delay_seconds=5, **RETRY_TRANSIENT)
def vocab_task(config: PipelineConfig, prepared: PreparedData) -> VocabResult:
    result = build_vocab(prepared.path, prepared.fingerprint, config.verifier.path, config.output_dir,
                         config.vocab.draft_vocab_size)
    create_table_artifact(table=table(result.__dict__), key="draft-vocabulary",
                          description=f"{result.draft_vocab_size} draft tokens cover {100 * result.coverage:.2f}% "
                                      "of supervised tokens")
    return result


# ---------------------------------------------------------------------------------- train


def _train_job(config: PipelineConfig, prepared: PreparedData, extracted: ExtractResult,
               vocab: VocabResult) -> TrainJob:
    fp = tasks.train.train_fingerprint(extracted.fingerprint, vocab.fingerprint, config.train.model_dump())
    return TrainJob(extracted.manifest, prepared.path, vocab.path, config.verifier.path,
                    str(stage_dir(config, "train") / fp[:16]), extracted.layers[:3],
                    config.verifier.trust_remote_code, config.train.model_dump())


def _train_key(ctx, p) -> str:
    c: PipelineConfig = p["config"]
    return cache_key(ctx, p["extracted"].fingerprint, p["vocab"].fingerprint, c.train.output_settings(),
                     c.output_dir, modules=(tasks.train, tasks.train_model, tasks.train_eval, tasks.train_data,
                                            tasks.checkpoints, tasks.acceptance, tasks.subprocess_runs))


@task(name="train", cache_key_fn=_train_key, tags=["gpu"], **GPU_STAGE)
def train_task(config: PipelineConfig, prepared: PreparedData, extracted: ExtractResult,
               vocab: VocabResult) -> TrainResult:
    job = _train_job(config, prepared, extracted, vocab)
    progress = ProgressArtifact("draft training")
    if config.cluster.executor == "ray":  # across cluster.train_nodes nodes, through Ray Train (tasks/train_ray.py)
        from tasks.train_ray import run_training_on_ray

        result = run_training_on_ray(job, extracted.fingerprint, vocab.fingerprint, nodes=config.cluster.train_nodes,
                                     accelerator=config.cluster.accelerator, callback=progress)
    else:
        result = run_training(job, extracted.fingerprint, vocab.fingerprint, callback=progress)
    metrics = tasks.tracking.read_metrics(job.out_dir)
    val = [m for m in metrics if m["split"] == "val"]
    create_table_artifact(
        table=[{k: round(v, 4) if isinstance(v, float) else v for k, v in m.items() if k != "split"} for m in val],
        key="training-validation",
        description=f"validation during training; best step {result.best_step}: simulated acceptance length "
                    f"{result.simulated_acceptance_length:.3f} (k={config.train.ttt_steps})",
    )
    png = tasks.plots.training_curves(metrics, Path(job.out_dir) / "curves.png", result.best_step if val else None)
    show_picture(png, "training-curves", f"training loss and simulated acceptance length against step; best step "
                 f"{result.best_step}: {result.simulated_acceptance_length:.3f}")
    get_run_logger().info("draft: %s", result.draft_path)
    return result


# ---------------------------------------------------------------------------------- validate


def _validate_key(ctx, p) -> str:
    c: PipelineConfig = p["config"]
    return cache_key(ctx, p["trained"].fingerprint, c.validation.model_dump(), c.output_dir,
                     modules=(tasks.validate, tasks.draft_check, tasks.vllm_live))


@task(name="validate", cache_key_fn=_validate_key, tags=["gpu"], **GPU_STAGE)
def validate_task(config: PipelineConfig, trained: TrainResult, extracted: ExtractResult) -> ValidationResult:
    out = stage_dir(config, "validation") / trained.fingerprint[:16]
    result = validate(trained.draft_path, config.verifier.path, extracted.layers[:3], config.validation, out,
                      simulated_acceptance_length=trained.simulated_acceptance_length,
                      replayed_acceptance_length=trained.val_metrics.get("replayed_acceptance_length"))
    create_markdown_artifact(markdown=Path(result.report_markdown).read_text(), key="draft-validation",
                             description="static checks and vLLM-measured acceptance")
    # greedy decoding replayed on held-out samples counts what vLLM counts (train.val_fraction=0: none)
    replayed = tasks.acceptance.replayed_per_position(trained.val_metrics, config.train.ttt_steps)
    replayed_length = trained.val_metrics.get("replayed_acceptance_length")
    if replayed or result.per_position_acceptance:
        png = tasks.plots.acceptance_per_position(replayed, result.per_position_acceptance, out / "acceptance.png",
                                                  replayed_length=replayed_length,
                                                  measured_length=result.mean_acceptance_length)
        show_picture(png, "draft-acceptance-per-position", "acceptance per draft position; acceptance length "
                     f"replayed {tasks.validate.fmt(replayed_length)}, "
                     f"vLLM {tasks.validate.fmt(result.mean_acceptance_length)}")
    get_run_logger().info("validation report: %s", result.report_markdown)
    return result
