"""The hidden-state shard format, and how shards are written, checked and read.

A shard is one safetensors file holding many samples back to back:
- `hidden_states` [T_total, 4, H] (bf16): the 3 auxiliary layers, then the verifier's last layer
  (pre-norm), for every token of every sample;
- `input_ids` [T_total] (int32) and `offsets` [n + 1] (int64): sample i is rows offsets[i]:offsets[i+1].
With `extract.storage_dtype: fp8_e4m3` the states are float8_e4m3fn with float32 scales per token
and layer, `hidden_states_scale` [T_total, 4] (tasks/extract/storage_dtype.py); readers get bf16 either way.
Its `__metadata__` carries the shard's fingerprint (everything that produced it: the extraction
settings and the identity and tokens of each sample), its sample ids, its samples' content keys
(`sample_keys`, tasks/common/content.py: any later run of the same extraction settings reads a
sample from here by its tokens, wherever it falls in that run's data), the extraction's fingerprint
and an xxh3-128 checksum of the tensor bytes (shards written before content keys lack `sample_keys`).
A shard is written to a temporary name, fsynced and renamed, so a file with a shard's name is
complete or absent; the checksum catches later damage.

Every writer also appends a line per finished shard to its own journal (`journal/*.jsonl`,
tasks/common/journal.py): name, size, mtime and checksum. On resume, a shard whose size and mtime still
match its journal line was verified when written and is trusted without re-reading it; any other
is verified in full (and journaled again when it passes). A damaged journal file is discarded,
which only costs that full verification.

Readers (training) check every shard against the manifest before using it: the fingerprint the
manifest lists, every byte against the checksum, once per shard and process. A manifest's shard
entry lists the samples a run reads from that shard; where it reads only some of them, or not in
the shard's order (a shard of an earlier extraction), their `positions` in the shard too.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash
from safetensors import safe_open

from tasks.common.journal import Journal, write_error
from tasks.common.sealed import fsync_path
from tasks.extract.storage_dtype import SCALE_TENSOR, STORAGE_DTYPES, dequantize

SHARD_FORMAT = "eagle3-hidden-states-v1"
# the order the checksum covers and the file holds them; fp8 shards alone have the scales
TENSOR_ORDER = ("hidden_states", SCALE_TENSOR, "input_ids", "offsets")
# extract.storage_dtype -> the manifest's `dtype` (torch's name of what the shards store)
STORED_DTYPES = {name: str(dtype).removeprefix("torch.") for name, dtype in STORAGE_DTYPES.items()}


class ShardError(ValueError):
    """A shard file is unusable; the message says which and why."""


@dataclass(frozen=True)
class ShardSpec:
    """One planned shard: which prepared rows it holds and the fingerprint they give it."""

    index: int
    rows: tuple[int, ...]  # row numbers in the prepared dataset
    sample_ids: tuple[str, ...]
    tokens: int
    fingerprint: str
    sample_keys: tuple[str, ...] = ()  # the rows' content keys (tasks/common/content.py), in the same order

    @property
    def name(self) -> str:
        return f"shard-{self.index:06d}-{self.fingerprint[:16]}.safetensors"


@dataclass(frozen=True)
class StoredShard:
    """A shard on disk that lists its samples' content keys: any run of the same extraction settings
    reads its samples from it by key (tasks/extract/plan.py)."""

    name: str
    fingerprint: str
    tokens: int  # all its samples'
    sample_keys: tuple[str, ...]  # in the order the shard stores them
    plan: str  # the plan that wrote it (ExtractionPlan.plan_id): a resumed plan knows its own shards


def stored(tensors) -> list[str]:
    return [key for key in TENSOR_ORDER if key in tensors]


def tensors_checksum(tensors: dict[str, torch.Tensor]) -> str:
    h = xxhash.xxh3_128()
    for key in stored(tensors):
        t = tensors[key].contiguous()
        h.update(t.view(torch.uint8).numpy())
    return h.hexdigest()


def file_checksum(f, rows_per_read: int = 16384) -> str:
    """`tensors_checksum` of an open shard, read a slice at a time (memory stays bounded)."""
    h = xxhash.xxh3_128()
    for key in stored(f.keys()):
        tensor = f.get_slice(key)
        rows = tensor.get_shape()[0] if tensor.get_shape() else 0
        for start in range(0, rows, rows_per_read):
            h.update(tensor[start: start + rows_per_read].contiguous().view(torch.uint8).numpy())
    return h.hexdigest()


def write_shard(path: Path, spec: ShardSpec, hidden_states: torch.Tensor, input_ids: torch.Tensor,
                offsets: torch.Tensor, extra_metadata: dict[str, str], scales: torch.Tensor | None = None) -> dict:
    """Write atomically (temporary name, fsync, rename, fsync the folder); returns the journal line.
    A full disk fails with a DiskWriteError naming the folder, and no partial file stays behind."""
    tensors = {"hidden_states": hidden_states.contiguous(), "input_ids": input_ids.to(torch.int32).contiguous(),
               "offsets": offsets.to(torch.int64).contiguous()}
    if scales is not None:
        tensors[SCALE_TENSOR] = scales.contiguous()
    checksum = tensors_checksum(tensors)
    metadata = {
        "format": SHARD_FORMAT,
        "fingerprint": spec.fingerprint,
        "index": str(spec.index),
        "sample_ids": json.dumps(spec.sample_ids),
        **({"sample_keys": json.dumps(spec.sample_keys)} if spec.sample_keys else {}),
        "tokens": str(spec.tokens),
        "checksum": checksum,
        **extra_metadata,
    }
    tmp = path.with_name(f".tmp-{path.name}.{socket.gethostname()}.{os.getpid()}")
    try:
        with tmp.open("wb") as f:
            write_safetensors(f, tensors, metadata)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise write_error(f"writing {path.name} to {path.parent}", path.parent, e) from e
    os.replace(tmp, path)
    fsync_path(path.parent)
    return journal_line(path, checksum, spec.fingerprint, spec.tokens, len(spec.rows))


def journal_line(path: Path, checksum: str, fingerprint: str, tokens: int, samples: int) -> dict:
    stat = path.stat()
    return {"name": path.name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "checksum": checksum,
            "fingerprint": fingerprint, "tokens": tokens, "samples": samples}


SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float8_e4m3fn: "F8_E4M3", torch.int32: "I32", torch.int64: "I64",
                      torch.float32: "F32"}


def write_safetensors(f, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """The safetensors layout, written tensor by tensor from their own memory.

    safetensors.torch.save_file first copies every tensor into one bytes object and writes it
    while holding the GIL; a plain write() of each tensor's memory needs no copy and releases the
    GIL, so the main thread keeps the accelerator busy while a multi-GB shard goes to disk.
    Files are read back with the safetensors library itself.
    """
    header: dict = {"__metadata__": metadata}
    offset = 0
    for key in stored(tensors):
        t = tensors[key]
        size = t.numel() * t.element_size()
        header[key] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    f.write(len(encoded).to_bytes(8, "little"))
    f.write(encoded)
    for key in stored(tensors):
        f.write(memoryview(tensors[key].contiguous().view(torch.uint8).numpy()))


def read_metadata(path: Path) -> dict[str, str]:
    try:
        with safe_open(str(path), "pt") as f:
            return f.metadata() or {}
    except Exception as e:  # a truncated or foreign file fails to parse
        raise ShardError(f"{path.name}: unreadable safetensors file ({e})") from None


def load_shard(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    try:
        with safe_open(str(path), "pt") as f:
            return {k: f.get_tensor(k) for k in stored(f.keys())}, f.metadata() or {}
    except Exception as e:
        raise ShardError(f"{path.name}: unreadable safetensors file ({e})") from None


def verify_shard(path: Path, fingerprint: str) -> dict[str, torch.Tensor]:
    """Read a shard in full and check it is the one of `fingerprint` and undamaged."""
    tensors, meta = load_shard(path)
    if meta.get("format") != SHARD_FORMAT:
        raise ShardError(f"{path.name}: format {meta.get('format')!r}, expected {SHARD_FORMAT!r}")
    if meta.get("fingerprint") != fingerprint:
        raise ShardError(f"{path.name}: produced by other inputs (fingerprint {meta.get('fingerprint', '?')[:16]})")
    if tensors_checksum(tensors) != meta.get("checksum"):
        raise ShardError(f"{path.name}: checksum mismatch (damaged file)")
    return tensors


def shard_journal(out_dir: Path) -> Journal:
    """The extraction folder's journal of finished shards; of two lines for one shard, the newest
    (by the mtime it records) wins."""
    return Journal(out_dir, fields={"size": int, "mtime_ns": int, "checksum": str}, newest_by="mtime_ns")


QUARANTINE_SUFFIX = ".damaged"


def quarantine(path: Path) -> str:
    """Move a shard that failed its check aside (never deleted; a missing one leaves an empty marker
    there) so that the extraction stage, cached or not, extracts it again on the next run
    (flows/stages.py); returns what to tell the user."""
    aside = path.with_name(path.name + QUARANTINE_SUFFIX)
    moved = path.exists()
    try:
        os.replace(path, aside) if moved else aside.touch()
    except OSError as e:  # a read-only share, say: the user has to ask for the redo
        return f"it could not be moved aside ({e.strerror}): re-run with --refresh to extract it again"
    return (f"{'moved aside' if moved else 'marked'} as {aside.name}; run the same command again and the "
            "extraction extracts it again")


def quarantined_shards(folder: Path) -> list[str]:
    """Shards moved aside as damaged and not extracted again since: no file of the name is back, and no
    extraction finished in the folder since (one that did wrote a manifest, after extracting the samples
    again, into shards that may be named otherwise: it finds samples by content, and the damaged shard
    is no longer a `shard-*.safetensors` file). Moving a file aside sets its change time (ctime)."""
    manifests = [p.stat().st_mtime_ns for p in folder.glob("manifest-*.json")]
    last_extraction = max(manifests, default=0)
    return sorted(p.name.removesuffix(QUARANTINE_SUFFIX) for p in folder.glob(f"*{QUARANTINE_SUFFIX}")
                  if not p.with_name(p.name.removesuffix(QUARANTINE_SUFFIX)).is_file()
                  and p.stat().st_ctime_ns > last_extraction)


def unchanged_since_journal(path: Path, entry: dict | None) -> bool:
    if entry is None or not path.is_file():
        return False
    stat = path.stat()
    return stat.st_size == entry["size"] and stat.st_mtime_ns == entry["mtime_ns"]


def read_manifest(path: str | Path) -> dict:
    """An extraction manifest, or a ShardError saying why it cannot be used."""
    path = Path(path)
    if not path.is_file():
        raise ShardError(f"extraction manifest not found: {path} (deleted after it was cached? re-run with --refresh)")
    try:
        manifest = json.loads(path.read_bytes())
        if not isinstance(manifest, dict) or manifest.get("format") != SHARD_FORMAT:
            raise ValueError(f"not a {SHARD_FORMAT} manifest")
        if manifest.get("dtype", "bfloat16") not in STORED_DTYPES.values():
            raise ValueError(f"dtype {manifest['dtype']!r} is none of {', '.join(STORED_DTYPES.values())}")
        streamed = "stream" in manifest  # shards yet to be produced: each is checked against its own checksum
        for shard in manifest["shards"]:
            if not all(shard[k] is not None for k in ("name", "fingerprint") + (() if streamed else ("checksum",))):
                raise ValueError(f"shard entry without a name, fingerprint or checksum: {shard.get('name')}")
            if len(shard["sample_ids"]) != len(shard["lengths"]):
                raise ValueError(f"{shard['name']}: sample ids and lengths disagree")
            for listed in ("sample_keys", "positions"):  # each optional, one per sample where present
                if listed in shard and len(shard[listed]) != len(shard["sample_ids"]):
                    raise ValueError(f"{shard['name']}: {listed} and sample ids disagree")
            if not all(isinstance(p, int) and p >= 0 for p in shard.get("positions", ())):
                raise ValueError(f"{shard['name']}: positions are not sample numbers")
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError, KeyError, TypeError) as e:
        raise ShardError(f"extraction manifest {path} is damaged ({type(e).__name__}: {e}); re-running the "
                         "extraction verifies the shards and writes it again (--refresh)") from None
    return manifest


class ShardReader:
    """Random access to samples across a manifest's shards (memory-mapped, nothing preloaded).
    Samples come as bf16 whatever the shards store: fp8 states are dequantized here.

    No byte of a shard is used before the shard was checked against the manifest (`verify`):
    it is the file the manifest lists (its fingerprint), undamaged (every byte against the
    checksum) and shaped and typed as listed. That costs one read of each shard per process; a
    file changed on disk since (size, mtime or inode) is checked again when next opened.

    A streamed extraction's shards (tasks/extract/stream.py) appear while training reads: a missing one is
    waited for (`wait_for`, called with its path) instead of being marked for a redo, each is checked
    against the checksum it carries, and at most `max_open` files stay open (a deleted shard's space is
    freed once no reader holds it)."""

    def __init__(self, manifest_path: str | Path, wait_for=None, max_open: int | None = None):
        self.manifest_path = Path(manifest_path)
        self.manifest = read_manifest(self.manifest_path)
        self.folder = self.manifest_path.parent
        self.index: list[tuple[int, int]] = []  # sample -> (shard number, position in shard)
        self.sample_ids: list[str] = []
        self.sample_keys: list[str | None] = []  # content keys; None where the manifest predates them
        self.lengths: list[int] = []
        for s, shard in enumerate(self.manifest["shards"]):
            self.index.extend((s, i) for i in shard.get("positions", range(len(shard["sample_ids"]))))
            self.sample_ids.extend(shard["sample_ids"])
            self.sample_keys.extend(shard.get("sample_keys", [None] * len(shard["sample_ids"])))
            self.lengths.extend(shard["lengths"])
        self.dtype = self.manifest.get("dtype", "bfloat16")  # what the shards store
        self._files: dict[int, object] = {}
        self._offsets: dict[int, list[int]] = {}
        self.verified: dict[int, tuple[int, int, int]] = {}  # shard number -> (size, mtime_ns, inode) checked
        self.wait_for, self.max_open = wait_for, max_open

    def __len__(self) -> int:
        return len(self.index)

    def path(self, s: int) -> Path:
        return self.folder / self.manifest["shards"][s]["name"]

    def verify(self, shards: Iterable[int] | None = None) -> None:
        """Check shards (all by default) against the manifest; a ShardError names the first that fails."""
        for s in range(len(self.manifest["shards"])) if shards is None else shards:
            self._files.pop(s, None)
            self.verified[s] = self._check(s)

    def _check(self, s: int) -> tuple[int, int, int]:
        listed, path = self.manifest["shards"][s], self.path(s)
        where = f"{path} (listed in {self.manifest_path.name})"
        if self.wait_for is not None and not path.is_file():
            self.wait_for(path)
        if not path.is_file():
            raise ShardError(f"{where} is missing; {quarantine(path)}")
        stat = path.stat()
        try:
            with safe_open(str(path), "pt") as f:
                meta = f.metadata() or {}
                shape = f.get_slice("hidden_states").get_shape()
                stored_as = f.get_slice("hidden_states").get_dtype()
                samples = f.get_slice("offsets").get_shape()[0] - 1
                checksum = file_checksum(f) if meta.get("fingerprint") == listed["fingerprint"] else None
        except Exception as e:  # a truncated or foreign file fails to parse
            raise ShardError(f"{where} is unreadable ({e}); {quarantine(path)}") from None
        if meta.get("fingerprint") != listed["fingerprint"]:
            raise ShardError(f"{where} is a shard of other inputs (fingerprint {meta.get('fingerprint', '?')[:16]}, "
                             f"the manifest lists {listed['fingerprint'][:16]}); {quarantine(path)}")
        # a streamed shard's manifest lists no checksum: the one the shard carries is checked alone
        if checksum != meta.get("checksum") or (listed["checksum"] is not None and checksum != listed["checksum"]):
            raise ShardError(f"{where} is damaged (checksum mismatch); {quarantine(path)}")
        # an entry of some of the shard's samples (`positions`) lists the whole shard's tokens
        tokens = listed["tokens"] if "positions" in listed else sum(listed["lengths"])
        expected = [tokens, len(self.manifest["layers"]), self.manifest["hidden_size"]]
        if shape != expected:
            raise ShardError(f"{where} holds hidden_states {shape}, the manifest expects {expected}; "
                             f"{quarantine(path)}")
        if max(listed.get("positions", [len(listed["sample_ids"]) - 1]), default=-1) >= samples:
            raise ShardError(f"{where} holds {samples} samples, fewer than the manifest reads from it; "
                             f"{quarantine(path)}")
        if stored_as != SAFETENSORS_DTYPES[getattr(torch, self.dtype)]:
            raise ShardError(f"{where} stores {stored_as} hidden states, {self.manifest_path.name} says "
                             f"{self.dtype}: the shard is not this extraction's; {quarantine(path)}")
        return stat.st_size, stat.st_mtime_ns, stat.st_ino

    def _open(self, s: int):
        if s not in self._files:
            path = self.path(s)
            stat = path.stat() if path.is_file() else None
            if stat is None or self.verified.get(s) != (stat.st_size, stat.st_mtime_ns, stat.st_ino):
                self.verify([s])
            f = safe_open(str(path), "pt")
            if self.max_open is not None and len(self._files) >= self.max_open:
                oldest = next(iter(self._files))
                del self._files[oldest], self._offsets[oldest]
            self._files[s] = f
            self._offsets[s] = f.get_tensor("offsets").tolist()
        return self._files[s], self._offsets[s]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids [T] int64, hidden_states [T, 4, H])."""
        s, j = self.index[i]
        f, offsets = self._open(s)
        a, b = offsets[j], offsets[j + 1]
        states = f.get_slice("hidden_states")[a:b]
        if self.dtype == "float8_e4m3fn":
            states = dequantize(states, f.get_slice(SCALE_TENSOR)[a:b])
        return f.get_slice("input_ids")[a:b].long(), states

    def __getstate__(self):  # DataLoader workers reopen the files themselves (what was verified stays verified)
        state = self.__dict__.copy()
        state["_files"], state["_offsets"] = {}, {}
        return state


def prune(folder: str | Path, keep_manifest: str | Path | None = None) -> tuple[int, int]:
    """Delete shard files no manifest in `folder` lists (or, with `keep_manifest`, all but that
    manifest's shards, and the other manifests). Returns (files, bytes) removed."""
    folder = Path(folder)
    manifests = [Path(keep_manifest)] if keep_manifest else sorted(folder.glob("manifest-*.json"))
    keep = {shard["name"] for m in manifests for shard in read_manifest(m)["shards"]}
    removed = freed = 0
    for path in folder.glob("shard-*.safetensors"):
        if path.name not in keep:
            freed += path.stat().st_size
            path.unlink()
            removed += 1
    if keep_manifest:
        for other in folder.glob("manifest-*.json"):
            if other.resolve() != Path(keep_manifest).resolve():
                other.unlink()
    return removed, freed
