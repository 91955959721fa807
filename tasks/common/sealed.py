"""Folders written whole or not at all, and checked where they are read.

A folder is written under a temporary name, then sealed: every file fsynced, a marker file listing
each file's size and checksum written and fsynced, the folder renamed to its final name and the
parent folder fsynced. A power loss leaves no folder or a complete one, never one that looks
complete and is not; a file changed or cut short later no longer matches the marker, and whoever
reads the folder can tell (training's checkpoints, tasks/train/checkpoints.py).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import xxhash

CHUNK = 1 << 22


def file_digest(path: Path) -> str:
    h = xxhash.xxh3_128()
    with path.open("rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def seal(tmp: Path, final: Path, marker: str, info: dict) -> Path:
    """Seal the folder `tmp` as `final` (replacing any folder there), its marker holding `info` and
    the size and xxh3-128 checksum of every file."""
    files = {}
    for path in sorted(p for p in tmp.iterdir() if p.is_file()):
        fsync_path(path)
        files[path.name] = {"bytes": path.stat().st_size, "xxh3_128": file_digest(path)}
    with (tmp / marker).open("w") as f:
        f.write(json.dumps({**info, "files": files}))
        f.flush()
        os.fsync(f.fileno())
    fsync_path(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    fsync_path(final.parent)
    return final


def damage(folder: Path, marker: str) -> str | None:
    """Why the sealed folder cannot be trusted, or None when every file its marker lists is there
    with its size and checksum. A marker from before checksums (no `files`) is trusted as it was."""
    try:
        listed = json.loads((folder / marker).read_text()).get("files")
    except (OSError, ValueError) as e:
        return f"its {marker} cannot be read ({e})"
    for name, want in (listed or {}).items():
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != want["bytes"]:
            return f"{path} has {path.stat().st_size} bytes, {want['bytes']} were written"
        if file_digest(path) != want["xxh3_128"]:
            return f"{path} does not match the checksum written with it"
    return None
