"""The stages as Prefect tasks: content-keyed caching, retries, tags and artifacts.

The work is done by plain functions in tasks/; this module only adds orchestration (what the
tasks share, retries, cache keys and artifacts, is in flows/task_support.py).

Cache keys are the *content* fingerprints of a stage's inputs (data bytes, tokenizer, verifier
identity, upstream results, settings) plus the source of the code that does the work, never a
run id or a path string: re-running with the same inputs is a cache hit in any later run, and
an edited dataset re-runs prepare and everything downstream. Results are small dataclasses
(paths, fingerprints, counts), never tensors.

GPU-heavy stages (extract, train, validate) run their work in subprocesses (tasks/extract/stage.py,
tasks/train/stage.py and tasks/validate/vllm_live.py launch them), so a CUDA abort, OOM kill or
segfault fails the task, which retries and resumes from the shards or checkpoints on disk, instead
of crashing the flow. Only such transient failures are retried: a deterministic one
(tasks/common/errors.py), raised here or in a worker process, fails the task at once with the
worker's exception type and message.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.logging import get_run_logger

from flows.retraining import warm_start
from flows.task_support import GPU_STAGE, RETRY_TRANSIENT, ProgressArtifact, cache_key, show_picture, stage_dir, table
from tasks.common import plots
from tasks.common.config import PipelineConfig
from tasks.common.verifier import inspect_verifier, verifier_fingerprint
from tasks.extract.shards import quarantined_shards
from tasks.extract.stage import ExtractJob, ExtractResult, run_extraction
from tasks.prepare.dataset import PreparedData, read_report
from tasks.prepare.regenerate import RegenerateJob, regenerate, regeneration_job
from tasks.prepare.stage import prepare, prepare_fingerprint
from tasks.prepare.synthesize import SynthesizeJob, synthesis_job, synthesize
from tasks.registry.layout import Version
from tasks.scrub import journal_repairs_pending, training_repairs_pending
from tasks.train.acceptance import replayed_per_position
from tasks.train.job import TrainJob, TrainResult, train_fingerprint
from tasks.train.stage import run_training
from tasks.train.targets import TargetCheck
from tasks.train.tracking import read_metrics
from tasks.validate.stage import ValidationResult, fmt, validate
from tasks.vocab import VocabResult, build_vocab, vocab_damage

# The source of every tasks module a stage runs is part of its cache key (editing one re-runs the
# stage), but for plumbing that cannot change what a stage writes: it reports, locks, launches
# workers, reads settings (their values are in the key), asks what is installed or names the cache
# folder. The executor (local or Ray) is no part of a key: both write the same outputs.
# tests/pipeline/test_code_layout.py checks these lists against what each stage imports.
PLUMBING = ("tasks.common.config", "tasks.common.errors", "tasks.common.folder_lock", "tasks.common.progress",
            "tasks.common.vllm_support", "tasks.common.workers", "tasks.common.demo_assets", "tasks.common.hub")
PREPARE_CODE = ("tasks.prepare.stage", "tasks.prepare.dataset", "tasks.prepare.chat_data",
                "tasks.prepare.chat_template", "tasks.prepare.samples", "tasks.prepare.regenerate",
                "tasks.prepare.answer_store", "tasks.prepare.synthesize", "tasks.prepare.generators",
                "tasks.prepare.decode_attention", "tasks.common.journal", "tasks.common.verifier")
EXTRACT_CODE = ("tasks.extract.stage", "tasks.extract.job", "tasks.extract.plan", "tasks.extract.writer",
                "tasks.extract.content_index", "tasks.common.content", "tasks.extract.shards", "tasks.extract.stream", "tasks.extract.storage_dtype",
                "tasks.extract.backends.hf", "tasks.extract.backends.vllm", "tasks.extract.backends.vllm_connector",
                "tasks.prepare.dataset", "tasks.common.journal", "tasks.common.sealed", "tasks.common.verifier")
VOCAB_CODE = ("tasks.vocab", "tasks.prepare.dataset", "tasks.common.sealed", "tasks.common.verifier")
# a streamed extraction runs inside the train stage (tasks/extract/stream.py): its code is training's too
TRAIN_CODE = ("tasks.train.stage", "tasks.train.job", "tasks.train.loop", "tasks.train.data", "tasks.train.model",
              "tasks.train.evaluation", "tasks.train.acceptance", "tasks.train.on_policy", "tasks.train.checkpoints",
              "tasks.train.step_profile", "tasks.train.tracking", "tasks.train.targets", "tasks.train.stream",
              "tasks.train.compile_cache", "tasks.train.warm_start", "tasks.common.content", "tasks.extract.stream", "tasks.extract.job", "tasks.extract.plan",
              "tasks.extract.content_index", "tasks.extract.writer", "tasks.extract.shards", "tasks.extract.storage_dtype", "tasks.extract.backends.hf",
              "tasks.extract.backends.vllm", "tasks.extract.backends.vllm_connector", "tasks.prepare.dataset",
              "tasks.vocab", "tasks.common.journal", "tasks.common.sealed", "tasks.common.verifier")
VALIDATE_CODE = ("tasks.validate.stage", "tasks.validate.draft_check", "tasks.validate.vllm_live",
                 "tasks.validate.serve_line", "tasks.common.verifier")


# ---------------------------------------------------------------------------------- prepare


def _prepare_key(ctx, p) -> str | None:
    c: PipelineConfig = p["config"]
    if journal_repairs_pending(c.output_dir):  # `verify` set damaged answers or prompts aside: no cache hit
        return None  # regeneration and synthesis redo what is missing (Prefect caches nothing for None)
    regenerate = ({**c.data.regenerate.output_settings(), "verifier": verifier_fingerprint(c.verifier.path),
                   "synthesize": c.data.synthesize.output_settings() if c.data.synthesize.prompts else None}
                  if c.data.regenerate.enabled else None)
    fp = prepare_fingerprint(c.verifier.path, c.data.sources, c.data.max_rows, c.data.max_seq_len, regenerate,
                             c.data.supervise_end_of_turn)
    return cache_key(ctx, fp, c.output_dir, code=PREPARE_CODE)


@task(name="prepare", cache_key_fn=_prepare_key, retries=1, retry_delay_seconds=5, **RETRY_TRANSIENT)
def prepare_task(config: PipelineConfig) -> PreparedData:
    sources, max_rows = config.data.sources, config.data.max_rows
    synthesis = synthesis_job(config)  # prompts the verifier writes, when asked for
    synthesized = _synthesize(config, synthesis) if synthesis else None
    regeneration = regeneration_job(config, synthesized)  # the verifier's own answers, when enabled
    if regeneration is not None:
        sources, max_rows = [str(_regenerate(config, regeneration))], None
    result = prepare(config.verifier.path, sources, config.output_dir, max_seq_len=config.data.max_seq_len,
                     max_rows=max_rows, supervise_end_of_turn=config.data.supervise_end_of_turn,
                     trust_remote_code=config.verifier.trust_remote_code, workers=config.data.prepare_workers)
    if regeneration is not None:  # what its rows came from, and how much of it the verifier answered in this run
        regenerated = json.loads((Path(regeneration.out_dir) / "report.json").read_text())
        result = replace(result, made_from=(regeneration.out_dir, str(regeneration.store),
                                            *([str(synthesized.parent)] if synthesized else [])),
                         conversations_answered=regenerated["answered_now"], conversations_reused=regenerated["reused"])
    report = read_report(result.path)
    create_table_artifact(
        table=table({k: v for k, v in report.items() if k != "dropped_examples"}), key="prepare-report",
        description=f"prepare: {result.rows} rows kept of {report['rows_read']}, "
                    f"{result.supervised_tokens:,} supervised tokens",
    )
    get_run_logger().info("prepared data: %s", result.path)
    return result


def _synthesize(config: PipelineConfig, job: SynthesizeJob) -> Path:
    progress = ProgressArtifact("prompt synthesis")
    if config.cluster.executor == "ray":  # one rank on the cluster (flows/ray_stages.py)
        from flows.ray_stages import synthesize_on_ray

        return synthesize_on_ray(config.cluster, job, callback=progress)
    return synthesize(job, callback=progress)


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


def _extract_key(ctx, p) -> str | None:
    c: PipelineConfig = p["config"]
    if quarantined_shards(stage_dir(c, "hidden_states")):  # training found shards damaged: no cache hit
        return None  # hides them; the extraction redoes what is missing (Prefect caches nothing for None)
    streamed = ("stream",) if c.extract.mode == "stream" else ()  # its result is a promise of shards, not shards
    return cache_key(ctx, p["prepared"].fingerprint, verifier_fingerprint(c.verifier.path), c.verifier.dtype,
                     c.extract.output_settings(), c.output_dir, *streamed, code=EXTRACT_CODE)


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
        png = plots.extraction_rate(planned_rate[0], result.steady_tokens_per_s, result.wall_tokens_per_s,
                                          manifest.with_name(f"{manifest.stem}-rate.png"))
        show_picture(png, "extraction-rate", "extraction rate, tokens/s: planned "
                     f"{planned_rate[0] or 0:,.0f}, measured {result.steady_tokens_per_s or 0:,.0f} (steady state), "
                     f"{result.wall_tokens_per_s or 0:,.0f} (wall)")
    return result


# ---------------------------------------------------------------------------------- vocab


def _vocab_key(ctx, p) -> str | None:
    c: PipelineConfig = p["config"]
    if vocab_damage(c.output_dir, p["prepared"].fingerprint, c.vocab.draft_vocab_size, c.verifier.path):
        return None  # its files changed or went missing since they were written: built again
    return cache_key(ctx, p["prepared"].fingerprint, c.vocab.draft_vocab_size,
                     inspect_verifier(c.verifier.path).vocab_size, c.output_dir, code=VOCAB_CODE)


@task(name="vocab", cache_key_fn=_vocab_key, retries=1, retry_delay_seconds=5, **RETRY_TRANSIENT)
def vocab_task(config: PipelineConfig, prepared: PreparedData) -> VocabResult:
    result = build_vocab(prepared.path, prepared.fingerprint, config.verifier.path, config.output_dir,
                         config.vocab.draft_vocab_size)
    create_table_artifact(table=table(result.__dict__), key="draft-vocabulary",
                          description=f"{result.draft_vocab_size} draft tokens cover {100 * result.coverage:.2f}% "
                                      "of supervised tokens")
    return result


# ---------------------------------------------------------------------------------- train


def _train_job(config: PipelineConfig, prepared: PreparedData, extracted: ExtractResult, vocab: VocabResult,
               parent: Version | None) -> tuple[TrainJob, str]:
    """The job and its fingerprint; a warm start's (train.init_from) covers the parent draft's bytes."""
    init_from, parent_manifest = warm_start(config, parent)
    settings = config.train.model_copy(update={"init_from": init_from}).model_dump()
    fp = train_fingerprint(extracted.fingerprint, vocab.fingerprint, settings, init_from, parent_manifest)
    return TrainJob(extracted.manifest, prepared.path, vocab.path, config.verifier.path,
                    str(stage_dir(config, "train") / fp[:16]), extracted.layers[:3],
                    config.verifier.trust_remote_code, settings, init_from, parent_manifest), fp


def _train_key(ctx, p) -> str | None:
    c: PipelineConfig = p["config"]
    job, fp = _train_job(c, p["prepared"], p["extracted"], p["vocab"], p["parent"])
    # `verify` set a damaged checkpoint or draft aside, or the draft is not as sealed: no cache hit; training
    # resumes from the newest intact checkpoint and exports the draft again
    if training_repairs_pending(job.out_dir):
        return None
    return cache_key(ctx, fp, c.output_dir, code=TRAIN_CODE)


@task(name="train", cache_key_fn=_train_key, tags=["gpu"], **GPU_STAGE)
def train_task(config: PipelineConfig, prepared: PreparedData, extracted: ExtractResult,
               vocab: VocabResult, parent: Version | None = None) -> TrainResult:
    """`parent`: the registry's current draft, which `train.init_from: previous` starts from."""
    job, _ = _train_job(config, prepared, extracted, vocab, parent)
    progress = ProgressArtifact("draft training")
    # a streamed extraction runs beside training (tasks/extract/stream.py), with its own progress
    streaming = ProgressArtifact("hidden-state extraction, streamed") if extracted.streamed else None
    if config.cluster.executor == "ray":  # across cluster.train_nodes nodes, through Ray Train (flows/ray_stages.py)
        from flows.ray_stages import train_on_ray

        result = train_on_ray(config.cluster, job, extracted.fingerprint, vocab.fingerprint, callback=progress,
                              stream_callback=streaming)
    else:
        result = run_training(job, extracted.fingerprint, vocab.fingerprint, callback=progress,
                              stream_callback=streaming)
    metrics = read_metrics(job.out_dir)
    val = [m for m in metrics if m["split"] == "val"]
    create_table_artifact(
        table=[{k: round(v, 4) if isinstance(v, float) else v for k, v in m.items() if k != "split"} for m in val],
        key="training-validation",
        description=f"validation during training; best step {result.best_step}: simulated acceptance length "
                    f"{result.simulated_acceptance_length:.3f} (k={config.train.ttt_steps}); "
                    + (TargetCheck(**result.target_check).describe() if result.target_check else ""),
    )
    png = plots.training_curves(metrics, Path(job.out_dir) / "curves.png", result.best_step if val else None)
    show_picture(png, "training-curves", f"training loss and simulated acceptance length against step; best step "
                 f"{result.best_step}: {result.simulated_acceptance_length:.3f}")
    get_run_logger().info("draft: %s", result.draft_path)
    return result


