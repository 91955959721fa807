"""train.init_from: a warm start from a real SmolLM2 draft, with replay, and the drafts it refuses.

The parent draft trains on the first rows of the ShareGPT sample; the child's data holds those rows
and more (the same conversations tokenized alike: the same content keys), so the child trains on
the new samples and a replay share of the parent's."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_train import AUX, FAST, prepared_extracted_vocab

from tasks.common.content import sample_key
from tasks.extract.shards import ShardReader
from tasks.train.checkpoints import checkpoint_dirs, load_draft
from tasks.train.data import ShardDataset, TrainSchedule, split_indices, warm_start_samples
from tasks.train.job import TrainJob, train_fingerprint
from tasks.train.stage import run_training
from tasks.train.tracking import read_metrics
from tasks.train.warm_start import WarmStartError, check_warm_start
from tasks.vocab import load_vocab

SETTINGS = {**FAST, "epochs": 1, "eval_every": 4, "keep_checkpoints": 10}


@pytest.fixture(scope="module")
def parent(smollm2, sharegpt, tmp_path_factory):
    """A draft trained for a few steps on the first 24 rows: (its data, its result)."""
    data = prepared_extracted_vocab(smollm2, sharegpt, tmp_path_factory.mktemp("parent-data"), 128, 24, 2000)
    result = run_training(train_job(data, smollm2, tmp_path_factory.mktemp("parent") / "train", max_steps=4),
                          data[1].fingerprint, data[2].fingerprint, in_process=True)
    return data, result


@pytest.fixture(scope="module")
def child_data(smollm2, sharegpt, tmp_path_factory):
    """The first 48 rows: the parent's and new ones."""
    return prepared_extracted_vocab(smollm2, sharegpt, tmp_path_factory.mktemp("child-data"), 128, 48, 2000)


def train_job(data, smollm2, out: Path, init_from: str | None = None, parent_manifest: str | None = None,
              **settings) -> TrainJob:
    prepared, extraction, vocab = data
    return TrainJob(extraction.manifest, prepared.path, vocab.path, smollm2, str(out), AUX,
                    settings={**SETTINGS, **settings}, init_from=init_from, parent_manifest=parent_manifest)


def train(job: TrainJob, data):
    return run_training(job, data[1].fingerprint, data[2].fingerprint, in_process=True)


def first_batch_loss(draft: str, smollm2: str, job: TrainJob) -> float:
    """The loss a draft has on the first batch of `job`'s run (its training samples as the run
    chooses them, packed for its first step), as the loop logs it."""
    from speculators.losses import resolve_loss_config

    from tasks.train.data import MODEL_INPUTS, StepBatches, make_loader
    from tasks.train.evaluation import accumulate, reduce_metrics

    s = job.train_settings
    full = ShardDataset(job.manifest, job.prepared_path)
    train_idx, _ = split_indices(full.reader.sample_ids, s.val_fraction)
    chosen, _, _ = warm_start_samples(full, train_idx, job.parent_manifest, s.replay_fraction, s.seed)
    train_set = full.subset(chosen)
    sampler = StepBatches(train_set.lengths(), s.total_seq_len, 1, 0, 1, s.seed, 0)
    hidden = full.reader.manifest["hidden_size"]
    batch = next(iter(make_loader(train_set, sampler, s.total_seq_len, hidden, torch.float32, 0)))
    model = load_draft(draft, torch.device("cpu"), smollm2)
    sums = {}
    with torch.no_grad():
        _, _, metrics = model(**{k: batch[k] for k in MODEL_INPUTS}, ttt_steps=s.ttt_steps,
                              ttt_step_loss_decay=s.ttt_step_loss_decay,
                              loss_config=resolve_loss_config(s.loss, "eager"))
    accumulate(sums, metrics)
    return reduce_metrics(sums, False)["loss"]


