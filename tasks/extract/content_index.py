"""Where each sample of a run is read from: which samples an extraction folder already holds, by
content, wherever they fall in the run's data, and the new shards the others are cut into (the plan,
tasks/extract/plan.py, asks), so that only new samples are extracted.

- A shard written with content keys (`sample_keys` in its metadata, tasks/extract/shards.py) of the same
  extraction settings (verifier, layers, compute and storage dtypes: its `extraction_fingerprint`) is
  indexed by the keys of its samples. Shards of older format (no keys) are used as before: by the exact
  name of a shard planned over all the rows (`legacy`).
- A shard unchanged since its journal line was verified when written and is trusted; any other is read in
  full against its checksum, journaled again when it passes, and deleted when it fails (its samples are
  then extracted again).
- New shards record the plan that wrote them (`plan_id`: which rows were new, in which order, cut how).
  A plan interrupted (a kill, a worker process that plans after another wrote a shard) is recognized
  from its own shards: the rows they hold count as new again, so every process and every resume cuts the
  same shards, under the same names, as the plan that began the work.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Container, Iterable
from dataclasses import dataclass
from pathlib import Path

import xxhash

from tasks.common.content import sample_key
from tasks.extract.shards import (
    ShardError,
    ShardSpec,
    StoredShard,
    journal_line,
    read_metadata,
    shard_journal,
    unchanged_since_journal,
    verify_shard,
)
from tasks.prepare.dataset import token_ids, token_rows

log = logging.getLogger(__name__)


def plan_shards(prepared, extraction_fp: str, shard_tokens: int, rows: Container[int] | None = None) -> list[ShardSpec]:
    """Prepared rows (all, or those in `rows`) in source order, cut every `shard_tokens` tokens; inside a
    shard the rows are ordered longest first, the order in which they are batched and stored."""
    shards: list[ShardSpec] = []
    members: list[int] = []
    keys: dict[int, str] = {}
    h = xxhash.xxh3_128()
    tokens = 0

    def close() -> None:
        nonlocal members, tokens, h
        order = sorted(members, key=lambda r: (-lengths[r], r))
        shards.append(ShardSpec(len(shards), tuple(order), tuple(sample_ids[r] for r in order), tokens,
                                hashlib.sha256(f"{extraction_fp}:{h.hexdigest()}".encode()).hexdigest(),
                                tuple(keys[r] for r in order)))
        members, tokens, h = [], 0, xxhash.xxh3_128()

    lengths = prepared["seq_len"][:]  # lists: a `datasets` column indexed a row at a time is slow
    sample_ids = prepared["sample_id"][:]
    for r, ids in enumerate(token_rows(prepared)):
        if rows is not None and r not in rows:
            continue
        members.append(r)
        tokens += lengths[r]
        keys[r] = sample_key(ids)
        h.update(sample_ids[r].encode() + b"\0")
        h.update(ids.astype("int32").tobytes())
        if tokens >= shard_tokens:
            close()
    if members:
        close()
    return shards


@dataclass
class Placement:
    """Where a plan's rows are read from (ExtractionPlan's fields of the same names)."""

    shards: list[ShardSpec]
    reused: list[StoredShard]
    placement: list[tuple[str, int]]
    done: list[str]
    plan_id: str


def place_by_content(prepared, extraction_fp: str, shard_tokens: int, out_dir: Path, every: list[ShardSpec],
                     sample_ids: list[str], keys: list[str]) -> Placement:
    """Each row to the shard that holds it: an older-format shard at its name in `every` (the plan of all
    rows), else a shard of this extraction with its key, else a new shard, cut from the remaining rows."""
    keyed, legacy_done = index_folder(out_dir, extraction_fp, every)
    placement: list[tuple[str, int] | None] = [None] * len(sample_ids)
    legacy = [spec for spec in every if spec.name in legacy_done]
    for spec in legacy:
        for position, r in enumerate(spec.rows):
            placement[r] = (spec.name, position)
    open_rows = [r for r, where in enumerate(placement) if where is None]
    rows, index, plan = new_rows(open_rows, keys, keyed, extraction_fp, shard_tokens, sample_ids)
    if rows == list(range(len(sample_ids))):
        new = every  # nothing found to reuse: the plan of all rows
    else:
        new = plan_shards(prepared, extraction_fp, shard_tokens, set(rows)) if rows else []
    for spec in new:
        for position, r in enumerate(spec.rows):
            placement[r] = (spec.name, position)
    for r in open_rows:
        if placement[r] is None:
            placement[r] = index[keys[r]]
    read_from = {name for name, _ in placement}
    planned = {spec.name for spec in new}
    done = [spec.name for spec in legacy + new if spec.name in legacy_done or
            (spec.name in keyed and keyed[spec.name].fingerprint == spec.fingerprint)]
    reused = [shard for name, shard in sorted(keyed.items()) if name in read_from and name not in planned]
    return Placement(legacy + new, reused, placement, done, plan)


def rows_token_ids(prepared, rows) -> dict:
    """`input_ids` of any prepared `rows` as numpy arrays, read a run of consecutive rows at a time (the
    rows of a shard of new samples may lie apart in source order)."""
    ordered = sorted(set(rows))
    ids: dict = {}
    start = 0
    for i in range(1, len(ordered) + 1):
        if i == len(ordered) or ordered[i] != ordered[i - 1] + 1:
            ids.update(token_ids(prepared, ordered[start:i]))
            start = i
    return ids


def index_folder(out_dir: Path, extraction_fp: str, legacy: list[ShardSpec]) -> tuple[dict[str, StoredShard], set[str]]:
    """The valid shards of this extraction in `out_dir`: those with content keys, by name, and the names
    of older shards (no keys) found at a name of `legacy`."""
    journal = shard_journal(out_dir)
    entries = journal.entries()
    legacy_specs = {spec.name: spec for spec in legacy}
    keyed: dict[str, StoredShard] = {}
    legacy_done: set[str] = set()
    for path in sorted(out_dir.glob("shard-*.safetensors")):
        try:
            meta = read_metadata(path)
        except ShardError as e:  # a file of no known extraction; a planned one is written over
            log.warning("not indexed: %s", e)
            continue
        if "sample_keys" in meta and meta.get("extraction_fingerprint") == extraction_fp:
            shard = StoredShard(path.name, meta["fingerprint"], int(meta["tokens"]),
                                tuple(json.loads(meta["sample_keys"])), meta.get("plan", ""))
            if valid(path, shard.fingerprint, shard.tokens, len(shard.sample_keys), entries, journal):
                keyed[path.name] = shard
        elif ("sample_keys" not in meta and (spec := legacy_specs.get(path.name)) is not None
              and valid(path, spec.fingerprint, spec.tokens, len(spec.rows), entries, journal)):
            legacy_done.add(path.name)
    return keyed, legacy_done


def valid(path: Path, fingerprint: str, tokens: int, samples: int, entries: dict, journal) -> bool:
    if unchanged_since_journal(path, entries.get(path.name)):
        return True
    try:
        verify_shard(path, fingerprint)
    except ShardError as e:
        log.warning("removing %s: its samples are extracted again", e)
        path.unlink(missing_ok=True)
        return False
    journal.append(journal_line(path, read_metadata(path)["checksum"], fingerprint, tokens, samples))
    return True


def plan_id(extraction_fp: str, shard_tokens: int, sample_ids: list[str], keys: list[str], rows: Iterable[int]) -> str:
    """What a plan's new shards are cut from: the extraction settings, the shard size and its new rows
    (ids and content keys) in source order."""
    h = xxhash.xxh3_128(f"{extraction_fp}:{shard_tokens}".encode())
    for r in rows:
        h.update(f"{sample_ids[r]}\0{keys[r]}\0".encode())
    return h.hexdigest()


def by_key(shards: Iterable[StoredShard]) -> dict[str, tuple[str, int]]:
    """Key -> (shard name, position); of shards holding one key, the first by name."""
    where: dict[str, tuple[str, int]] = {}
    for shard in sorted(shards, key=lambda s: s.name):
        for position, key in enumerate(shard.sample_keys):
            where.setdefault(key, (shard.name, position))
    return where


def new_rows(open_rows: list[int], keys: list[str], keyed: dict[str, StoredShard], extraction_fp: str,
             shard_tokens: int, sample_ids: list[str]) -> tuple[list[int], dict[str, tuple[str, int]], str]:
    """(the rows to plan into new shards, where the other rows are read from, the plan's id). `open_rows`:
    the rows no older-format shard holds. A plan whose own shards are among `keyed` (recognized by its
    id) plans its rows again: the same shards, those already written found done by name."""
    for plan in sorted({shard.plan for shard in keyed.values() if shard.plan}):
        others = by_key(shard for shard in keyed.values() if shard.plan != plan)
        rows = [r for r in open_rows if keys[r] not in others]
        if plan_id(extraction_fp, shard_tokens, sample_ids, keys, rows) == plan:
            return rows, others, plan
    index = by_key(keyed.values())
    rows = [r for r in open_rows if keys[r] not in index]
    return rows, index, plan_id(extraction_fp, shard_tokens, sample_ids, keys, rows)
