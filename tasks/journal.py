"""Append-only JSON-lines records of finished work, one file per writer process: processes on
several nodes writing into one shared folder never append to the same file. Readers merge every
file, the latest record per key winning; a torn last line (a process killed mid-write) is
skipped, so that work is redone."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path


class Journal:
    def __init__(self, folder: Path, name: str = "journal", key: str = "name"):
        self.folder, self.key = Path(folder) / name, key

    def append(self, *entries: dict) -> None:
        """The entries, written and fsynced together."""
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{socket.gethostname()}-{os.getpid()}.jsonl"
        with path.open("a") as f:
            f.write("".join(json.dumps(entry) + "\n" for entry in entries))
            f.flush()
            os.fsync(f.fileno())

    def entries(self) -> dict[str, dict]:
        """{key: the latest entry} over every writer's file."""
        out: dict[str, dict] = {}
        for path in sorted(self.folder.glob("*.jsonl")) if self.folder.is_dir() else []:
            for line in path.read_text().splitlines():
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:
                    continue
                out[entry[self.key]] = entry
        return out
