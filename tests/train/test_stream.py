"""extract.mode 'stream': the verifier (SmolLM2, in producer processes) extracts while the draft trains,
within a window of shards, and the draft is the offline run's, tensor for tensor, kills included."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import psutil
import pytest
from safetensors.torch import load_file

from tasks.extract.stage import ExtractJob, run_extraction
from tasks.prepare.stage import prepare
from tasks.train.checkpoints import checkpoint_dirs
from tasks.train.job import TrainJob
from tasks.train.stage import run_training
from tasks.train.tracking import read_metrics
from tasks.vocab import build_vocab

AUX = [2, 15, 27]
BLOCK, WINDOW = 2, 4
SETTINGS = {"total_seq_len": 384, "lr": 2e-3, "log_every": 1, "eval_every": 5, "val_fraction": 0.15, "seed": 3,
            "epochs": 2, "shuffle_block_shards": BLOCK}


@pytest.fixture(scope="module")
def inputs(smollm2, sharegpt, tmp_path_factory):
    root = tmp_path_factory.mktemp("stream-data")
    prepared = prepare(smollm2, [sharegpt], root, max_seq_len=256, max_rows=40)
    vocab = build_vocab(prepared.path, prepared.fingerprint, smollm2, root, draft_vocab_size=1024)
    return prepared, vocab


def extract(inputs, smollm2, out: Path, **settings):
    prepared = inputs[0]
    return run_extraction(ExtractJob(prepared.path, prepared.fingerprint, smollm2, str(out),
                                     settings={"batch_tokens": 2048, "shard_tokens": 700, **settings}))


def train_job(inputs, smollm2, extraction, out: Path) -> TrainJob:
    prepared, vocab = inputs
    return TrainJob(extraction.manifest, prepared.path, vocab.path, smollm2, str(out), AUX, settings=SETTINGS)


def untimed(metrics: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if k != "tokens_per_s"} for m in metrics]


def processes_running(module: str) -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"]) if module in " ".join(p.info["cmdline"] or [])]


def test_streamed_training_killed_anywhere_ends_with_the_offline_draft_within_its_window(inputs, smollm2, tmp_path):
    """The producer is killed once (started again alone, training waits), then the whole stage (run
    again: it resumes from its checkpoint, the producer from the shards on disk); the draft and the
    metrics are the offline run's, bit for bit, over two epochs (every shard produced again for the
    second), and no more shards than the window and the validation shards were ever on disk."""
    offline = extract(inputs, smollm2, tmp_path / "offline-hs")
    streamed = extract(inputs, smollm2, tmp_path / "stream-hs", mode="stream", stream_window=WINDOW)
    assert streamed.streamed and not streamed.verifier_loaded and streamed.fingerprint == offline.fingerprint
    assert offline.shards >= 4 * BLOCK and not list((tmp_path / "stream-hs").glob("shard-*"))
    want = run_training(train_job(inputs, smollm2, offline, tmp_path / "offline"), offline.fingerprint, "v",
                        in_process=True)

    out = tmp_path / "stream"
    out.mkdir()
    (out / "job.json").write_text(json.dumps(asdict(train_job(inputs, smollm2, streamed, out))))
    stage = subprocess.Popen(
        [sys.executable, "-c", "import json, sys; from tasks.train.job import TrainJob; from tasks.train.stage import "
         "run_training; run_training(TrainJob(**json.load(open(sys.argv[1]))), 'e', 'v', in_process=True)",
         str(out / "job.json")], start_new_session=True, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while len(list((tmp_path / "stream-hs").glob("shard-*"))) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        producers = processes_running("tasks.extract.stream")
        assert producers, "no producer process to kill"
        for p in producers:
            p.kill()
        while not checkpoint_dirs(out) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert stage.poll() is None, stage.stderr.read()[-3000:]
    finally:
        stage.kill()  # the stage's process alone: its producers notice and end
        log = stage.communicate()[1]
    assert "started again, alone (1 of 3)" in log, log[-3000:]
    while processes_running("tasks.extract.stream") and time.monotonic() < deadline + 30:
        time.sleep(0.1)
    assert not processes_running("tasks.extract.stream")
    resumed_from = checkpoint_dirs(out)[-1].name

    got = run_training(train_job(inputs, smollm2, streamed, out), streamed.fingerprint, "v", in_process=True)
    assert got.steps == want.steps and got.best_step == want.best_step and resumed_from < f"step-{got.steps:08d}"
    assert untimed(read_metrics(out)) == untimed(read_metrics(tmp_path / "offline"))
    a, b = load_file(Path(got.draft_path) / "model.safetensors"), load_file(Path(want.draft_path) / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)  # the same draft, bit for bit

    report = got.stream  # of the resumed attempt: its producer made the rest of both epochs
    assert report["shards_produced"] >= offline.shards and report["shards_deleted"] >= offline.shards // 2
    held_out = len(json.loads((tmp_path / "stream-hs" / "stream" / "sequence.json").read_text())["pinned"])
    assert 0 < report["high_water_bytes"] <= (WINDOW + held_out) * report["largest_shard_bytes"]
    assert not list((tmp_path / "stream-hs").glob("shard-*"))  # nothing left behind
