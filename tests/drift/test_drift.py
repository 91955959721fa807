"""The drift check on a real draft: trained on SmolLM2's hidden states of ShareGPT conversations, then
measured on conversations it never saw, of the same kind (held-out ShareGPT) and of another kind
(answers of random tokens)."""

from __future__ import annotations

import json
import random
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest

from tasks.common.content import sample_key
from tasks.drift import (
    DriftDecision,
    measure_drift,
    new_sample_indices,
    validation_samples,
)
from tasks.drift.check import (
    RESULT_NAME,
    AcceptanceJob,
    device_name,
    measure_acceptance,
)
from tasks.drift.samples import answer_tokens
from tasks.extract.shards import ShardReader, read_manifest
from tasks.prepare.dataset import load_prepared
from tasks.train.job import TrainJob
from tasks.train.stage import run_training
from tests.train.test_train import AUX, FAST, prepared_extracted_vocab

pytestmark = pytest.mark.system  # trains a draft for minutes: `make test` runs it, `make test-fast` does not

ROWS, NEW_ROWS, MAX_SEQ_LEN = 160, 60, 128  # the draft's conversations; held-out ones after them in the file
SETTINGS = {**FAST, "val_fraction": 0.5, "epochs": 8, "eval_every": 20}  # half held out: enough to measure on
TTT_STEPS = 3  # speculators' default, which FAST keeps


@dataclass(frozen=True)
class Parent:
    """The current draft and what it was trained on."""

    prepared: object
    extraction: object
    trained: object
    validation: list[int]


@pytest.fixture(scope="module")
def parent(smollm2, sharegpt, tmp_path_factory) -> Parent:
    root = tmp_path_factory.mktemp("drift-parent")
    prepared, extraction, vocab = prepared_extracted_vocab(smollm2, sharegpt, root, MAX_SEQ_LEN, ROWS, 2000)
    job = TrainJob(extraction.manifest, prepared.path, vocab.path, smollm2, str(root / "train"), AUX, settings=SETTINGS)
    trained = run_training(job, extraction.fingerprint, vocab.fingerprint, in_process=True)
    return Parent(prepared, extraction, trained, validation_samples(extraction.manifest, SETTINGS["val_fraction"]))


@pytest.fixture(scope="module")
def same_kind(smollm2, sharegpt, tmp_path_factory):
    """The draft's conversations and the next NEW_ROWS of the same file: a later run's data."""
    prepared, extraction, _ = prepared_extracted_vocab(smollm2, sharegpt, tmp_path_factory.mktemp("drift-same"),
                                                       MAX_SEQ_LEN, ROWS + NEW_ROWS, 2000)
    return prepared, extraction


@pytest.fixture(scope="module")
def other_kind(smollm2, tokenizer, tmp_path_factory):
    """Conversations whose answers are strings of random words of the verifier's vocabulary."""
    root = tmp_path_factory.mktemp("drift-other")
    words = sorted(w for w in tokenizer.get_vocab() if w.isalpha() and len(w) > 2)
    rng = random.Random(0)
    source = root / "random_answers.jsonl"
    source.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"Write down item {i} of the list."},
        {"role": "assistant", "content": " ".join(rng.choice(words) for _ in range(60))}]}) + "\n"
        for i in range(NEW_ROWS)))
    prepared, extraction, _ = prepared_extracted_vocab(smollm2, str(source), root, MAX_SEQ_LEN, None, 2000)
    return prepared, extraction


@pytest.fixture(scope="module")
def threshold(parent, smollm2, tmp_path_factory) -> float:
    """A threshold chance alone does not cross at these sample sizes: 3x the root mean square of the
    relative difference of the draft's acceptance between two disjoint halves of its own validation
    samples, over four random halvings. A half holds fewer samples than either set the checks compare
    (the new ones, all the validation ones), so its difference is the larger one."""
    val, sets = parent.validation, {}
    for seed in range(4):
        shuffled = random.Random(seed).sample(val, len(val))
        for half, samples in (("a", shuffled[::2]), ("b", shuffled[1::2])):
            sets[f"{seed}{half}"] = {"manifest": parent.extraction.manifest, "prepared": parent.prepared.path,
                                     "samples": samples}
    job = AcceptanceJob(parent.trained.draft_path, smollm2, str(tmp_path_factory.mktemp("drift-halves")), sets,
                        TTT_STEPS, FAST["total_seq_len"])
    acceptance = measure_acceptance(job)["acceptance"]
    differences = [(acceptance[f"{s}a"] - acceptance[f"{s}b"]) / statistics.mean([acceptance[f"{s}a"],
                                                                                    acceptance[f"{s}b"]])
                   for s in range(4)]
    return 3 * statistics.mean(d * d for d in differences) ** 0.5


