"""Writing shards: a shard's rows in length-sorted batches through a loaded backend, the captured
states assembled in host buffers and written by a background thread (format: tasks/extract/shards.py).

Device-to-host copies and file writes run on the background thread while the next batches
compute, so the disk does not idle the accelerator (and vice versa). With fp8 storage the states
are quantized on the device, before the copy: half the bytes cross to the host.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from pathlib import Path

import torch

from tasks.common.progress import Progress, ProgressCallback
from tasks.extract.content_index import rows_token_ids
from tasks.extract.plan import LAYERS_STORED, WRITER_BUFFERS, ExtractError, ExtractionPlan
from tasks.extract.shards import ShardSpec, shard_journal, write_shard
from tasks.extract.storage_dtype import SCALE_DTYPE, SCALE_TENSOR, STORAGE_DTYPES, encode

log = logging.getLogger(__name__)


def batches(spec: ShardSpec, lengths, batch_tokens: int) -> list[list[int]]:
    """Rows of a shard (longest first) grouped so that rows x longest <= batch_tokens."""
    out: list[list[int]] = []
    for r in spec.rows:
        if out and (len(out[-1]) + 1) * lengths[out[-1][0]] <= batch_tokens:
            out[-1].append(r)
        else:
            out.append([r])
    return out


class ShardWriter:
    """Assembles each shard in a host buffer and writes it on a background thread.

    Captured states go from the device straight into the shard's buffer (pinned memory and a
    copy stream on CUDA, so the copy overlaps the next forward). Three buffers: the next shards
    compute while earlier ones are written; if the disk falls behind, `begin` waits, and the
    time it waited is reported (`disk_wait_s`: a disk-bound extraction shows it here).
    """

    def __init__(self, out_dir: Path, max_tokens: int, hidden_size: int, device: str, metadata: dict[str, str],
                 storage_dtype: str = "bf16"):
        self.out_dir = out_dir
        self.metadata = metadata
        self.storage_dtype = storage_dtype
        self.journal = shard_journal(out_dir)
        self.cuda = device.startswith("cuda")
        shapes = {"hidden_states": ((max_tokens, LAYERS_STORED, hidden_size), STORAGE_DTYPES[storage_dtype])}
        if storage_dtype == "fp8_e4m3":
            shapes[SCALE_TENSOR] = ((max_tokens, LAYERS_STORED), SCALE_DTYPE)
        self.free: queue.Queue = queue.Queue()  # of buffers: {tensor name: host tensor}
        for _ in range(WRITER_BUFFERS):
            self.free.put({name: torch.empty(shape, dtype=dtype, pin_memory=self.cuda)
                           for name, (shape, dtype) in shapes.items()})
        self.disk_wait_s = self.write_s = 0.0
        self.copy_stream = torch.cuda.Stream() if self.cuda else None
        self.jobs: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.written: list[dict] = []
        self.thread = threading.Thread(target=self._run, daemon=True, name="shard-writer")
        self.thread.start()

    def begin(self, spec: ShardSpec, input_ids: list[list[int]]) -> None:
        self._raise_if_failed()
        self.spec = spec
        t0 = time.monotonic()
        self.buffer = self.free.get()
        self.disk_wait_s += time.monotonic() - t0
        self.cursor = 0
        self.finite = torch.ones((), dtype=torch.bool)
        self.ids = input_ids

    def add(self, states: torch.Tensor) -> None:
        n = states.shape[0]
        pieces = encode(states, self.storage_dtype)
        if self.cuda:
            self.finite = self.finite.to(states.device) & torch.isfinite(states).all()
            self.copy_stream.wait_stream(torch.cuda.current_stream(states.device))
            with torch.cuda.stream(self.copy_stream):
                for name, piece in pieces.items():
                    self.buffer[name][self.cursor: self.cursor + n].copy_(piece, non_blocking=True)
                    piece.record_stream(self.copy_stream)  # keep `piece` alive until the copy ran
        else:
            self.finite &= torch.isfinite(states).all()
            for name, piece in pieces.items():
                self.buffer[name][self.cursor: self.cursor + n].copy_(piece)
        self.cursor += n

    def finish(self) -> None:
        event = None
        if self.cuda:
            event = torch.cuda.Event()
            event.record(self.copy_stream)
        if self.cursor != self.spec.tokens:
            raise ExtractError(f"shard {self.spec.index}: captured {self.cursor} tokens, planned {self.spec.tokens}")
        self.jobs.put((self.spec, self.buffer, self.ids, self.finite, event))

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            spec, buffer, ids, finite, event = job
            t0 = time.monotonic()
            try:
                if event is not None:
                    event.synchronize()
                if not bool(finite):
                    raise ExtractError(f"shard {spec.index}: non-finite hidden states (samples {spec.sample_ids[:3]}...)")
                lengths = torch.tensor([0] + [len(x) for x in ids])
                scales = buffer.get(SCALE_TENSOR)
                entry = write_shard(
                    self.out_dir / spec.name, spec, buffer["hidden_states"][: spec.tokens],
                    torch.tensor([t for x in ids for t in x], dtype=torch.int32), lengths.cumsum(0), self.metadata,
                    scales=None if scales is None else scales[: spec.tokens],
                )
                self.journal.append(entry)
                self.written.append(entry)
            except BaseException as e:  # surfaced on the main thread by the next begin/close
                self.error = e
            finally:
                self.write_s += time.monotonic() - t0
                self.free.put(buffer)

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join()
        self._raise_if_failed()


def extract_shards(shards: list[ShardSpec], plan: ExtractionPlan, prepared, out_dir: Path, backend, *,
                   batch_tokens: int, label: str | None = "extract",
                   callback: ProgressCallback | None = None) -> list[dict]:
    """Capture and write `shards` with a loaded backend; returns their journal lines. With `label` None
    the call logs no progress and its writer's summary at debug level: for a caller that reports its
    own, a few shards per call (the streamed producer: three lines a block were most of a run's log)."""
    for spec in shards:  # partial files of an earlier, killed attempt at these shards
        for partial in out_dir.glob(f".tmp-{spec.name}.*"):
            partial.unlink(missing_ok=True)
    lengths = prepared["seq_len"][:]  # a list: a `datasets` column read a row at a time costs ~70 us a row
    metadata = {"layers": json.dumps(plan.layers), "hidden_size": str(plan.hidden_size),
                "extraction_fingerprint": plan.fingerprint, "verifier": plan.verifier}
    if plan.storage_dtype != "bf16":  # bf16 shards stay byte for byte what they were before fp8 storage
        metadata["storage_dtype"] = plan.storage_dtype
    if plan.plan_id:  # a resumed plan knows its own shards by it (tasks/extract/content_index.py)
        metadata["plan"] = plan.plan_id
    writer = ShardWriter(out_dir, max(s.tokens for s in shards), plan.hidden_size, backend.device, metadata,
                         plan.storage_dtype)
    progress = Progress(label, sum(s.tokens for s in shards), "tok", callback) if label else None
    try:
        for spec in shards:
            ids = {r: a.tolist() for r, a in rows_token_ids(prepared, spec.rows).items()}
            for i, batch in enumerate(batches(spec, lengths, batch_tokens)):
                states = backend.capture([ids[r] for r in batch])
                if i == 0:  # once its first batch is queued: a wait for a free buffer overlaps that compute
                    writer.begin(spec, [ids[r] for r in spec.rows])
                writer.add(states)
                if progress is not None:
                    progress.update(states.shape[0], note=f"shard {spec.index + 1}/{len(plan.shards)}")
            writer.finish()  # refuses a shard that did not get all its tokens
        if writer.cuda:  # nothing above waits for the device: from here on the time is the last write's alone
            torch.cuda.synchronize(backend.device)
        t_computed = time.monotonic()
    finally:
        writer.close()
        if progress is not None:
            progress.close()
    summary = {"gb": sum(e["size"] for e in writer.written) / 1e9, "write_s": writer.write_s,
               "disk_wait_s": writer.disk_wait_s, "last_write_s": time.monotonic() - t_computed}
    # `writer_summary` on the record: for a caller that times its own run (bench/extract_efficiency.py)
    log.log(logging.INFO if label else logging.DEBUG,
            "writer: %.2f GB in %.1f s of writing (%.2f GB/s); computing waited %.1f s for the disk; "
            "the last shard's write took %.1f s after its states were computed", summary["gb"], summary["write_s"],
            summary["gb"] / max(summary["write_s"], 1e-9), summary["disk_wait_s"], summary["last_write_s"],
            extra={"writer_summary": summary})
    return writer.written
