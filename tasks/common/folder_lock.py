"""One run per output folder: an exclusive lock that two runs of a stage on one folder cannot both hold.

The lock is `flock` on `<folder>/.lock`: the kernel releases it when the holding process dies,
however it dies, so a killed run never leaves a lock that blocks the next one (the file stays,
holding the last holder's description). Worker processes a stage starts inherit the locked file
(`pass_fds`), so the folder stays locked while any of them still writes. The holder writes its
pid, host, start time and command into the file, and a run that finds the lock held names them.
On NFS, Linux implements flock with the server's byte-range locks, so it holds across hosts.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tasks.common.errors import PermanentError

LOCK_NAME = ".lock"
_HELD_HERE: set[Path] = set()  # folders this process holds the lock of (flock is per open file, not per process)


class FolderLockedError(RuntimeError):
    """Another run holds the output folder; the message names its process and host."""


class LockNotWritableError(PermanentError, PermissionError):
    """The folder's lock file cannot be opened for writing (read-only files): no retry mends it."""


def busy(folder: Path, what: str) -> FolderLockedError:
    return FolderLockedError(
        f"{folder} is in use by another {what} run ({describe_holder(folder / LOCK_NAME)}); two runs writing one "
        "folder would undo each other's work: wait for it to finish, or stop it (its lock goes with its process)")


def refuse_if_busy(folder: str | Path, what: str) -> None:
    """Raise FolderLockedError at once if a live process holds `folder`'s lock: a cheap probe before
    a run's slow start (imports, checks), which then takes the lock itself."""
    if held_by_live_process(folder):
        raise busy(Path(folder), what)


@contextmanager
def folder_lock(folder: str | Path, what: str) -> Iterator[int]:
    """Hold `folder`'s lock for the block (creating the folder); yields the locked file's descriptor
    for the worker processes to inherit. Raises FolderLockedError at once if another run holds it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except PermissionError as e:
        raise LockNotWritableError(f"{path} cannot be opened for writing ({e.strerror}): the folder or its files "
                                   f"are read-only; make them writable (chmod -R u+w {folder})") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise busy(folder, what) from None
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "what": what,
                  "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(sys.argv)[:300]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        _HELD_HERE.add(folder.resolve())
        try:
            yield fd
        finally:
            _HELD_HERE.discard(folder.resolve())
    finally:
        os.close(fd)  # releases the lock unless a worker process still holds the inherited descriptor


def held_here(folder: str | Path) -> bool:
    """Whether this process holds `folder`'s lock (the CLI holds its output folder's around the flow)."""
    return Path(folder).resolve() in _HELD_HERE


def held_by_live_process(folder: str | Path) -> bool | None:
    """Whether a live process holds `folder`'s lock; None where the folder has no lock file that can
    be read (no stage ran there). The probe takes the lock shared and lets go at once: a stage starting in that
    instant would be refused (a transient error, retried), so poll it seconds apart, not in a loop."""
    try:
        fd = os.open(Path(folder) / LOCK_NAME, os.O_RDONLY)
    except OSError:  # no lock file, or no folder there at all (a path through a file): the checks say which
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # releases the probe's lock
    return False


def describe_holder(path: Path) -> str:
    try:
        holder = json.loads(path.read_text())
        return f"pid {holder['pid']} on host {holder['host']}, since {holder['since']}: {holder['command']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not yet written its name into " + str(path)