# ---------------------------------------------------------------------------------- validate


def _validation_dir(config: PipelineConfig, trained: TrainResult) -> Path:
    return stage_dir(config, "validation") / trained.fingerprint[:16]


def _validate_key(ctx, p) -> str | None:
    c: PipelineConfig = p["config"]
    key = cache_key(ctx, p["trained"].fingerprint, c.validation.model_dump(), c.output_dir, code=VALIDATE_CODE)
    if ctx.result_store.exists(key) and not (_validation_dir(c, p["trained"]) / "report.json").is_file():
        # the cached result names a report gone since (the summary and the registry read it): validated again,
        # without a key, so the record stays and names the report written anew
        return None
    return key


@task(name="validate", cache_key_fn=_validate_key, tags=["gpu"], **GPU_STAGE)
def validate_task(config: PipelineConfig, trained: TrainResult, extracted: ExtractResult) -> ValidationResult:
    out = _validation_dir(config, trained)
    result = validate(trained.draft_path, config.verifier.path, extracted.layers[:3], config.validation, out,
                      trust_remote_code=config.verifier.trust_remote_code,
                      simulated_acceptance_length=trained.simulated_acceptance_length,
                      replayed_acceptance_length=trained.val_metrics.get("replayed_acceptance_length"))
    create_markdown_artifact(markdown=Path(result.report_markdown).read_text(), key="draft-validation",
                             description="static checks and vLLM-measured acceptance")
    # greedy decoding replayed on held-out samples counts what vLLM counts (train.val_fraction=0: none)
    replayed = replayed_per_position(trained.val_metrics, config.train.ttt_steps)
    replayed_length = trained.val_metrics.get("replayed_acceptance_length")
    if replayed or result.per_position_acceptance:
        png = plots.acceptance_per_position(replayed, result.per_position_acceptance, out / "acceptance.png",
                                                  replayed_length=replayed_length,
                                                  measured_length=result.mean_acceptance_length)
        show_picture(png, "draft-acceptance-per-position", "acceptance per draft position; acceptance length "
                     f"replayed {fmt(replayed_length)}, "
                     f"vLLM {fmt(result.mean_acceptance_length)}")
    get_run_logger().info("validation report: %s", result.report_markdown)
    return result
