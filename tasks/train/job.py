"""What a training run is: its job (everything a training process needs, JSON-serializable for
worker processes), its result and its fingerprint.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

TRAIN_FORMAT = "train-v3"  # v2: each epoch its own packed step count; v3: state loadable with weights_only, log window


@dataclass(frozen=True)
class TrainJob:
    """Everything a training process needs, JSON-serializable for torchrun workers."""

    manifest: str
    prepared_path: str
    vocab_path: str
    verifier_path: str
    out_dir: str
    aux_layers: list[int]
    trust_remote_code: bool = False
    settings: dict = field(default_factory=dict)  # TrainSettings fields
    # warm start (tasks/train/warm_start.py): the draft folder train.init_from resolves to ('previous':
    # the registry's current draft), and the extraction manifest that draft trained on, when known
    init_from: str | None = None
    parent_manifest: str | None = None

    def __post_init__(self):
        if self.settings.get("init_from") is not None and self.init_from is None:
            raise ValueError(f"train.init_from is {self.settings['init_from']!r} but the job names no draft folder "
                             "(TrainJob.init_from): resolve it before building the job")

    @property
    def train_settings(self):
        from tasks.common.config import TrainSettings

        return TrainSettings.model_validate(self.settings)


@dataclass(frozen=True)
class TrainResult:
    draft_path: str
    fingerprint: str
    steps: int
    best_step: int
    simulated_acceptance_length: float
    val_metrics: dict
    trained_tokens: int  # real (unpadded) tokens of this process group's optimizer steps, this attempt
    steady_tokens_per_s: float | None  # training steps only: no compilation window, validation or checkpoints
    wall_s: float  # the whole attempt: start-up, data, compilation, training, validation, export
    target_check: dict | None = None  # tasks/train/targets.py: the targets against the verifier's own logits
    stream: dict | None = None  # extract.mode 'stream': what the producers did, their disk high-water mark
    init_from: str | None = None  # the draft this one started from (warm start), None for a new draft
    new_samples: int = 0  # training samples the parent draft did not train on (all of them for a new draft)
    replayed_samples: int = 0  # training samples the parent did train on, trained on again (train.replay_fraction)


def train_fingerprint(manifest_fp: str, vocab_fp: str, settings: dict, init_from: str | None = None,
                      parent_manifest: str | None = None) -> str:
    """The draft's inputs and settings. A warm start's (`init_from`, a draft folder) covers the
    parent draft's bytes instead of its path, and the samples of `parent_manifest` (they decide
    the replay); its vocabulary is the parent's, so the vocab stage's does not enter."""
    from tasks.common.config import TrainSettings

    train_settings = TrainSettings.model_validate(settings)
    output = train_settings.output_settings()
    parts = {"format": TRAIN_FORMAT, "data": manifest_fp, "vocab": vocab_fp, "settings": output}
    if init_from is None and train_settings.init_from is not None:
        raise ValueError(f"train.init_from {train_settings.init_from!r}: the fingerprint needs the draft folder it "
                         "resolves to (init_from)")
    if init_from is not None:
        from tasks.train.warm_start import draft_fingerprint, manifest_samples_fingerprint

        output.update(init_from=draft_fingerprint(init_from), replay_fraction=train_settings.replay_fraction)
        parts.update(vocab=None, parent_samples=manifest_samples_fingerprint(parent_manifest)
                     if parent_manifest else None)
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()