def check(parent, smollm2, data, new_samples, out_dir, **options) -> DriftDecision:
    """The decision as the flow makes it. These sets are small (the `threshold` fixture says what chance does at
    their sizes): the minimum counts are 1 unless a test sets them (they have a test of their own)."""
    prepared, extraction = data
    options = {"min_samples": 1, "min_tokens": 1, **options}
    return measure_drift(parent.trained.draft_path, smollm2, extraction.manifest, prepared.path, new_samples,
                         out_dir=out_dir, reference_manifest=parent.extraction.manifest,
                         reference_prepared=parent.prepared.path, reference_samples=parent.validation,
                         recorded_reference=parent.trained.simulated_acceptance_length, ttt_steps=TTT_STEPS,
                         total_seq_len=FAST["total_seq_len"], **options)


def test_new_samples_are_those_whose_content_the_draft_never_saw(parent, same_kind, tmp_path):
    prepared, extraction = same_kind
    new = new_sample_indices(extraction.manifest, parent.extraction.manifest)
    ids = ShardReader(extraction.manifest).sample_ids
    seen = set(ShardReader(parent.extraction.manifest).sample_ids)  # rows "file:index": the same file, both runs
    assert 0 < len(new) < len(ids) and sorted(new) == [i for i, s in enumerate(ids) if s not in seen]
    assert new_sample_indices(parent.extraction.manifest, extraction.manifest) == []  # the draft's are all in the run

    # the keys are those of the prepared tokens; a manifest written before content keys gets them from its shards
    rows = {row["sample_id"]: row["input_ids"] for row in load_prepared(prepared.path)}
    manifest = read_manifest(extraction.manifest)
    listed = [key for shard in manifest["shards"] for key in shard["sample_keys"]]
    assert listed == [sample_key(rows[s]) for s in ids]
    for shard in manifest["shards"]:
        del shard["sample_keys"]
    legacy = Path(extraction.manifest).with_name("manifest-without-keys.json")
    legacy.write_text(json.dumps(manifest))
    try:
        assert new_sample_indices(legacy, parent.extraction.manifest) == new
    finally:
        legacy.unlink()


def test_same_kind_of_data_is_no_drift_and_another_kind_is(parent, same_kind, other_kind, threshold, smollm2,
                                                          tmp_path):
    new = new_sample_indices(same_kind[1].manifest, parent.extraction.manifest)
    same = check(parent, smollm2, same_kind, new, tmp_path / "same", threshold=threshold, in_process=True)
    assert not same.retrain and same.reference_from == "measured" and same.measured_on == device_name(), same
    assert same.relative_drop <= threshold and same.new_samples == len(new)
    # the draft's validation samples measured now give what training recorded for its best checkpoint
    assert same.reference_acceptance == pytest.approx(parent.trained.simulated_acceptance_length, abs=0.03)

    # in a worker process, as the flow runs it
    other = check(parent, smollm2, other_kind, new_sample_indices(other_kind[1].manifest, parent.extraction.manifest),
                  tmp_path / "other", threshold=threshold)
    assert other.retrain and other.relative_drop > threshold and other.measured_on == device_name(), other
    assert other.new_samples == len(ShardReader(other_kind[1].manifest))  # none of them is in the draft's data
    assert other.reference_acceptance == pytest.approx(same.reference_acceptance, abs=2e-3)  # one way, one device
    assert json.loads((tmp_path / "other" / RESULT_NAME).read_text())["acceptance"]["new"] == other.new_acceptance
    assert DriftDecision(**json.loads(other.to_json())) == other
    assert f"{other.relative_drop:.1%} lower, more than the threshold" in other.reason


