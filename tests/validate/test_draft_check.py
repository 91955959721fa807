"""Static draft validation: a good speculators draft passes; each known way to break one is named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tasks.common.verifier import inspect_verifier
from tasks.validate.draft_check import check_draft

AUX = [2, 15, 27]


@pytest.fixture(scope="module")
def good_draft(smollm2, tmp_path_factory) -> Path:
    """An (untrained) draft made by speculators' own factories, saved as training saves it."""
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    layer = create_transformer_layer_config(smollm2, 1, "llama", None, 2048, [0])
    d2t, t2d = build_vocab_mappings_from_distribution({i: 1000 - i for i in range(0, 3000, 3)}, 1024, 49152)
    model = Eagle3DraftModel.from_training_args(
        verifier_config=layer, t2d=t2d, d2t=d2t, verifier_name_or_path=smollm2, draft_vocab_size=1024,
        norm_before_residual=True, ttt_steps=3, target_layer_ids=AUX, draft_attn_impl="sdpa")
    out = tmp_path_factory.mktemp("draft")
    model.to(torch.bfloat16).save_pretrained(out)
    return out


def broken(good: Path, tmp_path: Path, config_edit=None, weights_edit=None) -> Path:
    out = tmp_path / "broken"
    shutil.copytree(good, out)
    if config_edit:
        config = json.loads((out / "config.json").read_text())
        config_edit(config)
        (out / "config.json").write_text(json.dumps(config))
    if weights_edit:
        weights = load_file(str(out / "model.safetensors"))
        weights = weights_edit(weights) or weights
        save_file(weights, str(out / "model.safetensors"))
    return out


def failed(report) -> set[str]:
    return {c.name for c in report.checks if not c.ok}


def test_good_draft_passes(good_draft, smollm2):
    report = check_draft(good_draft, inspect_verifier(smollm2), AUX)
    assert report.ok, report.errors
    assert len(report.checks) > 15


def four_layers(c):
    c["eagle_aux_hidden_state_layer_ids"] = [2, 15, 27, 30]


def prefix(w):
    return {f"model.{k}": v for k, v in w.items()}


def no_d2t(w):
    w.pop("d2t")


def short_lm_head(w):
    w["lm_head.weight"] = w["lm_head.weight"][:1000].clone()


def bad_offsets(w):
    w["d2t"] = w["d2t"] + 10**6


def wider_draft(c):
    c["transformer_layer_config"]["hidden_size"] = 640


def qwen2_layer(c):
    c["transformer_layer_config"]["model_type"] = "qwen2"


@pytest.mark.parametrize(
    ("config_edit", "weights_edit", "named"),
    [
        (four_layers, None, {"three_aux_layers_in_depth", "aux_layers_match_training_data"}),
        (None, no_d2t, {"d2t_present"}),
        (None, prefix, {"no_model_prefix"}),
        (lambda c: c.update(model_type="llama"), None, {"no_top_level_model_type"}),
        (None, short_lm_head, {"shape:lm_head.weight"}),
        (wider_draft, None, {"hidden_size_matches_verifier", "shape:fc.weight"}),
        (lambda c: c.pop("norm_before_residual"), None, {"norm_before_residual_explicit"}),
        (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[3, 15, 27]), None, {"aux_layers_match_training_data"}),
        (lambda c: c.update(speculators_model_type="eagle"), None, {"speculators_format"}),
        (qwen2_layer, None, {"draft_architecture_supported"}),
        (None, bad_offsets, {"d2t_int64_offsets_in_range"}),
        (lambda c: c["speculators_config"]["verifier"].update(name_or_path="/nowhere"), None, {"verifier_resolvable"}),
        (None, lambda w: {k: v.float() if v.is_floating_point() else v for k, v in w.items()}, {"weights_bf16_or_fp16"}),
    ],
    ids=["4-aux-layers", "missing-d2t", "model-prefix", "top-level-model_type", "lm_head-rows", "hidden-640",
         "implicit-norm_before_residual", "other-aux-layers", "not-eagle3", "unsupported-layer-type",
         "d2t-out-of-range", "verifier-missing", "float32-weights"],
)
def test_each_broken_checkpoint_is_named(good_draft, smollm2, tmp_path, config_edit, weights_edit, named):
    report = check_draft(broken(good_draft, tmp_path, config_edit, weights_edit), inspect_verifier(smollm2), AUX)
    assert not report.ok
    assert named <= failed(report), report.errors
    assert all(detail for detail in report.errors)


def test_eagle31_flags_the_installed_vllm_ignores_are_reported(good_draft, smollm2, tmp_path):
    draft = broken(good_draft, tmp_path, lambda c: c.update(norm_output=True))
    report = check_draft(draft, inspect_verifier(smollm2), AUX, vllm_flags={"norm_output": False})
    assert any("norm_output" in w for w in report.warnings)
    assert not check_draft(draft, inspect_verifier(smollm2), AUX, vllm_flags={"norm_output": True}).warnings
