"""Streamed extraction (`extract.mode: stream`, docs/STREAMING.md): the verifier produces the shards while
the draft trains, in the order training reads them, and no more than `extract.stream_window` shards
(besides the validation shards) are on disk at a time.

The producer and the trainer meet in the shard folder. The shards are the offline extraction's (same
plan, fingerprints, batches, bytes, journal), written to a temporary name and sealed by rename, so a
shard's file exists only once it is complete. Beside them, in `stream/`, small files written whole:
- `sequence.json`, by the trainer once it knows its schedule: the blocks of shards in the order its steps
  read them (`positions`), and the shards it reads at any time (`pinned`, kept for the whole run: the
  validation shards, else the first block, on which the targets are checked);
- `released.json`, by the trainer after each checkpoint (and at start, from the checkpoint it resumed
  from): the position a resume would start at. Shards of earlier positions no resume can need: the
  producer deletes them and fills the window from this position on;
- `stop` (the stage, when training ended) and `producer-failed.json` (the stage, when the producer failed
  for good: the trainer stops waiting and says why);
- `abandon` (the stage, when training stopped short: a signal, a failure): the producers end at once,
  mid-shard (the shard's temporary file is never renamed; a resume extracts it again).

A shard deleted and needed again (a later epoch, a resume from an older checkpoint) is produced again:
the same samples in the same batches give the same bytes. Each producer rank writes its high-water
mark (bytes of shards on disk) to `report-<rank>.json`.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from tasks.common.errors import is_deterministic
from tasks.common.progress import Progress, ProgressCallback, format_bytes, format_seconds
from tasks.common.workers import end_processes, process_trees, rank_worker_main
from tasks.extract.job import ExtractJob, load_inputs, make_backend, manifest_content, run_worker_processes
from tasks.extract.plan import ExtractError, make_plan
from tasks.extract.writer import extract_shards

log = logging.getLogger(__name__)

POLL_S = 0.2
PRODUCER_RESTARTS = 3  # a producer process that dies (OOM, a signal) is started again alone, this many times


class ProducerFailed(ExtractError):
    """The streamed extraction failed for good: training stops waiting for it."""


def write_whole(path: Path, data: dict) -> None:
    tmp = path.with_name(f".tmp-{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


class StreamControl:
    """The files through which trainer, producer and stage coordinate (module docstring)."""

    def __init__(self, shard_dir: str | Path):
        self.shard_dir = Path(shard_dir)
        self.dir = self.shard_dir / "stream"
        self.parent = os.getppid()

    def reset(self) -> None:
        """A new attempt: nothing of the last one's sequence, release point or stop is believed."""
        self.dir.mkdir(parents=True, exist_ok=True)
        for path in [*(self.dir / name for name in ("sequence.json", "released.json", "stop", "abandon",
                                                     "producer-failed.json")),
                     *self.dir.glob("report-*.json")]:
            path.unlink(missing_ok=True)

    # the trainer's side
    def publish(self, positions: list[list[int]], pinned: list[int], first_steps: list[int]) -> None:
        write_whole(self.dir / "sequence.json", {"positions": positions, "pinned": pinned, "first_steps": first_steps})

    def release(self, position: int) -> None:
        write_whole(self.dir / "released.json", {"position": position})

    def producer_failure(self) -> str | None:
        failed = read_json(self.dir / "producer-failed.json")
        return failed["message"] if failed else None

    # the producer's side
    def sequence(self) -> dict | None:
        return read_json(self.dir / "sequence.json")

    def released(self) -> int:
        released = read_json(self.dir / "released.json")
        return released["position"] if released else 0

    def stopped(self) -> bool:
        """The stage said stop, or died (this process was handed to another parent): no producer outlives it."""
        return (self.dir / "stop").exists() or os.getppid() != self.parent

    # the stage's side
    def stop(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "stop").touch()

    def abandon(self) -> None:
        self.stop()
        (self.dir / "abandon").touch()

    def abandoned(self) -> bool:
        """The stage abandoned the stream, or died: this producer ends now, its shard unfinished."""
        return (self.dir / "abandon").exists() or os.getppid() != self.parent

    def fail(self, message: str) -> None:
        write_whole(self.dir / "producer-failed.json", {"message": message})

    def reports(self) -> list[dict]:
        return [json.loads(p.read_text()) for p in sorted(self.dir.glob("report-*.json"))]