def test_without_its_validation_samples_the_draft_is_compared_with_its_recorded_figure(parent, same_kind, smollm2,
                                                                                      threshold, tmp_path):
    prepared, extraction = same_kind
    new = new_sample_indices(extraction.manifest, parent.extraction.manifest)
    gone = measure_drift(parent.trained.draft_path, smollm2, extraction.manifest, prepared.path, new,
                         out_dir=tmp_path, reference_manifest=tmp_path / "collected" / "manifest.json",
                         reference_prepared=parent.prepared.path, reference_samples=parent.validation,
                         recorded_reference=parent.trained.simulated_acceptance_length, threshold=threshold,
                         min_samples=1, min_tokens=1, ttt_steps=TTT_STEPS, total_seq_len=FAST["total_seq_len"],
                         in_process=True)
    assert gone.reference_from == "recorded" and "recorded when it was trained" in gone.reason
    assert gone.reference_acceptance == parent.trained.simulated_acceptance_length and gone.new_samples == len(new)
    assert gone.relative_drop == pytest.approx((gone.reference_acceptance - gone.new_acceptance)
                                               / gone.reference_acceptance)
    assert gone.retrain == (gone.relative_drop > threshold)


def test_a_changed_verifier_is_drift_without_measuring(parent, other_kind, smollm2, tmp_path):
    decision = check(parent, smollm2, other_kind, [0, 1], tmp_path / "check", threshold=0.05, verifier_changed=True)
    assert decision.retrain and decision.verifier_changed and "verifier changed" in decision.reason
    assert decision.new_acceptance is None and decision.measured_on is None
    assert not (tmp_path / "check").exists()  # no process was started, nothing loaded


def test_no_new_samples_is_no_retraining(parent, same_kind, smollm2, tmp_path):
    new = new_sample_indices(parent.extraction.manifest, same_kind[1].manifest)
    decision = check(parent, smollm2, (parent.prepared, parent.extraction), new, tmp_path / "check", threshold=0.05)
    assert new == [] and not decision.retrain and decision.reason.startswith("nothing new")
    assert decision.new_samples == 0 and not (tmp_path / "check").exists()
    assert asdict(decision)["new_acceptance"] is None


def test_too_few_samples_or_tokens_retrain_unmeasured_saying_so(parent, same_kind, smollm2, tmp_path):
    prepared, extraction = same_kind
    new = new_sample_indices(extraction.manifest, parent.extraction.manifest)
    # answer tokens are the loss masks' positions of the samples, counted from the prepared rows by sample id
    masks = {row["sample_id"]: sum(row["loss_mask"]) for row in load_prepared(prepared.path)}
    ids = ShardReader(extraction.manifest).sample_ids
    assert answer_tokens(extraction.manifest, prepared.path, new[:3]) == sum(masks[ids[i]] for i in new[:3]) > 0

    few_new = check(parent, smollm2, same_kind, new[:3], tmp_path / "few-new", threshold=0.05, min_samples=8,
                    min_tokens=100)
    assert few_new.retrain and few_new.too_few and few_new.reason.startswith("too few to decide: the 3 new samples")
    assert few_new.new_samples == 3 and few_new.new_tokens == sum(masks[ids[i]] for i in new[:3])
    assert few_new.reference_samples == len(parent.validation) and few_new.reference_tokens > 0
    assert "validation samples hold" not in few_new.reason and "retraining (the safe choice" in few_new.reason
    assert few_new.new_acceptance is None and few_new.measured_on is None
    assert not (tmp_path / "few-new").exists()  # decided before any process started: nothing loaded or measured

    # the reference side: the draft's validation samples, too few tokens here
    few_tokens = check(parent, smollm2, same_kind, new, tmp_path / "few-tokens", threshold=0.05, min_samples=2,
                       min_tokens=few_new.reference_tokens + 1)
    assert few_tokens.too_few and few_tokens.retrain and few_tokens.reference_acceptance is None
    assert (f"the current draft's {len(parent.validation)} validation samples hold {few_tokens.reference_tokens:,} "
            "answer tokens") in few_tokens.reason
    assert DriftDecision(**json.loads(few_tokens.to_json())) == few_tokens  # the artifact's and the result's figures

    enough = check(parent, smollm2, same_kind, new, tmp_path / "enough", threshold=0.05, min_samples=2, min_tokens=100,
                   in_process=True)
    assert not enough.too_few and enough.new_acceptance is not None and enough.new_tokens >= 100
    assert f"({enough.new_tokens:,} answer tokens)" in enough.reason
