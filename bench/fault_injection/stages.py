"""The inputs every trial shares (small real SmolLM2 and ShareGPT), the uninterrupted reference runs,
and each stage run as a process (`bench/faults.py stage JOB`) that a trial can kill."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
ENTRY_POINT = ROOT / "bench" / "faults.py"

# Small on purpose (a few shards, checkpoints and chunks: 20 kills of each stage fit in about an hour and
# a half on 2 shared CPU cores); eval_every and log_every are coprime, so log windows straddle
# checkpoints; 3 epochs pack into different step counts. The flow leaves regeneration out (it has its own
# kills): its kills land in prepare, extraction, vocab, training and validation.
EXTRACT = {"batch_tokens": 2048, "shard_tokens": 200}
TRAIN = {"epochs": 3, "total_seq_len": 256, "lr": 2e-3, "eval_every": 4, "log_every": 3, "val_fraction": 0.15,
         "seed": 1, "keep_checkpoints": 2}
REGENERATE = {"enabled": True, "backend": "transformers", "max_new_tokens": 6, "max_turns": 1, "chunk_size": 2,
              "batch_size": 2}
REGENERATE_ROWS, REGENERATE_PROMPT_TOKENS = 6, 128  # 3 chunks
# extract.mode 'stream' (kill-stream, producer): a shard per block, a window of two, every epoch extracted again
STREAM = {**EXTRACT, "mode": "stream", "stream_window": 2}
STREAM_TRAIN = {**TRAIN, "shuffle_block_shards": 1}


@dataclass
class Inputs:
    """Small real inputs (SmolLM2, ShareGPT) shared by every trial, and the uninterrupted references."""

    work: Path
    smollm2: str = ""
    sharegpt: str = ""
    prepared: object = None
    vocab: object = None
    references: dict = field(default_factory=dict)  # kind -> (output folder, wall seconds)

    def __post_init__(self):
        from tasks.common.demo_assets import ensure_asset
        from tasks.prepare.stage import prepare
        from tasks.vocab import build_vocab

        self.work.mkdir(parents=True, exist_ok=True)
        self.smollm2, self.sharegpt = str(ensure_asset("smollm2-135m-instruct")), str(ensure_asset("sharegpt"))
        self.prepared = prepare(self.smollm2, [self.sharegpt], self.work / "inputs", max_seq_len=128, max_rows=16)
        self.vocab = build_vocab(self.prepared.path, self.prepared.fingerprint, self.smollm2, self.work / "inputs",
                                 draft_vocab_size=1024)

    def extract_job(self, out: Path, **settings) -> dict:
        from tasks.extract.stage import ExtractJob

        return {"extract": asdict(ExtractJob(self.prepared.path, self.prepared.fingerprint, self.smollm2, str(out),
                                             settings={**EXTRACT, **settings}))}

    def train_job(self, out: Path, manifest: str | None = None) -> dict:
        from tasks.train.job import TrainJob

        manifest = manifest or str(next(self.reference("extract-1")[0].glob("manifest-*.json")))
        job = TrainJob(manifest, self.prepared.path, self.vocab.path, self.smollm2, str(out), [2, 15, 27],
                       settings=TRAIN)
        return {"train": asdict(job), "manifest_fp": "bench", "vocab_fp": self.vocab.fingerprint}

    def stream_job(self, out: Path) -> dict:
        """A streamed training (its extraction job, then the training job over the manifest it writes)."""
        from tasks.train.job import TrainJob

        extract = self.extract_job(out / "hidden_states", **STREAM)
        train = TrainJob("", self.prepared.path, self.vocab.path, self.smollm2, str(out / "train"), [2, 15, 27],
                         settings=STREAM_TRAIN)
        return {**extract, "train": asdict(train), "manifest_fp": "bench", "vocab_fp": self.vocab.fingerprint}

    def regenerate_job(self, out: Path) -> dict:
        from tasks.prepare.regenerate import RegenerateJob

        return {"regenerate": asdict(RegenerateJob([self.sharegpt], REGENERATE_ROWS, self.smollm2, str(out),
                                                    REGENERATE_PROMPT_TOKENS, REGENERATE))}

    def flow_config(self, out: Path) -> dict:
        return {"name": "faults", "output_dir": str(out), "verifier": {"path": self.smollm2},
                "data": {"sources": [self.sharegpt], "max_rows": 8, "max_seq_len": 128},
                "extract": EXTRACT, "vocab": {"draft_vocab_size": 512}, "train": TRAIN, "validation": {"live": "skip"}}

    def command(self, kind: str, out: Path) -> list[str]:
        """The stage as a process: `faults.py stage JOB` (extract, train, regenerate) or the CLI."""
        out.mkdir(parents=True, exist_ok=True)
        if kind == "flow":
            config = out.parent / f"{out.name}.yaml"
            config.write_text(json.dumps(self.flow_config(out)))
            return [sys.executable, "-m", "flows.cli", "run", str(config)]
        stage = kind.split("-")[0]
        job = {"extract": lambda: self.extract_job(out, workers=int(kind.split("-")[1])),
               "train": lambda: self.train_job(out), "regenerate": lambda: self.regenerate_job(out),
               "stream": lambda: self.stream_job(out)}[stage]()
        job_file = out.parent / f"{out.name}.job.json"
        job_file.write_text(json.dumps(job))
        return [sys.executable, str(ENTRY_POINT), "stage", str(job_file)]

    def reference(self, kind: str) -> tuple[Path, float]:
        """An uninterrupted run of `kind` (done once): its output folder and wall time."""
        if kind not in self.references:
            out = self.work / f"reference-{kind}"
            shutil.rmtree(out, ignore_errors=True)
            t0 = time.monotonic()
            proc = run_stage(self.command(kind, out), out.with_suffix(".log"))
            if proc.returncode != 0:
                raise RuntimeError(f"the uninterrupted {kind} run failed: see {out.with_suffix('.log')}")
            wall = time.monotonic() - t0
            self.references[kind] = (out, wall)
            log(f"reference {kind}: {wall:.1f} s")
        return self.references[kind]


ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
ENV.pop("PREFECT_HOME", None)  # each flow run keeps its Prefect database under its own output folder
ENV.pop("PREFECT_API_URL", None)


def run_stage(cmd: list[str], log_file: Path, stop_at: float | None = None, how: str = "kill") -> subprocess.Popen:
    """Run a stage in its own process group; with `stop_at`, stop it then (unless it ended before):
    "kill" SIGKILLs the whole group, "term" sends SIGTERM to the leader alone (`kill PID`, systemd's
    KillMode=process), "int" SIGINT to the whole group (a terminal's Ctrl-C). After a polite signal,
    `proc.stop_s` is how long the group took to be gone (None: not within POLITE_STOP_S, then killed).
    `proc.stopped` says whether the stop came while it ran."""
    with log_file.open("a") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=ENV, cwd=ROOT, start_new_session=True)
        proc.stop_s, proc.stopped = None, False
        try:
            proc.wait(timeout=stop_at)
        except subprocess.TimeoutExpired:
            proc.stopped = True
            if how == "kill":
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                children = psutil.Process(proc.pid).children(recursive=True)  # the leader is Popen's to reap
                t0 = time.monotonic()
                if how == "term":
                    proc.send_signal(signal.SIGTERM)
                else:
                    os.killpg(proc.pid, signal.SIGINT)
                try:
                    proc.wait(timeout=POLITE_STOP_S)
                except subprocess.TimeoutExpired:
                    pass
                _, alive = psutil.wait_procs(children, timeout=max(0.0, t0 + POLITE_STOP_S - time.monotonic()))
                if proc.poll() is None or alive:  # not stopped in time: SIGKILL what is left
                    for process in alive:
                        with contextlib.suppress(psutil.Error):
                            process.kill()
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                else:
                    proc.stop_s = time.monotonic() - t0
            proc.wait()
            wait_group_gone(proc.pid)
    return proc


POLITE_STOP_S = 10.0  # what the pipeline promises for SIGTERM or SIGINT (README)


@contextlib.contextmanager
def cpu_burner():
    """A process spinning on each core this process may use while inside: the loaded machine a polite stop must
    keep its promise on (the trials that measured 4.8-27.8 s ran at a load of 3-20)."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in os.sched_getaffinity(0)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def wait_group_gone(pgid: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            return
        time.sleep(0.05)


def stage_main(job_file: str) -> int:
    """One stage, as the pipeline runs it (workers and training in their own subprocesses)."""
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    job = json.loads(Path(job_file).read_text())
    if "extract" in job and "train" in job:  # streamed: the stream manifest, then training produces the shards
        from tasks.extract.stage import ExtractJob, run_extraction
        from tasks.train.job import TrainJob
        from tasks.train.stage import run_training

        manifest = run_extraction(ExtractJob(**job["extract"])).manifest
        result = run_training(TrainJob(**{**job["train"], "manifest": manifest}), job["manifest_fp"], job["vocab_fp"])
    elif "extract" in job:
        from tasks.extract.stage import ExtractJob, run_extraction

        result = run_extraction(ExtractJob(**job["extract"]))
    elif "train" in job:
        from tasks.train.job import TrainJob
        from tasks.train.stage import run_training

        result = run_training(TrainJob(**job["train"]), job["manifest_fp"], job["vocab_fp"])
    else:
        from tasks.prepare.regenerate import RegenerateJob, regenerate

        result = regenerate(RegenerateJob(**job["regenerate"]))
    print("RESULT " + json.dumps(asdict(result) if hasattr(result, "__dataclass_fields__") else str(result)))
    return 0


def log(message: str) -> None:
    print(f"[faults {time.strftime('%H:%M:%S')}] {message}", flush=True)