def window_shards(sequence: dict, released: int, window: int) -> list[int]:
    """The shards to have on disk now, in the order training reads them: the validation shards, then
    the blocks from the release point on, as many whole blocks as fit in `window` shards (the first
    always)."""
    wanted = list(sequence["pinned"])
    ahead: list[int] = []
    for position in sequence["positions"][released:]:
        new = [s for s in position if s not in ahead]
        if ahead and len(ahead) + len(new) > window:
            break
        ahead += new
    return wanted + [s for s in ahead if s not in wanted]


def shard_sizes(out_dir: Path) -> list[int]:
    """Bytes of each shard file on disk now (another rank may delete one meanwhile)."""
    sizes = []
    for path in out_dir.glob("shard-*.safetensors"):
        with contextlib.suppress(FileNotFoundError):
            sizes.append(path.stat().st_size)
    return sizes


def write_stream_manifest(plan, prepared_fp: str, lengths, job: ExtractJob, path: Path) -> Path:
    """The manifest of a streamed extraction: the offline manifest's shards, fingerprints and lengths
    (training plans its steps from them) without checksums (each shard is checked against its own
    when it is read), and how to produce them (`stream.job`, the extraction job)."""
    manifest = manifest_content(plan, prepared_fp, lengths, lambda s: None)
    manifest["stream"] = {"window": job.extract_settings.stream_window, "job": asdict(job)}
    write_whole(path, manifest)
    return path


def produce(job: ExtractJob, rank: int = 0, world_size: int = 1, callback: ProgressCallback | None = None) -> None:
    """One producer rank: the verifier loaded once, then, until training has released every position
    (or the stage says stop), delete the shards outside the window and extract the missing ones of
    this rank (shard i is rank i % world_size's), one block at a time."""
    s = job.extract_settings
    prepared, verifier, layers = load_inputs(job)
    out_dir = Path(job.out_dir)
    control = StreamControl(out_dir)
    plan = make_plan(prepared, verifier, layers, out_dir, compute_dtype=job.compute_dtype,
                     shard_tokens=s.shard_tokens, storage_dtype=s.storage_dtype, check_existing=False, estimate=False)
    specs = plan.shards
    backend = make_backend(job, verifier, layers)
    end_when_abandoned(control)
    backend.load(callback)  # while the trainer starts: it publishes its sequence once it knows its schedule
    report = control.dir / f"report-{rank}.json"
    before = read_json(report) or {}  # this rank's earlier process in this attempt, if it died
    high_water, largest, produced, deleted = (before.get(k, 0) for k in (
        "high_water_bytes", "largest_shard_bytes", "shards_produced", "shards_deleted"))
    try:
        while (sequence := control.sequence()) is None:
            if control.stopped():
                return
            time.sleep(POLL_S)
        # this rank's work from the release point on: the kept shards, then every block left (again each epoch)
        mine = [i for i in sequence["pinned"] if i % world_size == rank] + [
            i for position in sequence["positions"][control.released():] for i in position if i % world_size == rank]
        total = sum(specs[i].tokens for i in mine)
        progress = Progress(f"extract (streamed) [{rank}/{world_size}]", total, "tok", callback)
        waited, first_release = 0.0, control.released()
        while not control.stopped():
            released = control.released()
            finished = released >= len(sequence["positions"])  # then only the validation shards are kept
            keep = window_shards(sequence, released, s.stream_window)
            keep_names = {specs[i].name for i in keep}
            for i, spec in enumerate(specs):  # outside the window: no resume can need them
                path = out_dir / spec.name
                if (i % world_size == rank and spec.name not in keep_names and path.exists()
                        and not s.stream_cache_epochs):
                    path.unlink()
                    deleted += 1
            missing = [specs[i] for i in keep if i % world_size == rank and not (out_dir / specs[i].name).exists()]
            if not missing:
                if finished:
                    break  # training has read every block (a re-run of a finished one reads the validation shards)
                asleep = time.monotonic()
                time.sleep(POLL_S)  # the window is full: training sets the pace
                asleep = time.monotonic() - asleep
                # The rate is the producer's own; the ETA adds the waits back, but not those before training
                # first moves the window on: its start-up (compilation), once (as a recurring cost, a 2-minute
                # compilation made the ETA twice the time left).
                progress.exclude(asleep, recurs=released != first_release)
                waited += asleep
                continue
            # a block at a time, so that a stop is heard between calls
            block = missing if finished else missing[: len(sequence["positions"][released])]
            extract_shards(block, plan, prepared, out_dir, backend, batch_tokens=s.batch_tokens, label=None)
            produced += len(block)
            sizes = shard_sizes(out_dir)
            on_disk, high_water, largest = sum(sizes), max(high_water, sum(sizes)), max([largest, *sizes])
            progress.update(sum(spec.tokens for spec in block),
                            note=f"{len(keep)} shards in the window, {format_bytes(on_disk)} on disk, "
                                 f"{format_seconds(waited)} waiting for training to free it")
        progress.close()
    finally:
        backend.close()
        write_whole(report, {
            "rank": rank, "high_water_bytes": high_water, "shards_produced": produced, "shards_deleted": deleted,
            "largest_shard_bytes": largest})  # files, not the plan's estimate: headers and token ids included
    log.info("streamed extraction [%d/%d]: %d shards produced, %d deleted, at most %s on disk", rank, world_size,
             produced, deleted, format_bytes(high_water))


