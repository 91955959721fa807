"""The drift decision: retrain or not, why, and the figures it rests on.

Drift is a drop of the current draft's simulated acceptance length on this run's new samples below
its acceptance on its own validation samples, relative to the latter, by more than the threshold
(`retrain.drift_threshold`). Both figures are measured now, in one process on one device, where the
draft's validation samples are still on disk; else the new figure is compared with the one recorded
when the draft was trained. A changed verifier is drift by definition (the draft predicts hidden states
that are no longer the verifier's): nothing is measured. Without new samples there is nothing to learn.

A figure over a handful of samples moves by more than the threshold by chance alone: where either side
holds fewer than `retrain.min_drift_samples` samples or `retrain.min_drift_tokens` answer tokens, the
figures are too few to decide, nothing is measured, and the run retrains (the safe choice: the gate
still keeps a worse draft from becoming current). The default minimums are an estimate (docs/RETRAINING.md):
per-position acceptance is a proportion over answer tokens, so at 2,000 tokens a side the standard error of
the difference between two sets is about 1.2% of the figure (acceptance near 0.5 at the first position), and
the default 5% threshold about 4 of them (2.4 if the tokens of one answer count as a third as many, being
correlated). bench/narrow_workload.py measures the spread between disjoint sets of one kind at scale.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from tasks.common.config import RetrainSettings
from tasks.common.folder_lock import folder_lock
from tasks.common.progress import ProgressCallback
from tasks.common.workers import run_one_worker
from tasks.drift.check import RESULT_NAME, AcceptanceJob, measure_acceptance
from tasks.drift.samples import answer_tokens, samples_on_disk

log = logging.getLogger(__name__)

DEFAULTS = RetrainSettings()


@dataclass(frozen=True)
class DriftDecision:
    """Whether to retrain, one sentence why, and the figures (None where not measured)."""

    retrain: bool
    reason: str
    new_samples: int
    new_acceptance: float | None  # the current draft's simulated acceptance length on the new samples
    reference_acceptance: float | None  # ... on its own validation samples
    reference_from: str | None  # "measured": now, beside new_acceptance; "recorded": when the draft was trained
    relative_drop: float | None  # (reference - new) / reference; negative where the new samples do better
    threshold: float
    verifier_changed: bool
    measured_on: str | None  # the device of the measurement
    new_tokens: int | None = None  # the new samples' answer tokens (None where not counted)
    reference_samples: int | None = None  # the validation samples measured now (None: a recorded figure)
    reference_tokens: int | None = None  # ... and their answer tokens
    too_few: bool = False  # a side below the minimums: nothing measured, retraining
    min_samples: int = DEFAULTS.min_drift_samples
    min_tokens: int = DEFAULTS.min_drift_tokens

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def measure_drift(draft_dir: str | Path, verifier_path: str | Path, manifest: str | Path, prepared_path: str | Path,
                  new_samples: list[int], *, out_dir: str | Path, reference_manifest: str | Path | None = None,
                  reference_prepared: str | Path | None = None, reference_samples: list[int] | None = None,
                  recorded_reference: float | None = None, threshold: float = DEFAULTS.drift_threshold,
                  min_samples: int = DEFAULTS.min_drift_samples, min_tokens: int = DEFAULTS.min_drift_tokens,
                  verifier_changed: bool = False, ttt_steps: int = 3, total_seq_len: int = 8192,
                  in_process: bool = False, callback: ProgressCallback | None = None) -> DriftDecision:
    """Decide whether to retrain the draft in `draft_dir`.

    `new_samples`: positions in `manifest` of this run's samples the draft never saw
    (samples.new_sample_indices). The reference: the draft's acceptance on `reference_samples` of
    `reference_manifest` / `reference_prepared` (its validation samples, samples.validation_samples)
    measured now where they are all on disk, else `recorded_reference`. Either side with fewer than
    `min_samples` samples or `min_tokens` answer tokens is too few to decide on: retraining, unmeasured (a
    recorded reference's samples are not counted: they are gone). The measurement runs in a worker process
    holding the lock of `out_dir` (where it writes its job and result), in this one with `in_process`.
    """
    undecided = {"new_samples": len(new_samples), "new_acceptance": None, "reference_acceptance": None,
                 "reference_from": None, "relative_drop": None, "threshold": threshold,
                 "verifier_changed": verifier_changed, "measured_on": None, "min_samples": min_samples,
                 "min_tokens": min_tokens}
    if verifier_changed:
        return DriftDecision(True, "the verifier changed (its fingerprint is not the current draft's): drift by "
                             "definition, nothing measured", **undecided)
    if not new_samples:
        return DriftDecision(False, "nothing new: every sample of this run is in the current draft's data", **undecided)

    sample_sets = {"new": {"manifest": str(manifest), "prepared": str(prepared_path), "samples": list(new_samples)}}
    counted = {"new_tokens": answer_tokens(manifest, prepared_path, new_samples)}
    measurable = (reference_manifest is not None and reference_prepared is not None and bool(reference_samples)
                  and samples_on_disk(reference_manifest, reference_prepared, reference_samples))
    if measurable:
        sample_sets["reference"] = {"manifest": str(reference_manifest), "prepared": str(reference_prepared),
                                    "samples": list(reference_samples)}
        counted |= {"reference_samples": len(reference_samples),
                    "reference_tokens": answer_tokens(reference_manifest, reference_prepared, reference_samples)}
    elif recorded_reference is None:
        return DriftDecision(True, "no reference to compare with: the current draft's validation samples are not on "
                             "disk and no acceptance was recorded when it was trained; retraining",
                             **undecided, **counted)
    sides = [(f"the {len(new_samples):,} new samples", len(new_samples), counted["new_tokens"])]
    if measurable:
        sides.append((f"the current draft's {len(reference_samples):,} validation samples", len(reference_samples),
                      counted["reference_tokens"]))
    short = [f"{side} hold {tokens:,} answer tokens" for side, n, tokens in sides
             if n < min_samples or tokens < min_tokens]
    if short:
        return DriftDecision(True, f"too few to decide: {' and '.join(short)}, under the minimum of {min_samples:,} "
                             f"samples and {min_tokens:,} answer tokens a side (retrain.min_drift_samples, "
                             f"retrain.min_drift_tokens), below which chance alone moves the figure by about the "
                             f"threshold; nothing measured, retraining (the safe choice: the regression gate still "
                             f"guards what becomes current)", **undecided, **counted, too_few=True)
    job = AcceptanceJob(str(draft_dir), str(verifier_path), str(out_dir), sample_sets, ttt_steps, total_seq_len)
    measured = _measure(job, in_process, callback)

    new, reference = measured["acceptance"]["new"], measured["acceptance"].get("reference", recorded_reference)
    where = (f"measured now on its {len(reference_samples):,} validation samples, "
             f"{counted['reference_tokens']:,} answer tokens" if measurable
             else "recorded when it was trained (its validation samples are no longer on disk)")
    drop = (reference - new) / reference
    retrain = drop > threshold
    reason = (f"simulated acceptance length {new:.3f} on the {len(new_samples):,} new samples "
              f"({counted['new_tokens']:,} answer tokens) against the current draft's {reference:.3f} ({where}): "
              f"{abs(drop):.1%} {'lower' if drop >= 0 else 'higher'}, {'more than' if retrain else 'within'} the "
              f"threshold of {threshold:.1%}")
    return DriftDecision(**{**undecided, **counted, "new_acceptance": new, "reference_acceptance": reference,
                            "reference_from": "measured" if measurable else "recorded", "relative_drop": drop,
                            "measured_on": measured["device"]}, retrain=retrain, reason=reason)


def _measure(job: AcceptanceJob, in_process: bool, callback: ProgressCallback | None) -> dict:
    with folder_lock(job.out_dir, "drift check") as lock_fd:
        if in_process:
            return measure_acceptance(job, callback=callback)
        result = Path(job.out_dir) / RESULT_NAME
        result.unlink(missing_ok=True)  # an earlier attempt's figures are not this one's
        run_one_worker("tasks.drift.check", job, "drift check", callback, lock_fd)
        return json.loads(result.read_text())
