"""Where Prefect keeps its state for a run started from the command line or a test."""

from __future__ import annotations

import os
from pathlib import Path


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
