"""Real drafts for the registry's tests: untrained speculators EAGLE-3 drafts of the demo SmolLM2, made
by speculators' own factories and saved as training saves them, each with its own weights; and the
validation report of each, from the real validation stage (static checks; vLLM not run here)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tasks.common.config import ValidationSettings
from tasks.validate.stage import markdown, validate

AUX = [2, 15, 27]
DRAFTS = 3


def make_draft(verifier: str, out: Path, seed: int) -> Path:
    import torch
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    torch.manual_seed(seed)
    layer = create_transformer_layer_config(verifier, 1, "llama", None, 2048, [0])
    d2t, t2d = build_vocab_mappings_from_distribution({i: 1000 - i for i in range(0, 3000, 3)}, 1024, 49152)
    model = Eagle3DraftModel.from_training_args(
        verifier_config=layer, t2d=t2d, d2t=d2t, verifier_name_or_path=verifier, draft_vocab_size=1024,
        norm_before_residual=True, ttt_steps=3, target_layer_ids=AUX, draft_attn_impl="sdpa")
    model.to(torch.bfloat16).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def drafts(smollm2, tmp_path_factory) -> list[tuple[Path, Path]]:
    """(draft folder, its validation folder) for each of DRAFTS drafts, every one with other weights."""
    root = tmp_path_factory.mktemp("registry-drafts")
    made = []
    for seed in range(DRAFTS):
        draft = make_draft(smollm2, root / f"draft-{seed}", seed)
        validation = root / f"validation-{seed}"
        validate(str(draft), smollm2, AUX, ValidationSettings(live="skip"), validation)
        made.append((draft, validation))
    return made


def with_vllm_measurement(validation: Path, out: Path, accepted_per_position: list[int], drafts: int) -> Path:
    """A copy of a validation folder whose report carries a vLLM measurement made of these counts, in
    the form the validation stage writes (vLLM's counters as tasks/validate/vllm_live.py reads them:
    per-position acceptance = accepted at position i / drafts; mean acceptance length = 1 +
    accepted / drafts)."""
    shutil.copytree(validation, out)
    report = json.loads((out / "report.json").read_text())
    accepted, k = sum(accepted_per_position), len(accepted_per_position)
    report["live"] = {
        "prompts": 8, "num_speculative_tokens": k, "max_new_tokens": 64,
        "draft": {"drafts": drafts, "draft_tokens": drafts * k, "accepted_tokens": accepted,
                  "mean_acceptance_length": 1 + accepted / drafts,
                  "per_position_acceptance": [a / drafts for a in accepted_per_position],
                  "draft_acceptance_rate": accepted / (drafts * k)},
        "identical_outputs": "8/8", "first_divergence_at": [], "device": "cpu",
        "tokens_per_s": {"verifier_alone": 50.0, "with_draft": 60.0}, "speedup": 1.2,
    }
    (out / "report.json").write_text(json.dumps(report, indent=1))
    (out / "report.md").write_text(markdown(report))
    return out
