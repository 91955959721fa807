"""Which version is current: promotion, rollback, and their history.

`current` is a relative symlink (`versions/<N>`), switched atomically: a new symlink under a
temporary name, os.replace over the old one, then the folder fsynced. A kill at any moment leaves
it at the old version or the new one.

history.jsonl records every switch, written and fsynced *before* the switch: a kill between the two
leaves a record whose switch never happened. Such a record is recognised, not trusted: each switch
starts from the version current at that moment, so a record took effect exactly when the next
record starts from the version it names (for the last record: when `current` is that version).
Replaying the records that took effect gives the versions made current in turn, a stack: a
promotion pushes, a rollback pops back to the version current before the last promotion.
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path

from tasks.common.folder_lock import folder_lock
from tasks.common.sealed import fsync_path
from tasks.registry.layout import (
    CURRENT,
    HISTORY,
    LOCK_OWNER,
    VERSIONS,
    RegistryError,
    Version,
    current,
    find_version,
    require_registry,
)

SWITCHING = ".current.tmp"  # the new symlink, before it replaces `current`


def history(registry_dir: str | Path) -> list[dict]:
    """Every promotion and rollback recorded, oldest first (a last line cut off by a kill left out:
    its switch never began)."""
    path = Path(registry_dir) / HISTORY
    if not path.is_file():
        return []
    lines = path.read_bytes().split(b"\n")
    lines.pop()  # after the last newline: empty, or a line a kill cut off
    records = []
    for number, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except ValueError:
            raise RegistryError(f"{path} line {number} is not a record: the file was changed by hand; fix or remove "
                                "that line (rollback reads the history)") from None
    return records


def made_current(records: list[dict], now: int | None) -> list[int]:
    """The versions made current in turn by the records that took effect (module docstring); the
    last is the current one."""
    stack: list[int] = []
    for record, following in zip(records, [*records[1:], None], strict=True):
        landed = following["from"] if following is not None else now
        if landed != record["to"]:
            continue  # recorded, then killed before the switch
        if record["action"] == "promote":
            stack.append(record["to"])
        elif stack:
            stack.pop()
    return stack


def append_history(registry_dir: Path, record: dict) -> None:
    path = registry_dir / HISTORY
    if path.is_file():
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):  # a record a kill cut off: its switch never began
            os.truncate(path, data.rfind(b"\n") + 1)
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())
    fsync_path(registry_dir)


def switch(registry_dir: Path, before: Version | None, target: Version, action: str, why: str) -> None:
    append_history(registry_dir, {"time": datetime.now(timezone.utc).isoformat(timespec="seconds"), "action": action,
                                  "from": before.number if before else None, "to": target.number, "why": why})
    staged = registry_dir / SWITCHING
    staged.unlink(missing_ok=True)  # left by a kill: we hold the lock, nobody else is switching
    os.symlink(f"{VERSIONS}/{target.number}", staged)
    os.replace(staged, registry_dir / CURRENT)
    fsync_path(registry_dir)


def promote(registry_dir: str | Path, number: int, reason: str) -> Version:
    """Make version `number` current (it must have passed validation); `reason` goes into the history."""
    registry_dir = Path(registry_dir)
    require_registry(registry_dir)  # before the lock, which would create the folder
    with folder_lock(registry_dir, LOCK_OWNER):
        target = find_version(registry_dir, number)
        if not target.validation_passed:
            raise RegistryError(f"version {number} cannot be made current: {target.validation_verdict}")
        before = current(registry_dir)
        if before is not None and before.number == number:
            raise RegistryError(f"version {number} is already current")
        switch(registry_dir, before, target, "promote", reason)
    return target


def rollback(registry_dir: str | Path, reason: str = "rolled back by hand") -> Version:
    """Make current again the version that was current before the last promotion still in force."""
    registry_dir = Path(registry_dir)
    require_registry(registry_dir)
    with folder_lock(registry_dir, LOCK_OWNER):
        now = current(registry_dir)
        if now is None:
            raise RegistryError(f"nothing to roll back in {registry_dir}: no version was ever made current")
        stack = made_current(history(registry_dir), now.number)
        if not stack or stack[-1] != now.number:
            raise RegistryError(f"{registry_dir / CURRENT} points at version {now.number}, which its history does not "
                                "say was made current (changed by hand?): choose the version with `drafts promote N`")
        if len(stack) < 2:
            raise RegistryError(f"nothing to roll back to: version {now.number} is the first version made current in "
                                f"{registry_dir}")
        target = find_version(registry_dir, stack[-2])
        switch(registry_dir, now, target, "rollback", reason)
    return target
