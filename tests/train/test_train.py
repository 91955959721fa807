"""vocab and train on real SmolLM2 shards of real ShareGPT samples."""

from __future__ import annotations

import gzip
import json
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pytest
import torch
from pictures import colour_pixels

from tasks.common.errors import is_deterministic
from tasks.common.journal import DiskWriteError
from tasks.common.plots import TRAIN, VAL, training_curves
from tasks.common.sealed import damage as damage_of
from tasks.common.sealed import file_digest, seal
from tasks.extract.shards import ShardError
from tasks.extract.stage import ExtractJob, run_extraction
from tasks.prepare.stage import prepare
from tasks.train.acceptance import replay_speculative_decoding, simulated_acceptance_length
from tasks.train.checkpoints import checkpoint_dirs
from tasks.train.data import TrainDataError
from tasks.train.evaluation import evaluate_draft
from tasks.train.job import TrainJob
from tasks.train.stage import run_training
from tasks.train.tracking import read_metrics
from tasks.vocab import build_vocab

AUX = [2, 15, 27]
FAST = {"total_seq_len": 384, "lr": 2e-3, "log_every": 1, "eval_every": 4, "val_fraction": 0.15, "seed": 3}


def prepared_extracted_vocab(smollm2, sharegpt, root, max_seq_len: int, max_rows: int, shard_tokens: int):
    prepared = prepare(smollm2, [sharegpt], root, max_seq_len=max_seq_len, max_rows=max_rows)
    extraction = run_extraction(ExtractJob(prepared.path, prepared.fingerprint, smollm2, str(root / "hs"),
                                           settings={"batch_tokens": 2048, "shard_tokens": shard_tokens}),
                                in_process=True)
    vocab = build_vocab(prepared.path, prepared.fingerprint, smollm2, root, draft_vocab_size=1024)
    return prepared, extraction, vocab


@pytest.fixture(scope="module")
def data(smollm2, sharegpt, tmp_path_factory):
    return prepared_extracted_vocab(smollm2, sharegpt, tmp_path_factory.mktemp("train-data"), 128, 40, 2000)


def job(data, smollm2, out: Path, **settings) -> TrainJob:
    prepared, extraction, vocab = data
    return TrainJob(extraction.manifest, prepared.path, vocab.path, smollm2, str(out), AUX,
                    settings={**FAST, **settings})


def train(data, smollm2, out, **settings):
    _, extraction, vocab = data
    return run_training(job(data, smollm2, out, **settings), extraction.fingerprint, vocab.fingerprint, in_process=True)