def test_a_warm_start_begins_at_the_parent_keeps_its_vocabulary_replays_and_trains_fewer_steps(
        parent, child_data, smollm2, tmp_path, caplog):
    (_, parent_extraction, _), parent_result = parent
    parent_draft = parent_result.draft_path
    warm_job = train_job(child_data, smollm2, tmp_path / "warm", parent_draft, parent_extraction.manifest,
                         eval_every=3)
    with caplog.at_level("INFO"):
        warm = train(warm_job, child_data)

    # the samples: every training sample the parent did not see, and a quarter of those it did
    # (keys here from the token ids the shards hold; the run reads them from the prepared data)
    child_reader, parent_reader = ShardReader(child_data[1].manifest), ShardReader(parent_extraction.manifest)
    parent_keys = {sample_key(parent_reader[i][0]) for i in range(len(parent_reader))}
    train_idx, _ = split_indices(child_reader.sample_ids, FAST["val_fraction"])
    seen = sum(sample_key(child_reader[i][0]) in parent_keys for i in train_idx)
    assert 0 < seen < len(train_idx)
    assert (warm.new_samples, warm.replayed_samples) == (len(train_idx) - seen, round(0.25 * seen))
    # fewer steps than a new draft over the same data (its schedule: every training sample)
    fresh_steps = TrainSchedule([child_reader.lengths[i] for i in train_idx], FAST["total_seq_len"], 1, 1,
                                FAST["seed"], SETTINGS["epochs"]).total_steps
    assert warm.init_from == parent_draft and warm.steps < fresh_steps
    parent_train, _ = split_indices(parent_reader.sample_ids, FAST["val_fraction"])  # a new draft: all of them new
    assert (parent_result.init_from, parent_result.new_samples, parent_result.replayed_samples) == \
        (None, len(parent_train), 0)
    assert (f"warm start from {parent_draft}: {warm.new_samples} new samples, {warm.replayed_samples} replayed "
            f"(train.replay_fraction 0.25 of those the parent trained on); {warm.steps} steps") in caplog.text

    # training starts at the parent's weights: its first step's loss is the parent's on that batch, and
    # the exported draft keeps the parent's vocabulary, not the one the vocab stage chose for this data
    first = next(m["loss"] for m in read_metrics(tmp_path / "warm") if m["split"] == "train")
    assert first == pytest.approx(first_batch_loss(parent_draft, smollm2, warm_job), rel=1e-4)
    mine, theirs = (load_file(Path(d) / "model.safetensors") for d in (warm.draft_path, parent_draft))
    stage_d2t, _ = load_vocab(child_data[2].path, 49152)
    assert not torch.equal(stage_d2t, theirs["d2t"])  # the vocab stage chose other tokens for this data
    assert torch.equal(mine["d2t"], theirs["d2t"]) and torch.equal(mine["t2d"], theirs["t2d"])
    assert not torch.equal(mine["fc.weight"], theirs["fc.weight"])  # and trained on

    # a resume from the run's own checkpoint starts there, not at the parent: the uninterrupted run's log
    killed = tmp_path / "killed"
    shutil.copytree(tmp_path / "warm", killed)
    for checkpoint in checkpoint_dirs(killed)[1:]:
        shutil.rmtree(checkpoint)
    shutil.rmtree(killed / "draft")
    caplog.clear()
    with caplog.at_level("INFO"):
        resumed = train(replace(warm_job, out_dir=str(killed)), child_data)
    assert f"resumed from {checkpoint_dirs(killed)[0]}" in caplog.text
    untimed = [[{k: v for k, v in m.items() if k != "tokens_per_s"} for m in read_metrics(folder)]
               for folder in (killed, tmp_path / "warm")]
    assert untimed[0] == untimed[1] and resumed.simulated_acceptance_length == warm.simulated_acceptance_length


def test_a_warm_starts_fingerprint_covers_the_parents_bytes_and_samples_not_its_path(parent, child_data, tmp_path):
    (_, parent_extraction, _), parent_result = parent
    settings = {**SETTINGS, "init_from": "previous"}
    copy = tmp_path / "copy"
    shutil.copytree(parent_result.draft_path, copy)

    def fingerprint(draft, parent_manifest=parent_extraction.manifest, vocab="v"):
        return train_fingerprint("m", vocab, settings, init_from=str(draft), parent_manifest=parent_manifest)

    base = fingerprint(parent_result.draft_path)
    assert fingerprint(copy) == base  # another path, the same bytes
    assert fingerprint(copy, vocab="w") == base  # the draft's own vocabulary is used, not the vocab stage's
    assert fingerprint(copy, parent_manifest=child_data[1].manifest) != base  # another replay
    assert fingerprint(copy, parent_manifest=None) != base
    weights = bytearray((copy / "model.safetensors").read_bytes())
    weights[-3] ^= 0x01  # a bit of the last tensor's last value
    (copy / "model.safetensors").write_bytes(bytes(weights))
    assert fingerprint(copy) != base
    assert train_fingerprint("m", "v", SETTINGS) != base  # a new draft
    with pytest.raises(ValueError, match="resolve it before building the job"):
        TrainJob("m", "p", "v", "x", "out", AUX, settings=settings)


