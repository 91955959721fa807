"""The retraining loop's tasks: whether to train at all (the drift check), where a warm start starts,
and the draft registry's promotion after validation. The work is done by plain functions in
tasks/drift/, tasks/train/warm_start.py and tasks/registry/; this module adds caching, artifacts and
what the flow needs of the current draft.

    the registry's current version -> drift check on this run's new samples -> no retraining, or
    training warm-started from it -> validation -> a new version, made current if the gate holds
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.logging import get_run_logger

from flows.task_support import GPU_STAGE, RETRY_TRANSIENT, ProgressArtifact, cache_key, show_picture, stage_dir, table
from tasks.common.config import PipelineConfig
from tasks.common.errors import PermanentError
from tasks.common.hub import hub_snapshot
from tasks.common.verifier import verifier_fingerprint
from tasks.drift import DriftDecision, measure_drift, new_sample_indices, validation_samples
from tasks.extract.job import ExtractResult
from tasks.prepare.dataset import PreparedData
from tasks.registry.gate import gate
from tasks.registry.layout import Version, current, versions_dir
from tasks.registry.parent import warm_start_source
from tasks.registry.picture import draw_acceptance
from tasks.registry.promotion import promote
from tasks.registry.register import register
from tasks.train.job import TrainResult
from tasks.validate.stage import ValidationResult

log = logging.getLogger(__name__)

DRIFT_CODE = ("tasks.drift.decision", "tasks.drift.check", "tasks.drift.samples", "tasks.train.evaluation",
              "tasks.train.acceptance", "tasks.train.data", "tasks.train.checkpoints", "tasks.train.job",
              "tasks.train.warm_start", "tasks.extract.shards", "tasks.extract.storage_dtype", "tasks.prepare.dataset",
              "tasks.vocab", "tasks.common.content", "tasks.common.journal", "tasks.common.sealed",
              "tasks.common.verifier")


class NotPromoted(PermanentError, RuntimeError):
    """The new draft is registered, but the gate against the current version did not hold."""


def current_draft(config: PipelineConfig) -> Version | None:
    """The registry's current version of this config's draft; None before the first promotion."""
    return current(config.registry_path)


def warm_start(config: PipelineConfig, parent: Version | None) -> tuple[str | None, str | None]:
    """(the draft folder training starts from, the manifest that draft trained on) for `train.init_from`;
    `parent`: the registry's current version as the flow read it at its start."""
    return warm_start_source(config.train.init_from, config.registry_path, parent)


# ---------------------------------------------------------------------------------- drift


def _drift_key(ctx, p) -> str:
    c: PipelineConfig = p["config"]
    return cache_key(ctx, p["extracted"].fingerprint, p["draft"].lineage()["draft_digest"], c.retrain.model_dump(),
                     verifier_fingerprint(c.verifier.path), c.output_dir, code=DRIFT_CODE)


@task(name="drift-check", cache_key_fn=_drift_key, tags=["gpu"], **GPU_STAGE)
def drift_task(config: PipelineConfig, prepared: PreparedData, extracted: ExtractResult, draft: Version) -> DriftDecision:
    """The current draft's simulated acceptance on this run's new samples against its own validation samples."""
    lineage = draft.lineage()
    parent_manifest, parent_prepared = lineage.get("manifest"), lineage.get("prepared")
    parent_train = lineage["config"]["train"]
    known = parent_manifest is not None and Path(parent_manifest).is_file()
    decision = measure_drift(
        draft.draft, config.verifier.path, extracted.manifest, prepared.path,
        new_sample_indices(extracted.manifest, parent_manifest) if known else list(range(extracted.samples)),
        out_dir=stage_dir(config, "drift") / f"{extracted.fingerprint[:16]}-v{draft.number}",
        reference_manifest=parent_manifest if known else None, reference_prepared=parent_prepared,
        reference_samples=validation_samples(parent_manifest, parent_train["val_fraction"],
                                             by_shard=bool(parent_train.get("shuffle_block_shards"))) if known else None,
        recorded_reference=draft.simulated, threshold=config.retrain.drift_threshold,
        min_samples=config.retrain.min_drift_samples, min_tokens=config.retrain.min_drift_tokens,
        verifier_changed=lineage["verifier_fingerprint"] != verifier_fingerprint(config.verifier.path),
        ttt_steps=config.train.ttt_steps, total_seq_len=config.train.total_seq_len,
        callback=ProgressArtifact("drift check"))
    verdict = "retrain" if decision.retrain else "no retraining"
    create_table_artifact(table=table(asdict(decision)), key="drift-check",
                          description=f"drift check against version {draft.number}: {verdict}: {decision.reason}")
    get_run_logger().info("drift check against version %d: %s: %s", draft.number, verdict, decision.reason)
    return decision


# ---------------------------------------------------------------------------------- promote


@dataclass(frozen=True)
class Promotion:
    """The version the run made current (a run whose draft is not promoted fails: NotPromoted)."""

    version: int
    why: str
    registry: str
    serve_command: str


def parent_name(registry: Path, init_from: str | None) -> str | None:
    """'version N' for a draft warm-started from this registry's version N, else the folder it started from."""
    if init_from is not None and Path(init_from).parent.parent == versions_dir(registry).resolve():
        return f"version {Path(init_from).parent.name}"
    return init_from


@task(name="promote", retries=1, retry_delay_seconds=5, **RETRY_TRANSIENT)
def promote_task(config: PipelineConfig, prepared: PreparedData, extracted: ExtractResult, trained: TrainResult,
                 validated: ValidationResult, references: list[str]) -> Promotion:
    """Register the validated draft as a new version (the same draft again is the same version) and make it
    current when the gate against the current version holds; where it does not, the run fails, saying why."""
    registry = config.registry_path
    snapshot = hub_snapshot(config.verifier.path)
    lineage = {
        "verifier": snapshot.repo_id if snapshot else config.verifier.path,
        "verifier_fingerprint": verifier_fingerprint(config.verifier.path),
        "data_fingerprints": {"prepared": prepared.fingerprint, "extraction": extracted.fingerprint},
        "parent": parent_name(registry, trained.init_from), "config": config.model_dump(mode="json"),
        "references": references,
        "manifest": extracted.manifest, "prepared": prepared.path, "draft_fingerprint": trained.fingerprint,
    }
    version = register(registry, trained.draft_path, Path(validated.report_json).parent, lineage)
    now = current(registry)
    if now is not None and now.number == version.number:
        promoted, why = True, f"version {version.number} is already current"
    else:
        promoted, why = gate(json.loads(Path(validated.report_json).read_text()), now,
                             config.validation.max_regression)
        if promoted:
            promote(registry, version.number, why)
    picture = draw_acceptance(registry)
    if picture:
        show_picture(picture, "draft-registry", f"acceptance length across the draft's versions; version "
                     f"{version.number} {'is current' if promoted else 'was not promoted'}")
    create_markdown_artifact(
        key="draft-promotion", description=f"version {version.number}: {'current' if promoted else 'not promoted'}",
        markdown=f"# Draft version {version.number}: {'current' if promoted else 'NOT promoted'}\n\n{why}\n\n"
                 f"Registry: `{registry}`\n\nServe it:\n\n```bash\n{version.serve_command()}\n```\n")
    if not promoted:
        raise NotPromoted(f"version {version.number} is registered in {registry} but not made current: {why}")
    get_run_logger().info("registry %s: version %d is current (%s); serve it with: %s", registry, version.number, why,
                          version.serve_command())
    return Promotion(version.number, why, str(registry), version.serve_command())