def end_when_abandoned(control: StreamControl) -> None:
    """In a producer: a thread that ends this process and any it started (vLLM's engines) as soon as the
    stage abandons the stream. Not between blocks: a shard takes seconds to minutes (10.6 s on a loaded
    2-core machine), and the stage's stop promises every process gone within 10 s."""
    def watch() -> None:
        while not control.abandoned():
            time.sleep(POLL_S)
        log.info("streamed extraction: stopped by the stage; a shard it had not finished is extracted on resume")
        end_processes(process_trees([os.getpid()])[1:])
        os._exit(0)  # not an exception: the main thread is in the backend's forward pass

    threading.Thread(target=watch, name="abandon-watch", daemon=True).start()


RunProducers = Callable[[ExtractJob, ProgressCallback | None], None]


def local_producers(lock_fd: int) -> RunProducers:
    """Producers as `extract.workers` processes on this machine, holding the shard folder's lock `lock_fd`
    (on a Ray cluster, flows/ray_stages.py runs them as rank tasks instead)."""
    return lambda job, callback: run_worker_processes("tasks.extract.stream", "streamed extraction worker", job,
                                                      job.extract_settings.workers, callback, lock_fd)


@contextmanager
def producing(manifest: dict, run_producers: RunProducers,
              callback: ProgressCallback | None = None) -> Iterator[StreamControl]:
    """The producers of a streamed manifest, run by `run_producers` (which returns when they end) while the
    caller trains. Producers that die without an error of their own (WorkerLost: OOM, a signal, a lost node)
    are started again alone; one that fails for good tells the trainer (which stops waiting) and its error
    is raised here, in place of the trainer's. When the caller is done the producers are told to stop, and,
    after a successful training, the stream's shards are deleted (but with extract.stream_cache_epochs: they
    are the offline extraction's shards, which a later offline run finds and reuses)."""
    job = ExtractJob(**manifest["stream"]["job"])
    control = StreamControl(job.out_dir)
    control.reset()
    failures: list[BaseException] = []

    def keep_producing() -> None:
        for attempt in range(PRODUCER_RESTARTS + 1):
            try:
                run_producers(job, callback)
                return
            except Exception as e:
                if control.stopped():
                    return
                if is_deterministic(e) or attempt == PRODUCER_RESTARTS:
                    failures.append(e)
                    control.fail(f"{type(e).__name__}: {e}")
                    return
                log.warning("streamed extraction: %s; started again, alone (%d of %d)", e, attempt + 1,
                            PRODUCER_RESTARTS)

    # in this thread's context: a Prefect task runner submits producer tasks as part of the caller's task run
    producer = threading.Thread(target=contextvars.copy_context().run, args=(keep_producing,),
                                name="streamed-extraction", daemon=True)
    producer.start()
    try:
        yield control
    except BaseException:  # a stop signal or training's failure: the producers abandon their shards
        control.abandon()
        producer.join()
        if failures:
            raise failures[0] from None  # the producer's own error: the trainer only stopped waiting
        raise
    control.stop()
    producer.join()
    if not job.extract_settings.stream_cache_epochs:  # kept shards are the offline extraction's, for a later run
        for name in (entry["name"] for entry in manifest["shards"]):
            (control.shard_dir / name).unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    """A producer process: `python -m tasks.extract.stream --job JOB.json --rank R --world-size W`."""
    return rank_worker_main("tasks.extract.stream", ExtractJob, produce, argv)


if __name__ == "__main__":
    raise SystemExit(main())
