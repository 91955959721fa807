"""extract.mode 'stream': the verifier (SmolLM2, in producer processes) extracts while the draft trains,
within a window of shards, and the draft is the offline run's, tensor for tensor."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from tasks.extract.stage import ExtractJob, run_extraction
from tasks.prepare.stage import prepare
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


def train(inputs, smollm2, extraction, out: Path, **settings):
    prepared, vocab = inputs
    job = TrainJob(extraction.manifest, prepared.path, vocab.path, smollm2, str(out), AUX,
                   settings={**SETTINGS, **settings})
    return run_training(job, extraction.fingerprint, vocab.fingerprint, in_process=True)


def untimed(metrics: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if k != "tokens_per_s"} for m in metrics]


def test_streamed_training_is_the_offline_run_within_its_window(inputs, smollm2, tmp_path):
    offline = extract(inputs, smollm2, tmp_path / "offline-hs")
    streamed = extract(inputs, smollm2, tmp_path / "stream-hs", mode="stream", stream_window=WINDOW)
    assert streamed.streamed and not streamed.verifier_loaded and streamed.fingerprint == offline.fingerprint
    assert offline.shards >= 4 * BLOCK  # blocks enough for the window to move
    assert not list((tmp_path / "stream-hs").glob("shard-*"))

    want = train(inputs, smollm2, offline, tmp_path / "offline")
    got = train(inputs, smollm2, streamed, tmp_path / "stream")
    assert got.steps == want.steps and got.best_step == want.best_step
    assert untimed(read_metrics(tmp_path / "stream")) == untimed(read_metrics(tmp_path / "offline"))
    a, b = load_file(Path(got.draft_path) / "model.safetensors"), load_file(Path(want.draft_path) / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)  # the same draft, bit for bit

    report = got.stream
    pinned = 1  # validation shards, kept all run: at least one
    assert report["shards_produced"] >= 2 * (offline.shards - pinned)  # two epochs: each produced its shards
    assert report["shards_deleted"] >= offline.shards - pinned
    assert 0 < report["high_water_bytes"] <= (WINDOW + offline.shards // 2) * report["largest_shard_bytes"]
    assert not list((tmp_path / "stream-hs").glob("shard-*"))  # nothing left behind
