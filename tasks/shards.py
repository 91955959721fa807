"""The hidden-state shard format, and how shards are written, checked and read.

A shard is one safetensors file holding many samples back to back:
- `hidden_states` [T_total, 4, H] (bf16): the 3 auxiliary layers, then the verifier's last layer
  (pre-norm), for every token of every sample;
- `input_ids` [T_total] (int32) and `offsets` [n + 1] (int64): sample i is rows offsets[i]:offsets[i+1].
With `extract.storage_dtype: fp8_e4m3` the states are float8_e4m3fn with float32 scales per token
and layer, `hidden_states_scale` [T_total, 4] (tasks/storage_dtype.py); readers get bf16 either way.
Its `__metadata__` carries the shard's fingerprint (everything that produced it: the extraction
settings and the identity and tokens of each sample), its sample ids and an xxh3-128 checksum of
the tensor bytes. A shard is written to a temporary name, fsynced and renamed, so a file with a
shard's name is complete or absent; the checksum catches later damage.

Every writer also appends a line per finished shard to its own journal (`journal/*.jsonl`,
tasks/journal.py): name, size, mtime and checksum. On resume, a shard whose size and mtime still match its journal line
was verified when written and is trusted without re-reading it; any other is verified in full.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash
from safetensors import safe_open

from tasks.storage_dtype import SCALE_TENSOR, dequantize

SHARD_FORMAT = "eagle3-hidden-states-v1"
# the order the checksum covers and the file holds them; fp8 shards alone have the scales
TENSOR_ORDER = ("hidden_states", SCALE_TENSOR, "input_ids", "offsets")


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

    @property
    def name(self) -> str:
        return f"shard-{self.index:06d}-{self.fingerprint[:16]}.safetensors"


def stored(tensors) -> list[str]:
    return [key for key in TENSOR_ORDER if key in tensors]


def tensors_checksum(tensors: dict[str, torch.Tensor]) -> str:
    h = xxhash.xxh3_128()
    for key in stored(tensors):
        t = tensors[key].contiguous()
        h.update(t.view(torch.uint8).numpy())
    return h.hexdigest()


def write_shard(path: Path, spec: ShardSpec, hidden_states: torch.Tensor, input_ids: torch.Tensor,
                offsets: torch.Tensor, extra_metadata: dict[str, str], scales: torch.Tensor | None = None) -> dict:
    """Write atomically (temporary name, fsync, rename, fsync the folder); returns the journal line."""
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
        "tokens": str(spec.tokens),
        "checksum": checksum,
        **extra_metadata,
    }
    tmp = path.with_name(f".tmp-{path.name}.{socket.gethostname()}.{os.getpid()}")
    with tmp.open("wb") as f:
        write_safetensors(f, tensors, metadata)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
    stat = path.stat()
    return {"name": path.name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "checksum": checksum,
            "fingerprint": spec.fingerprint, "tokens": spec.tokens, "samples": len(spec.rows)}


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


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def verify_shard(path: Path, spec: ShardSpec) -> dict[str, torch.Tensor]:
    """Read a shard in full and check it is the one `spec` describes and undamaged."""
    tensors, meta = load_shard(path)
    if meta.get("format") != SHARD_FORMAT:
        raise ShardError(f"{path.name}: format {meta.get('format')!r}, expected {SHARD_FORMAT!r}")
    if meta.get("fingerprint") != spec.fingerprint:
        raise ShardError(f"{path.name}: produced by other inputs (fingerprint {meta.get('fingerprint', '?')[:16]})")
    if tensors_checksum(tensors) != meta.get("checksum"):
        raise ShardError(f"{path.name}: checksum mismatch (damaged file)")
    return tensors


def unchanged_since_journal(path: Path, entry: dict | None) -> bool:
    if entry is None or not path.is_file():
        return False
    stat = path.stat()
    return stat.st_size == entry["size"] and stat.st_mtime_ns == entry["mtime_ns"]


class ShardReader:
    """Random access to samples across a manifest's shards (memory-mapped, nothing preloaded).
    Samples come as bf16 whatever the shards store: fp8 states are dequantized here."""

    def __init__(self, manifest_path: str | Path):
        self.manifest_path = Path(manifest_path)
        self.manifest = json.loads(self.manifest_path.read_text())
        self.folder = self.manifest_path.parent
        self.index: list[tuple[int, int]] = []  # sample -> (shard number, position in shard)
        self.sample_ids: list[str] = []
        self.lengths: list[int] = []
        for s, shard in enumerate(self.manifest["shards"]):
            self.index.extend((s, i) for i in range(len(shard["sample_ids"])))
            self.sample_ids.extend(shard["sample_ids"])
            self.lengths.extend(shard["lengths"])
        self.dtype = self.manifest.get("dtype", "bfloat16")  # what the shards store
        self._files: dict[int, object] = {}
        self._offsets: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.index)

    def _open(self, s: int):
        if s not in self._files:
            path = self.folder / self.manifest["shards"][s]["name"]
            if not path.is_file():
                raise ShardError(f"{path} listed in {self.manifest_path.name} is missing")
            f = safe_open(str(path), "pt")
            stored_as = f.get_slice("hidden_states").get_dtype()
            if stored_as != SAFETENSORS_DTYPES[getattr(torch, self.dtype)]:
                raise ShardError(f"{path.name} stores {stored_as} hidden states, {self.manifest_path.name} "
                                 f"says {self.dtype}: the shard is not this extraction's")
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

    def __getstate__(self):  # DataLoader workers reopen the files themselves
        state = self.__dict__.copy()
        state["_files"], state["_offsets"] = {}, {}
        return state


def prune(folder: str | Path, keep_manifest: str | Path | None = None) -> tuple[int, int]:
    """Delete shard files no manifest in `folder` lists (or, with `keep_manifest`, all but that
    manifest's shards, and the other manifests). Returns (files, bytes) removed."""
    folder = Path(folder)
    manifests = [Path(keep_manifest)] if keep_manifest else sorted(folder.glob("manifest-*.json"))
    keep = {shard["name"] for m in manifests for shard in json.loads(Path(m).read_text())["shards"]}
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
