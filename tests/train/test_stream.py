"""extract.mode 'stream': the verifier (SmolLM2, in producer processes) extracts while the draft trains,
within a window of shards, and the draft is the offline run's, tensor for tensor, kills included."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

import psutil
import pytest
from flow_support import untimed
from safetensors.torch import load_file

from tasks.extract.stage import ExtractJob, run_extraction
from tasks.prepare.stage import prepare
from tasks.train.job import TrainJob, TrainResult
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
    prepared = prepare(smollm2, [sharegpt], root, max_seq_len=256, max_rows=20)
    vocab = build_vocab(prepared.path, prepared.fingerprint, smollm2, root, draft_vocab_size=1024)
    return prepared, vocab


def extract(inputs, smollm2, out: Path, **settings):
    prepared = inputs[0]
    return run_extraction(ExtractJob(prepared.path, prepared.fingerprint, smollm2, str(out),
                                     settings={"batch_tokens": 2048, "shard_tokens": 400, **settings}))


def train_job(inputs, smollm2, extraction, out: Path) -> TrainJob:
    prepared, vocab = inputs
    return TrainJob(extraction.manifest, prepared.path, vocab.path, smollm2, str(out), AUX, settings=SETTINGS)


def processes_running(module: str) -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"]) if module in " ".join(p.info["cmdline"] or [])]


def start_stage(job_file: Path, log: Path) -> subprocess.Popen:
    """The train stage over a streamed manifest, as a process of its own group (its producers with it)."""
    with log.open("a") as sink:
        return subprocess.Popen(
            [sys.executable, "-c", "import dataclasses, json, sys; from tasks.train.job import TrainJob; from "
             "tasks.train.stage import run_training; result = run_training(TrainJob(**json.load(open(sys.argv[1]))), "
             "'e', 'v', in_process=True); print('RESULT', json.dumps(dataclasses.asdict(result)))",
             str(job_file)], start_new_session=True, stdout=sink, stderr=subprocess.STDOUT)


def at_work(out: Path, since: float) -> bool:
    """The stage started at `since` trains (its metrics file rewritten: trimmed to the checkpoint it
    resumed from, or a step logged), so its producers produce."""
    with contextlib.suppress(FileNotFoundError):
        return (out / "metrics.jsonl").stat().st_mtime > since
    return False


class DiskWatch(threading.Thread):
    """The most bytes of shard files ever seen in a folder, polled every 20 ms: the window, measured
    from outside the producer."""

    def __init__(self, folder: Path):
        super().__init__(daemon=True)
        self.folder, self.high_water, self.stop = folder, 0, threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.02):
            size = 0
            for path in self.folder.glob("shard-*.safetensors"):
                with contextlib.suppress(FileNotFoundError):  # deleted meanwhile
                    size += path.stat().st_size
            self.high_water = max(self.high_water, size)


@pytest.mark.system  # ten kills: `make test` runs it, `make test-fast` does not
def test_streamed_training_killed_ten_times_ends_with_the_offline_draft_within_its_window(inputs, smollm2, tmp_path):
    """Ten kills at seeded random times while the stage is at work (training begun, producers producing),
    each of the producer processes alone (started again alone while training waits) or of the whole
    stage (its own producers and training; then run again: training resumes from its checkpoint, the
    producer from the shards on disk): the draft and the metrics are
    the offline run's, bit for bit, over two epochs (every shard produced again for the second), and no
    more shards than the window and the validation shards were ever on disk."""
    offline = extract(inputs, smollm2, tmp_path / "offline-hs")
    streamed = extract(inputs, smollm2, tmp_path / "stream-hs", mode="stream", stream_window=WINDOW)
    assert streamed.streamed and not streamed.verifier_loaded and streamed.fingerprint == offline.fingerprint
    assert offline.shards >= 4 * BLOCK and not list((tmp_path / "stream-hs").glob("shard-*"))
    want = run_training(train_job(inputs, smollm2, offline, tmp_path / "offline"), offline.fingerprint, "v",
                        in_process=True)

    out, log = tmp_path / "stream", tmp_path / "stream.log"
    out.mkdir()
    (out / "job.json").write_text(json.dumps(asdict(train_job(inputs, smollm2, streamed, out))))
    rng, kills, starts = random.Random(5), [], 1
    watch = DiskWatch(tmp_path / "stream-hs")
    watch.start()
    stage, started = start_stage(out / "job.json", log), time.time()
    while stage.poll() is None or stage.returncode != 0:
        if stage.poll() is not None:  # killed, or failed once its producer was killed past its restarts
            stage, starts, started = start_stage(out / "job.json", log), starts + 1, time.time()
            continue
        if len(kills) == 10:
            stage.wait(timeout=600)
            continue
        if not at_work(out, started):  # a kill during the process's imports would test nothing
            time.sleep(0.1)
            continue
        time.sleep(rng.uniform(0.5, 3))
        if stage.poll() is not None:
            continue
        if rng.random() < 0.5 and (producers := processes_running("tasks.extract.stream")):
            kills.append("producer")
            for p in producers:
                p.kill()
        else:
            kills.append("stage")
            os.killpg(stage.pid, signal.SIGKILL)
            stage.wait()
    watch.stop.set()
    text = log.read_text()
    assert len(kills) == 10 and starts >= kills.count("stage") + 1, kills  # more: a producer killed past its restarts
    assert "producer" not in kills or "started again, alone" in text, text[-3000:]
    assert not processes_running("tasks.extract.stream")

    got = TrainResult(**json.loads(text[text.rindex("RESULT ") + 7:].splitlines()[0]))
    assert got.steps == want.steps and got.best_step == want.best_step
    assert untimed(read_metrics(out)) == untimed(read_metrics(tmp_path / "offline"))
    a, b = load_file(Path(got.draft_path) / "model.safetensors"), load_file(Path(want.draft_path) / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)  # the same draft, bit for bit

    report = got.stream  # of the last attempt, which made the rest of both epochs
    held_out = len(json.loads((tmp_path / "stream-hs" / "stream" / "sequence.json").read_text())["pinned"])
    assert report["window_shards"] == WINDOW and report["shards_produced"] > 0
    bound = (WINDOW + held_out) * report["largest_shard_bytes"]
    assert 0 < report["high_water_bytes"] <= bound and 0 < watch.high_water <= bound
    assert not list((tmp_path / "stream-hs").glob("shard-*"))  # nothing left behind
