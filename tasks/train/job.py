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


def train_fingerprint(manifest_fp: str, vocab_fp: str, settings: dict) -> str:
    from tasks.common.config import TrainSettings

    parts = {"format": TRAIN_FORMAT, "data": manifest_fp, "vocab": vocab_fp,
             "settings": TrainSettings.model_validate(settings).output_settings()}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()
