"""Append-only JSON-lines records of finished work, one file per writer process: processes on
several nodes writing into one shared folder never append to the same file. Readers merge every
file, the latest record per key winning (or, with `newest_by`, the record with the largest value
of that field). A torn last line (a process killed mid-write) is skipped, so that work is redone;
a file with any other unreadable line (bit rot, a stray write) is damaged: it is discarded
(deleted), and what it recorded counts as not done, which costs only redoing or re-verifying it.
Each record carries the checksum of its content (`crc`, xxh3-64 of its JSON with sorted keys): a
record changed after it was written, still valid JSON (an edited answer, say), counts as not done
and is redone, the file's other records kept. Records from before checksums are read as they are.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
from pathlib import Path

import xxhash

from tasks.common.errors import PermanentError

log = logging.getLogger(__name__)


class DiskWriteError(PermanentError, OSError):
    """A write failed (a full disk, a quota, an I/O error); the message names the folder and its free space."""


def write_error(what: str, folder: Path, e: OSError, needed: str = "") -> DiskWriteError:
    """`needed`: what the write needs, where the writer knows (e.g. "each checkpoint needs 176 MB ...")."""
    free = shutil.disk_usage(folder).free / 1e6 if folder.exists() else float("nan")
    return DiskWriteError(f"{what} failed: {e.strerror or e} ({free:,.0f} MB free on that disk)"
                          + (f"; {needed}" if needed else ""))


class Journal:
    def __init__(self, folder: Path, name: str = "journal", key: str = "name",
                 fields: dict[str, type] | None = None, newest_by: str | None = None):
        """Records under `folder/name/`, each an object with a str `key` and the typed `fields`."""
        self.folder, self.key, self.newest_by = Path(folder) / name, key, newest_by
        self.fields = {key: str, **(fields or {})}

    def append(self, *entries: dict) -> None:
        """The entries, written and fsynced together."""
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{socket.gethostname()}-{os.getpid()}.jsonl"
        try:
            with path.open("a") as f:
                f.write("".join(json.dumps({**entry, "crc": record_checksum(entry)}) + "\n" for entry in entries))
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:  # a cut-off line is skipped when read
            raise write_error(f"appending to the journal {path}", self.folder, e) from e

    def entries(self) -> dict[str, dict]:
        """{key: the latest entry} over every writer's file; damaged files discarded (module docstring)."""
        out: dict[str, dict] = {}
        for path in sorted(self.folder.glob("*.jsonl")) if self.folder.is_dir() else []:
            try:
                entries = self.parse(path.read_bytes())
            except ValueError as e:
                log.warning("journal %s is damaged (%s): discarded; what it recorded counts as not done", path, e)
                path.unlink(missing_ok=True)
                continue
            for entry in entries:
                before = out.get(entry[self.key])
                if before is None or self.newest_by is None or entry[self.newest_by] >= before[self.newest_by]:
                    out[entry[self.key]] = entry
        return out

    def parse(self, data: bytes) -> list[dict]:
        """The entries of one journal file; ValueError names the first line that is not one."""
        lines = data.split(b"\n")
        torn = lines.pop()  # after the last newline: empty, or the line a crash cut off
        entries, changed = [], []
        for number, line in enumerate(lines, 1):
            try:
                entry = json.loads(line)
            except (UnicodeDecodeError, json.JSONDecodeError):
                raise ValueError(f"line {number} is not JSON") from None
            if not isinstance(entry, dict):
                raise ValueError(f"line {number} is not an object")
            wrong = [k for k, kind in self.fields.items() if not isinstance(entry.get(k), kind)]
            if wrong:
                raise ValueError(f"line {number} lacks a valid {', '.join(wrong)}")
            crc = entry.pop("crc", None)
            if crc is not None and crc != record_checksum(entry):
                changed.append(number)
                continue
            entries.append(entry)
        if changed:
            log.warning("journal %s: %d record(s) changed since written (line %s): they count as not done",
                        self.folder, len(changed), ", ".join(map(str, changed[:5])))
        if torn:
            log.info("journal: ignoring a last line cut off by a crash (%d bytes)", len(torn))
        return entries


def record_checksum(entry: dict) -> str:
    return xxhash.xxh3_64_hexdigest(json.dumps(entry, sort_keys=True).encode())