def test_mismatched_drafts_are_refused_with_one_line_before_any_training_process(parent, child_data, smollm2,
                                                                                    tmp_path):
    """Each refusal from the stage (before its training process starts) and from the check the
    preflight calls; the drafts are the parent with one recorded property changed, or its files damaged."""
    (_, parent_extraction, _), parent_result = parent
    source = Path(parent_result.draft_path)
    config = json.loads((source / "config.json").read_text())

    def changed(**edits) -> dict:
        edited = json.loads(json.dumps(config))
        for path, value in edits.items():
            *parents, key = path.split("__")
            node = edited
            for name in parents:
                node = node[name]
            node[key] = value
        return edited

    cases = {
        "hidden size": (changed(transformer_layer_config__hidden_size=2048), {},
                        "hidden size 2048, the verifier's is 576"),
        "verifier vocabulary": (changed(transformer_layer_config__vocab_size=32000), {},
                                "a verifier vocabulary of 32000 tokens, the verifier's has 49152"),
        "auxiliary layers": (changed(eagle_aux_hidden_state_layer_ids=[3, 15, 27]), {},
                             r"auxiliary layers \[3, 15, 27\], this run's are \[2, 15, 27\]"),
        "another verifier": (changed(speculators_config__verifier__architectures=["Qwen3ForCausalLM"],
                                     speculators_config__verifier__name_or_path="Qwen/Qwen3-0.6B"), {},
                             (r"a draft of another verifier \(Qwen3ForCausalLM, Qwen/Qwen3-0\.6B\), the verifier "
                              f"{re.escape(smollm2)} is a LlamaForCausalLM")),
        "draft settings": (config, {"fc_norm": False}, "fc_norm true, train.fc_norm is false"),
        "truncated weights": (config, {}, "model.safetensors cannot be read"),
        "no draft": (None, {}, "not a draft folder, it lacks config.json"),
    }
    for case, (draft_config, settings, message) in cases.items():
        draft = tmp_path / case.replace(" ", "-")
        shutil.copytree(source, draft)
        if draft_config is None:
            (draft / "config.json").unlink()
        else:
            (draft / "config.json").write_text(json.dumps(draft_config))
        if case == "truncated weights":
            (draft / "model.safetensors").write_bytes((source / "model.safetensors").read_bytes()[:100])
        out = tmp_path / f"train-{draft.name}"
        job = train_job(child_data, smollm2, out, str(draft), parent_extraction.manifest, **settings)
        refusal = f"^init_from {re.escape(str(draft))}: {message}"
        with pytest.raises(WarmStartError, match=refusal) as refused:
            run_training(job, child_data[1].fingerprint, child_data[2].fingerprint)  # in a training process
        assert "\n" not in str(refused.value), case
        assert not out.exists(), case  # refused before the stage made its folder
        with pytest.raises(WarmStartError, match=refusal):
            check_warm_start(draft, smollm2, AUX, 576, 49152, job.train_settings)

    # the parent itself passes, and without a parent manifest every sample counts as new
    assert check_warm_start(source, smollm2, AUX, 576, 49152, train_job(child_data, smollm2, tmp_path / "x",
                            str(source)).train_settings, parent_extraction.manifest)["draft_vocab_size"] == 1024
    full = ShardDataset(child_data[1].manifest, child_data[0].path)
    train_idx, _ = split_indices(full.reader.sample_ids, FAST["val_fraction"])
    assert warm_start_samples(full, train_idx, None, 0.25, 0) == (train_idx, len(train_idx), 0)

    # manifests from before content keys: the keys come from the token ids, and choose the same samples
    def without_keys(manifest: str) -> str:
        content = json.loads(Path(manifest).read_text())
        assert all(shard.pop("sample_keys") for shard in content["shards"])
        old = Path(manifest).with_name(f"before-content-keys-{tmp_path.name}.json")
        old.write_text(json.dumps(content))
        return str(old)

    old_child = ShardDataset(without_keys(child_data[1].manifest), child_data[0].path)
    assert None in old_child.reader.sample_keys
    assert warm_start_samples(old_child, train_idx, without_keys(parent_extraction.manifest), 0.25, 3) == \
        warm_start_samples(full, train_idx, parent_extraction.manifest, 0.25, 3)
