"""Verifier introspection, on the real SmolLM2 folder and on a nested (multimodal-wrapper) config."""

from __future__ import annotations

import json
import shutil

import pytest

from tasks.common.verifier import VerifierError, inspect_verifier, tokenizer_fingerprint, verifier_fingerprint


def test_smollm2(smollm2):
    info = inspect_verifier(smollm2)
    assert (info.architecture, info.model_type) == ("LlamaForCausalLM", "llama")
    assert (info.num_layers, info.hidden_size, info.vocab_size) == (30, 576, 49152)
    assert info.default_aux_layers == [2, 15, 27]
    assert info.aux_layers(None) == [2, 15, 27]
    assert info.weight_files == ("model.safetensors",) and info.weight_bytes > 200e6
    assert info.text_config_key is None


# The shape of Kimi-K2.5's config.json: a multimodal wrapper, the DeepSeek-V3 language model inside.
KIMI_LIKE = {
    "architectures": ["KimiK25ForConditionalGeneration"],
    "model_type": "kimi_k25",
    "vision_config": {"hidden_size": 1152, "num_hidden_layers": 27},
    "text_config": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": 7168,
        "num_hidden_layers": 61,
        "vocab_size": 163840,
        "n_routed_experts": 384,
    },
}


def test_nested_text_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(KIMI_LIKE))
    info = inspect_verifier(tmp_path)
    assert info.text_config_key == "text_config"
    assert info.architecture == "KimiK25ForConditionalGeneration" and info.model_type == "deepseek_v3"
    assert (info.num_layers, info.hidden_size, info.vocab_size) == (61, 7168, 163840)
    assert info.default_aux_layers == [2, 30, 58]


def test_aux_layer_checks(smollm2):
    info = inspect_verifier(smollm2)
    assert info.aux_layers([27, 2, 15]) == [2, 15, 27]
    with pytest.raises(VerifierError, match="exactly 3"):
        info.aux_layers([2, 15])
    with pytest.raises(VerifierError, match="outside the verifier's depth"):
        info.aux_layers([2, 15, 31])


def test_broken_folders_are_named(tmp_path):
    with pytest.raises(VerifierError, match="not found"):
        inspect_verifier(tmp_path / "missing")
    with pytest.raises(VerifierError, match="no config.json"):
        inspect_verifier(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(VerifierError, match="num_hidden_layers, vocab_size"):
        inspect_verifier(tmp_path)


def test_fingerprints_follow_content(smollm2, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(smollm2, copy)
    assert verifier_fingerprint(copy) == verifier_fingerprint(smollm2)
    assert tokenizer_fingerprint(copy) == tokenizer_fingerprint(smollm2)
    template = copy / "chat_template.jinja"
    template.write_text(template.read_text().replace("helpful", "useful"))
    assert tokenizer_fingerprint(copy) != tokenizer_fingerprint(smollm2)
    assert verifier_fingerprint(copy) != verifier_fingerprint(smollm2)