def tensorboard_scalars(out: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series of a training folder's TensorBoard event files, as TensorBoard reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0}).Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.mark.system  # trains to overfit: `make test` runs it, `make test-fast` does not
def test_short_run_overfits_and_reloads_in_speculators(data, smollm2, tmp_path):
    from speculators import SpeculatorModel

    result = train(data, smollm2, tmp_path, epochs=12, eval_every=10, val_fraction=0.0, profile_steps=3)
    assert result.steps > 10 and result.best_step == result.steps  # no validation set: the latest is exported
    profile = json.loads((tmp_path / "profile.json").read_text())  # train.profile_steps: where a step's time goes
    assert profile["steps"] == 3 and set(profile["phases_per_step"]) == {"data", "to_device", "forward", "backward",
                                                                           "optimizer"}
    assert profile["step_ms"] >= profile["phases_per_step"]["forward"]["cpu_ms"] > 0  # a step's wall holds its forward
    assert profile["device_busy_ms"] is None and "Self CPU" in (tmp_path / "profile.txt").read_text()
    with gzip.open(tmp_path / "profile_trace.json.gz", "rt") as trace:  # the timeline, for Perfetto
        assert any(e.get("name") == "forward" for e in json.load(trace)["traceEvents"])
    assert not [m for m in read_metrics(tmp_path) if m["split"] == "val"]
    train_log = [m for m in read_metrics(tmp_path) if m["split"] == "train"]
    first, last = train_log[0], train_log[-1]
    assert last["full_acc_0"] > first["full_acc_0"] + 0.25, (first["full_acc_0"], last["full_acc_0"])
    assert last["loss"] < 0.7 * first["loss"]
    draft = SpeculatorModel.from_pretrained(result.draft_path)
    config = json.loads((Path(result.draft_path) / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["eagle_aux_hidden_state_layer_ids"] == AUX
    assert config["draft_vocab_size"] == 1024 and "norm_before_residual" in config
    assert draft.d2t.numel() == 1024 and next(draft.parameters()).dtype == torch.bfloat16


@pytest.mark.system  # trains with many validations: `make test` runs it, `make test-fast` does not
def test_best_checkpoint_is_chosen_by_simulated_acceptance(data, smollm2, tmp_path):
    result = train(data, smollm2, tmp_path, epochs=6)
    val_log = [m for m in read_metrics(tmp_path) if m["split"] == "val"]
    assert len(val_log) >= 3
    best = max(val_log, key=lambda m: m["simulated_acceptance_length"])
    assert result.best_step == best["step"]
    assert result.simulated_acceptance_length == pytest.approx(best["simulated_acceptance_length"], abs=1e-4)
    assert best["simulated_acceptance_length"] == pytest.approx(simulated_acceptance_length(best, 3))
    assert (tmp_path / "checkpoints" / f"step-{result.best_step:08d}" / "COMPLETE").is_file()
    # replaying is not bounded by chaining (it is lower where difficulty clusters, not always): only by k
    assert 1.0 <= best["replayed_acceptance_length"] <= 1 + 3

    # the exported draft, loaded in speculators' format, scores on the held-out samples what training
    # logged for its step (bf16 export against float32 training). Its files lack the embeddings, which
    # must come from the verifier: left to chance they hold whatever the memory held, a freed copy in
    # a process that loaded the verifier before (this one), garbage in a fresh one (checked there)
    from tasks.extract.shards import ShardReader
    from tasks.train.data import split_indices

    fresh = subprocess.run([sys.executable, "-c", (
        "import sys, torch; from safetensors.torch import load_file; from tasks.train.checkpoints import load_draft; "
        f"v = load_file({str(Path(smollm2) / 'model.safetensors')!r})['model.embed_tokens.weight'].float(); "
        f"sys.exit(0 if torch.equal(load_draft({result.draft_path!r}, torch.device('cpu')).embed_tokens.weight, v) "
        "else 3)")], capture_output=True, text=True)
    assert fresh.returncode == 0, fresh.stderr[-2000:]

    _, held_out = split_indices(ShardReader(data[1].manifest).sample_ids, FAST["val_fraction"])
    reloaded = evaluate_draft(result.draft_path, data[1].manifest, data[0].path, samples=held_out,
                              total_seq_len=FAST["total_seq_len"])
    for key in ("simulated_acceptance_length", "replayed_acceptance_length"):
        got = simulated_acceptance_length(reloaded, 3) if key.startswith("simulated") else reloaded[key]
        assert got == pytest.approx(best[key], abs=0.03), key

    board = tensorboard_scalars(tmp_path)  # TensorBoard holds what metrics.jsonl holds, step for step
    train_log = [m for m in read_metrics(tmp_path) if m["split"] == "train"]
    for split, log in (("train", train_log), ("val", val_log)):
        keys = {"loss", "simulated_acceptance_length", "full_acc_0", "full_acc_2", "cond_acc_1"}
        for key in keys | ({"lr", "tokens_per_s"} if split == "train" else set()):
            got = board[f"{split}/{key}"]
            assert [step for step, _ in got] == [m["step"] for m in log], (split, key)
            assert [v for _, v in got] == pytest.approx([m[key] for m in log], rel=1e-6), (split, key)
    curves = training_curves(read_metrics(tmp_path), tmp_path / "curves.png", result.best_step)
    assert colour_pixels(curves, TRAIN) > 1000 and colour_pixels(curves, VAL) > 500  # both splits drawn


def test_replayed_decoding_accepts_leading_correct_tokens_and_restarts_after_them():
    """Greedy speculative decoding replayed over one answer of 8 tokens (k=2): where the draft is
    right everywhere each step takes k+1 tokens; where it is never right each step takes 1; a draft
    never counts a token of the next document."""
    k, n = 2, 8
    targets = torch.arange(n).unsqueeze(0)
    answer = torch.ones(1, n, dtype=torch.bool)
    one_doc = torch.zeros(1, n, dtype=torch.long)
    right = [torch.cat([targets[:, j:], torch.full((1, j), -1)], dim=1) for j in range(k)]
    wrong = [torch.full((1, n), -1) for _ in range(k)]

    def replay(draft, docs=one_doc):
        counts = {key: v.item() for key, v in replay_speculative_decoding(draft, targets, answer, docs).items()}
        return counts["replayed_acceptance_length_sum"], counts["replayed_acceptance_length_total"], \
            [counts[f"replayed_acceptance_{i}_sum"] for i in range(k)]

    assert replay(right) == (9, 3, [3, 3])  # starts at 0, 3, 6; the last draft runs past the answer
    assert replay(wrong) == (8, 8, [0, 0])
    two_docs = (torch.arange(n) >= 4).long().unsqueeze(0)  # documents of 4 tokens each
    # starts at 0, 3 (its second token would be the next document's: one accepted), 5
    assert replay(right, two_docs) == (8, 3, [3, 2])


def test_simulated_acceptance_length_chains_conditional_accuracies():
    assert simulated_acceptance_length({"cond_acc_0": 0.5, "cond_acc_1": 0.5, "cond_acc_2": 0.5}, 3) == 1.875
    assert simulated_acceptance_length({"cond_acc_0": 1.0, "cond_acc_1": 1.0}, 2) == 3.0


@pytest.fixture(scope="module")
def varied_data(smollm2, sharegpt, tmp_path_factory):
    """Samples of varied lengths (up to 384 tokens; most ShareGPT conversations are longer and are cut
    there, so enough rows that a few shorter ones vary the packing from epoch to epoch)."""
    return prepared_extracted_vocab(smollm2, sharegpt, tmp_path_factory.mktemp("varied-data"), 384, 48, 3000)


@pytest.mark.system  # three trainings: `make test` runs it, `make test-fast` does not
def test_kill_then_resume_across_uneven_epochs_reproduces_the_uninterrupted_run(varied_data, smollm2, tmp_path):
    """Epochs pack into different step counts; a run killed in its first epoch resumes across the
    epoch boundary into a second epoch of fewer steps and ends where the uninterrupted run ends, step
    for step (two epochs: a third crossed the same kind of boundary again, for 40 s more of the suite)."""
    from tasks.extract.shards import ShardReader
    from tasks.train.data import StepBatches, split_indices

    epochs, total_seq_len, eval_every = 2, 512, 8
    reader = ShardReader(varied_data[1].manifest)
    train_idx, _ = split_indices(reader.sample_ids, FAST["val_fraction"])
    lengths = [reader.lengths[i] for i in train_idx]

    def steps(seed: int) -> list[int]:  # each epoch's packing, straight from the sampler
        return [StepBatches(lengths, total_seq_len, 1, 0, 1, seed, e).steps for e in range(epochs)]

    seed = next(s for s in range(50) if min(steps(s)[1:]) < steps(s)[0])  # a later epoch packs fewer steps
    per_epoch = steps(seed)
    settings = {"epochs": epochs, "total_seq_len": total_seq_len, "seed": seed, "eval_every": eval_every}
    assert per_epoch[0] > eval_every  # the first checkpoint lies inside the first epoch

    events = []
    reference = tmp_path / "reference"
    done = run_training(job(varied_data, smollm2, reference, **settings), varied_data[1].fingerprint,
                        varied_data[2].fingerprint, in_process=True, callback=events.append)
    assert done.steps == sum(per_epoch)
    assert events[-1].done == events[-1].total == sum(per_epoch)  # the progress total is exact
    train_log = [m for m in read_metrics(reference) if m["split"] == "train"]
    assert [sum(m["epoch"] == e for m in train_log) for e in range(epochs)] == per_epoch  # log_every=1

    killed = tmp_path / "killed"
    killed.mkdir()
    job_file = killed / "job.json"
    job_file.write_text(json.dumps(asdict(job(varied_data, smollm2, killed, **settings))))
    proc = subprocess.Popen([sys.executable, "-m", "tasks.train.loop", "--job", str(job_file)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not checkpoint_dirs(killed) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    resumed_from = int(checkpoint_dirs(killed)[-1].name.removeprefix("step-"))
    assert resumed_from < per_epoch[0], "the kill came too late to resume across an epoch boundary"
    result = run_training(job(varied_data, smollm2, killed, **settings), varied_data[1].fingerprint,
                          varied_data[2].fingerprint, in_process=True)
    got, want = read_metrics(killed), read_metrics(reference)
    assert [(m["split"], m["step"], m["epoch"] if "epoch" in m else None) for m in got] == \
        [(m["split"], m["step"], m["epoch"] if "epoch" in m else None) for m in want]
    for a, b in zip(got, want, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (resumed_from, a["step"])
    # TensorBoard hides what the killed process logged past its checkpoint (purge_step): one value per step
    board, reference_board = tensorboard_scalars(killed), tensorboard_scalars(reference)
    assert len(list((killed / "tensorboard").glob("events.out.tfevents.*"))) == 2  # killed run's file + resumed
    for tag in ("train/loss", "train/simulated_acceptance_length", "val/simulated_acceptance_length"):
        assert [step for step, _ in board[tag]] == [step for step, _ in reference_board[tag]], tag
        assert [v for _, v in board[tag]] == pytest.approx([v for _, v in reference_board[tag]], rel=1e-5), tag
    assert result.steps == done.steps and result.best_step == done.best_step
    assert result.simulated_acceptance_length == pytest.approx(done.simulated_acceptance_length, abs=1e-6)


def test_block_shuffle_reads_a_block_of_shards_at_a_time_takes_every_sample_and_resumes_mid_block(
        varied_data, smollm2, tmp_path):
    """`train.shuffle_block_shards`: each step's samples come from one block of consecutive shards,
    each block's steps come together once an epoch, in another block order each epoch; every sample
    is trained once an epoch; DDP ranks read the same block at the same step; a resumed epoch
    continues with the very batches it would have had; a run trains to the schedule's step count.
    Validation holds out whole shards (a stream keeps them while it releases the rest)."""
    from tasks.train.data import ShardDataset, StepBatches, TrainSchedule, shard_blocks, split_shards

    prepared, extraction, _ = varied_data
    full = ShardDataset(extraction.manifest, prepared.path)
    train_idx, val_idx = split_shards(full.reader, FAST["val_fraction"])
    held_out = {full.reader.index[i][0] for i in val_idx}
    assert held_out and all(full.reader.index[i][0] not in held_out for i in train_idx)
    assert sorted(train_idx + val_idx) == list(range(len(full)))
    train_set = full.subset(train_idx)
    blocks = shard_blocks(train_set, 1)  # a shard per block: the data has few

    def block_of(position: int) -> int:
        return train_set.reader.index[train_set.indices[position]][0]

    assert len(blocks) >= 3 and sorted(p for b in blocks for p in b) == list(range(len(train_set)))
    lengths, orders = train_set.lengths(), []
    for epoch in range(3):
        steps = StepBatches(lengths, 512, 1, 0, 1, 0, epoch, blocks=blocks)
        assert sorted(p for batch in steps for p in batch) == list(range(len(train_set)))  # each sample once
        read = [{block_of(p) for p in batch} for batch in steps]
        assert all(len(b) == 1 for b in read), read  # a step reads one block
        per_step = [b.pop() for b in read]
        order = [b for i, b in enumerate(per_step) if i == 0 or per_step[i - 1] != b]
        assert sorted(order) == sorted({block_of(b[0]) for b in blocks})  # each block's steps together, once
        orders.append(order)
        ranks = [StepBatches(lengths, 512, 2, r, 1, 0, epoch, blocks=blocks) for r in range(2)]
        assert [{block_of(p) for p in a} == {block_of(p) for p in b} for a, b in zip(*ranks, strict=True)] == \
            [True] * ranks[0].steps
        middle = steps.steps // 2
        assert StepBatches(lengths, 512, 1, 0, 1, 0, epoch, middle, blocks).batches == steps.batches[middle:]
    assert len({tuple(o) for o in orders}) > 1  # the blocks in another order each epoch

    schedule = TrainSchedule(lengths, 384, 1, 1, FAST["seed"], 1, blocks=blocks)
    done = train(varied_data, smollm2, tmp_path, epochs=1, shuffle_block_shards=1, eval_every=1000)
    assert done.steps == schedule.total_steps == sum(schedule.per_epoch)


def test_two_process_ddp_matches_one_process_with_the_same_global_batch(data, smollm2, tmp_path):
    _, extraction, vocab = data
    settings = {"epochs": 2, "eval_every": 100, "on_policy_steps": 3}  # the last 3 steps: on-policy refinement
    single = train(data, smollm2, tmp_path / "one", grad_accum_steps=2, **settings)
    ddp_job = job(data, smollm2, tmp_path / "two", nproc=2, **settings)
    ddp = run_training(ddp_job, extraction.fingerprint, vocab.fingerprint)
    a, b = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert [(m["split"], m["step"]) for m in a] == [(m["split"], m["step"]) for m in b] and len(a) >= 4
    for x, y in zip(a, b, strict=True):
        if x["split"] == "train":  # the same global batches: the same losses, step by step
            assert x["loss"] == pytest.approx(y["loss"], rel=1e-3), x["step"]
            assert x.get("drafted_states", 0) == pytest.approx(y.get("drafted_states", 0), rel=1e-6), x["step"]
        else:  # validation is split over the ranks: token-counted accuracies agree, batch-mean losses need not
            assert x["simulated_acceptance_length"] == pytest.approx(y["simulated_acceptance_length"], abs=1e-3)
    assert ddp.steps == single.steps and sum("drafted_states" in m for m in a) == 3


def test_mismatched_inputs_fail_before_training(data, smollm2, tmp_path):
    prepared, extraction, vocab = data
    other_verifier = tmp_path / "other"
    shutil.copytree(smollm2, other_verifier)
    config = json.loads((other_verifier / "config.json").read_text())
    (other_verifier / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-6}))
    bad = replace(job(data, smollm2, tmp_path / "a"), verifier_path=str(other_verifier))
    with pytest.raises(TrainDataError, match="another verifier"):
        run_training(bad, extraction.fingerprint, vocab.fingerprint)
    with pytest.raises(TrainDataError, match="layers"):
        run_training(replace(bad, verifier_path=smollm2, aux_layers=[3, 15, 27]), "x", "y")
    small_vocab = tmp_path / "vocab"
    small_vocab.mkdir()
    np.save(small_vocab / "d2t.npy", np.zeros(4, np.int64))
    np.save(small_vocab / "t2d.npy", np.eye(1, 32000, dtype=bool).repeat(4, 0).any(0) | (np.arange(32000) < 4))
    with pytest.raises(ValueError, match="another verifier"):
        run_training(replace(bad, verifier_path=smollm2, vocab_path=str(small_vocab)), "x", "y")
    manifest = json.loads(Path(extraction.manifest).read_text())
    empty = tmp_path / "empty-manifest.json"
    empty.write_text(json.dumps({**manifest, "samples": 0, "shards": []}))
    with pytest.raises(TrainDataError, match="no samples"):
        run_training(replace(bad, verifier_path=smollm2, manifest=str(empty)), "x", "y")
    assert not (tmp_path / "a").exists()


def damage_cases(shard: Path, other: Path) -> dict:
    """Ways a shard file goes bad, each as a function of the folder's shard."""
    def flip(path: Path) -> None:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x10  # one byte in the middle of the hidden states
        path.write_bytes(bytes(data))

    return {
        "flipped byte": (flip, "is damaged \\(checksum mismatch\\)"),
        "truncated": (lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]), "is unreadable"),
        "deleted": (lambda p: p.unlink(), "is missing"),
        "another shard swapped in": (lambda p: shutil.copyfile(other, p), "is a shard of other inputs"),
    }


def test_training_refuses_damaged_or_foreign_shards_naming_the_file(data, smollm2, tmp_path):
    prepared, extraction, vocab = data
    source = Path(extraction.manifest).parent
    shards = sorted(source.glob("shard-*.safetensors"))
    for case, (damage, message) in damage_cases(shards[1], shards[0]).items():
        folder = tmp_path / case.replace(" ", "-")
        shutil.copytree(source, folder / "hs")
        damage(folder / "hs" / shards[1].name)
        bad = replace(job(data, smollm2, folder / "train"),
                      manifest=str(folder / "hs" / Path(extraction.manifest).name))
        with pytest.raises(ShardError, match=f"{folder / 'hs' / shards[1].name} .*{message}"):
            run_training(bad, extraction.fingerprint, vocab.fingerprint, in_process=True)
        assert not (folder / "train" / "checkpoints").exists(), case  # refused before the first step


def test_a_training_state_that_would_run_code_is_never_loaded(data, smollm2, tmp_path, caplog):
    """Swapped in with its checksum forged too, so that only the weights-only load stands in the way:
    the checkpoint counts as damaged and training starts over."""
    settings = {"max_steps": 2, "eval_every": 2}
    train(data, smollm2, tmp_path, **settings)
    checkpoint = checkpoint_dirs(tmp_path)[-1]
    state = checkpoint / "training_state.pt"
    marker = tmp_path / "code-ran"
    torch.save({"step": RunsCode(f"import pathlib; pathlib.Path({str(marker)!r}).touch()")}, state)
    complete = json.loads((checkpoint / "COMPLETE").read_text())
    complete["files"][state.name] = {"bytes": state.stat().st_size, "xxh3_128": file_digest(state)}
    (checkpoint / "COMPLETE").write_text(json.dumps(complete))
    shutil.rmtree(tmp_path / "draft")
    with caplog.at_level("WARNING"):
        result = train(data, smollm2, tmp_path, **settings)
    assert not marker.exists()
    assert f"{state} holds objects other than tensors and plain values" in caplog.text
    assert result.steps == 2 and (tmp_path / "draft" / "model.safetensors").is_file()


def test_a_damaged_checkpoint_is_skipped_for_the_one_before_it(data, smollm2, tmp_path, caplog):
    """A kill after the checkpoint of step 4, whose training state was then cut short: the resume
    starts from step 2's and ends with the uninterrupted run's draft and log. (Changed bytes that
    keep the size are found by the checksum: test_a_sealed_folder_tells_each_kind_of_damage.)"""
    settings = {"max_steps": 6, "eval_every": 2, "log_every": 1, "keep_checkpoints": 10}
    reference = tmp_path / "reference"
    train(data, smollm2, reference, **settings)
    killed = tmp_path / "killed"
    shutil.copytree(reference, killed)
    for checkpoint in checkpoint_dirs(killed)[2:]:
        shutil.rmtree(checkpoint)
    shutil.rmtree(killed / "draft")
    latest = checkpoint_dirs(killed)[-1]
    broken = latest / "training_state.pt"
    broken.write_bytes(broken.read_bytes()[:1000])
    with caplog.at_level("INFO"):
        train(data, smollm2, killed, **settings)
    assert f"checkpoint {latest.name} is damaged: {broken}" in caplog.text
    assert "resumed from" in caplog.text and "step-00000002" in caplog.text
    timing = ("tokens_per_s",)
    assert [{k: v for k, v in m.items() if k not in timing} for m in read_metrics(killed)] == \
        [{k: v for k, v in m.items() if k not in timing} for m in read_metrics(reference)]
    drafts = [folder / "draft" / "model.safetensors" for folder in (killed, reference)]
    assert drafts[0].read_bytes() == drafts[1].read_bytes()
    assert damage_of(checkpoint_dirs(killed)[1], "COMPLETE") is None  # the next save at step 4 replaced it


def test_a_full_disk_while_checkpointing_names_the_checkpoint_and_the_free_space(data, smollm2, tmp_path):
    """The training folder on a 24 MB tmpfs: the first checkpoint (~115 MB in float32) cannot fit."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        with pytest.raises(DiskWriteError, match=r"writing .*/checkpoints/step-00000002 failed: .*No space left on "
                                                 r"device.* MB free on that disk\)") as failure:
            train(data, smollm2, disk / "train", max_steps=2, eval_every=2)
        assert is_deterministic(failure.value)  # not retried: the same write fails the same way
        assert not list((disk / "train" / "checkpoints").iterdir())  # the partial one removed, its space freed
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_sealed_folder_tells_each_kind_of_damage(tmp_path):
    folder = tmp_path / ".tmp-x"
    folder.mkdir()
    (folder / "a.bin").write_bytes(bytes(range(256)) * 64)
    sealed = seal(folder, tmp_path / "x", "COMPLETE", {"step": 1})
    assert damage_of(sealed, "COMPLETE") is None and json.loads((sealed / "COMPLETE").read_text())["step"] == 1
    blob = (sealed / "a.bin").read_bytes()
    cases = {"cut short": (blob[:-1], "has 16383 bytes, 16384 were written"),
             "changed": (blob[:-1] + b"x", "does not match the checksum written with it")}
    for case, (content, message) in cases.items():
        (sealed / "a.bin").write_bytes(content)
        assert message in damage_of(sealed, "COMPLETE"), case
    (sealed / "a.bin").unlink()
    assert "a.bin is missing" in damage_of(sealed, "COMPLETE")
    (sealed / "COMPLETE").write_text("{")
    assert "its COMPLETE cannot be read" in damage_of(sealed, "COMPLETE")


class RunsCode:
    """Unpickling this runs `code` (what a swapped-in training_state.pt could do)."""

    def __init__(self, code: str):
        self.code = code

    def __reduce__(self):
        return exec, (self.code,)


@pytest.mark.system  # trains and resumes: `make test` runs it, `make test-fast` does not
def test_on_policy_refinement_trains_the_replayed_drafts_states_and_resumes_exactly(data, smollm2, tmp_path):
    """train.on_policy_steps: the last steps weigh each (start, step) pair by whether replayed greedy
    decoding with the current draft runs it. Checked against the draft's own logits (read off its
    lm_head) and speculators' per-position loss, against the replay's counts, and for an exact resume
    of a run killed inside the refinement: a log window (log_every) open across its checkpoint and a
    record the kill cut off, the resumed run's metrics log is still the uninterrupted run's."""
    from speculators.losses import resolve_loss_config

    from tasks.extract.shards import read_manifest
    from tasks.train.checkpoints import load_draft
    from tasks.train.data import MODEL_INPUTS, ShardDataset, StepBatches, make_loader
    from tasks.train.job import train_fingerprint
    from tasks.train.on_policy import on_policy_loss_config, weigh_drafted_states

    k = 3  # train.ttt_steps' default
    settings = {"max_steps": 24, "on_policy_steps": 10, "eval_every": 8, "log_every": 3, "keep_checkpoints": 10}
    reference = tmp_path / "reference"
    result = train(data, smollm2, reference, **settings, profile_steps=3)
    assert not (reference / "profile.json").exists()  # too short to profile: none written, not a partial one
    train_log = [m for m in read_metrics(reference) if m["split"] == "train"]
    # the windows that hold refinement steps (15-24) report the share of pairs they trained on
    assert [m["step"] for m in train_log if "drafted_states" in m] == [15, 18, 21, 24]
    assert all(0 < m["drafted_states"] < 1 for m in train_log if m["step"] > 14)
    assert [m["step"] for m in read_metrics(reference) if m["split"] == "val"] == [8, 16, 24]

    # one batch, the trained draft: each step's loss covers exactly the pairs replayed decoding runs
    prepared, extraction, _ = data
    dataset = ShardDataset(extraction.manifest, prepared.path)
    batch = next(iter(make_loader(dataset, StepBatches(dataset.lengths(), 4096, 1, 0, 1, 0, 0), 4096,
                                  read_manifest(extraction.manifest)["hidden_size"], torch.float32, 0)))
    inputs = {name: batch[name] for name in MODEL_INPUTS}
    model = load_draft(result.draft_path, torch.device("cpu"), smollm2)
    base = resolve_loss_config("kl_div", "eager")
    config = on_policy_loss_config(base)
    counts = weigh_drafted_states(model, inputs, k, config)
    weights = next(iter(config.values()))[0].weights
    logits = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: logits.append(out.detach()))
    with torch.no_grad():
        draft_tokens, _, metrics = model(**inputs, ttt_steps=k, ttt_step_loss_decay=1.0, loss_config=config)
    hook.remove()
    targets = model.verifier_lm_head(model.verifier_norm(inputs["verifier_last_hidden_states"]))
    mask = inputs["loss_mask"].float()
    n = mask.shape[1]
    replay = replay_speculative_decoding(draft_tokens, targets.argmax(-1), inputs["loss_mask"], inputs["document_ids"])
    # one draft per verification step, each running up to its first rejected step (a draft fully accepted: k steps)
    assert weights[0].sum() == replay["replayed_acceptance_length_total"]
    assert weights.sum() == replay["replayed_acceptance_length_sum"] - replay[f"replayed_acceptance_{k - 1}_sum"]
    assert counts["drafted_states_sum"] == weights.sum() and counts["drafted_states_total"] == mask.sum() * k
    assert 0 < weights[k - 1].sum() < weights[1].sum() < weights[0].sum()
    kl = base["kl_div"][0]
    for j in range(k):
        per_position = kl(logits[j][:, : n - j], targets[:, j:]) * mask[:, j:] * weights[j, : n - j]
        assert metrics[f"loss_{j}_sum"] == pytest.approx(float(per_position.sum() / mask[:, j:].sum()), rel=1e-4)

    # as on a GPU, where speculators compiles the forward: traced by dynamo (aot_eager: no code generation
    # here), each step's loss is the eager one, with the weights read afresh for each batch (not baked in)
    compiled = torch.compile(model, backend="aot_eager")
    for scale in (1.0, 0.5):
        next(iter(config.values()))[0].weights = weights * scale
        with torch.no_grad():
            traced, eager = (forward(**inputs, ttt_steps=k, ttt_step_loss_decay=1.0, loss_config=config)[2]
                             for forward in (compiled, model))
        for j in range(k):
            assert traced[f"loss_{j}_sum"] == pytest.approx(float(eager[f"loss_{j}_sum"]), rel=1e-5)
            assert eager[f"loss_{j}_sum"] == pytest.approx(scale * float(metrics[f"loss_{j}_sum"]), rel=1e-5)

    # killed inside the refinement (the checkpoint of step 16 kept, later ones lost): the same run again
    killed = tmp_path / "killed"
    shutil.copytree(reference, killed)
    for checkpoint in checkpoint_dirs(killed)[2:]:
        shutil.rmtree(checkpoint)
    shutil.rmtree(killed / "draft")
    with (killed / "metrics.jsonl").open("a") as f:
        f.write('{"split": "train", "step": 24, "lo')  # a record the kill cut off
    resumed = train(data, smollm2, killed, **settings)
    untimed = [{name: v for name, v in m.items() if name != "tokens_per_s"} for m in read_metrics(killed)]
    assert untimed == [{name: v for name, v in m.items() if name != "tokens_per_s"} for m in read_metrics(reference)]
    assert resumed.simulated_acceptance_length == result.simulated_acceptance_length

    with pytest.raises(TrainDataError, match="on_policy_steps=24 leaves no supervised step"):
        train(data, smollm2, tmp_path / "all-on-policy", **{**settings, "on_policy_steps": 24})

    # a setting of the draft: in the cache key when set, and absent when 0, so earlier runs keep their keys
    assert train_fingerprint("m", "v", {**FAST, "on_policy_steps": 0}) == train_fingerprint("m", "v", FAST)
    assert train_fingerprint("m", "v", {**FAST, "on_policy_steps": 10}) != train_fingerprint("m", "v", FAST)
