"""Where Prefect keeps its state for a run started from the command line or a test."""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from pathlib import Path

log = logging.getLogger(__name__)


def use_private_prefect_home(output_dir: str | Path) -> Path:
    """PREFECT_HOME under the output folder unless the user chose one; results (the task cache)
    under PREFECT_HOME. Must run before `prefect` is imported.

    Prefect 3.7 does not derive the result store from PREFECT_HOME (it stays ~/.prefect/storage),
    so it is set explicitly: the cache then lives and dies with the outputs it describes. Nor the
    server's memo store (its default ignores PREFECT_HOME: "Unable to write to memo_store.toml at
    ~/.prefect/memo_store.toml" where that folder does not exist).
    """
    home = Path(os.environ.setdefault("PREFECT_HOME", str(Path(output_dir).resolve() / ".prefect")))
    os.environ.setdefault("PREFECT_RESULTS_LOCAL_STORAGE_PATH", str(home / "storage"))
    os.environ.setdefault("PREFECT_SERVER_MEMO_STORE_PATH", str(home / "memo_store.toml"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "tasks")  # stage logs reach the Prefect UI
    return home


def set_aside_damaged_database(home: Path) -> Path | None:
    """A Prefect database (`home/prefect.db`, the ephemeral server's) that SQLite finds damaged is
    moved aside, with its journal files, so that the server starts on a new one: otherwise it never
    starts ("database disk image is malformed", then a time-out). It holds the run history the UI
    shows, not the task cache (results live under `home/storage`). Returns where it went."""
    database = home / "prefect.db"
    if os.environ.get("PREFECT_API_URL") or not database.is_file():
        return None  # a server of the user's own, or no database yet
    try:
        with sqlite3.connect(f"file:{database}?mode=ro", uri=True) as connection:
            problems = [row[0] for row in connection.execute("PRAGMA quick_check")]
        if problems == ["ok"]:
            return None
        reason = "; ".join(problems[:3])
    except sqlite3.DatabaseError as e:
        reason = str(e)
    aside = database.with_name(f"prefect.db.damaged-{time.strftime('%Y%m%d-%H%M%S')}")
    for suffix in ("", "-wal", "-shm", "-journal"):
        if Path(f"{database}{suffix}").exists():
            os.replace(f"{database}{suffix}", f"{aside}{suffix}")
    log.warning("the Prefect database %s is damaged (%s): moved aside to %s; a new one starts empty (the run "
                "history in the UI restarts; the task cache and the stages' outputs are kept)", database, reason, aside)
    return aside
