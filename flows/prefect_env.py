"""Where Prefect keeps its state for a run started from the command line or a test."""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request
from contextlib import closing
from importlib.metadata import version
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


def database_problems(database: Path) -> str | None:
    """What SQLite's quick check finds wrong with the database, None where nothing."""
    try:
        with closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True)) as connection:
            problems = [row[0] for row in connection.execute("PRAGMA quick_check")]
        return None if problems == ["ok"] else "; ".join(problems[:3])
    except sqlite3.DatabaseError as e:
        return str(e)


def set_aside_damaged_database(home: Path) -> Path | None:
    """A Prefect database (`home/prefect.db`, the ephemeral server's) that SQLite finds damaged is
    moved aside, with its journal files, so that the server starts on a new one: otherwise it never
    starts ("database disk image is malformed", then a time-out). It holds the run history the UI
    shows, not the task cache (results live under `home/storage`). Returns where it went."""
    database = home / "prefect.db"
    if os.environ.get("PREFECT_API_URL") or not database.is_file():
        return None  # a server of the user's own, or no database yet
    reason = database_problems(database)
    if reason is None:
        return None
    aside = database.with_name(f"prefect.db.damaged-{time.strftime('%Y%m%d-%H%M%S')}")
    for suffix in ("", "-wal", "-shm", "-journal"):
        if Path(f"{database}{suffix}").exists():
            os.replace(f"{database}{suffix}", f"{aside}{suffix}")
    log.warning("the Prefect database %s is damaged (%s): moved aside to %s; a new one starts empty (the run "
                "history in the UI restarts; the task cache and the stages' outputs are kept)", database, reason, aside)
    return aside


SERVER_START_TIMEOUT_S = 180  # a loaded machine, a first start migrating a new database
RUN_SERVER: subprocess.Popen | None = None  # the server start_run_server started in this process
NEW_DATABASE: Path | None = None  # the database it migrated from nothing: the template, once it answers


def database_template() -> Path | None:
    """A migrated, empty Prefect database of the installed Prefect version, copied into each new output
    folder: a server migrating a new SQLite database starts in 11-13 s on 2 cores, one given a migrated
    copy in 6 (2026-12-07). None where the user chose a database (PREFECT_API_DATABASE_CONNECTION_URL)."""
    if os.environ.get("PREFECT_API_DATABASE_CONNECTION_URL"):
        return None
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "eagle3-pipeline" / f"prefect-{version('prefect')}.db"


def seed_database(home: Path) -> None:
    """A new output folder's Prefect database starts as the template's copy (where one was kept)."""
    global NEW_DATABASE
    database, template = home / "prefect.db", database_template()
    if template is None or database.exists():
        return
    if template.is_file() and database_problems(template):  # damaged on disk since it was kept: made again
        log.warning("the Prefect database template %s is damaged: deleted, made again by this run", template)
        template.unlink(missing_ok=True)
    if not template.is_file():
        NEW_DATABASE = database  # migrated by this run's server: kept as the template once it answers
        return
    partial = database.with_name(f"{database.name}.{os.getpid()}.partial")
    shutil.copyfile(template, partial)
    os.replace(partial, database)


def keep_database_template() -> None:
    """A copy of the database this run's server has just migrated (no run recorded in it yet), written
    whole or not at all. Best effort: without it, the next new folder migrates its own."""
    template = database_template()
    if NEW_DATABASE is None or template is None or template.exists():
        return
    partial = template.with_name(f"{template.name}.{os.getpid()}.partial")
    try:
        template.parent.mkdir(parents=True, exist_ok=True)
        with closing(sqlite3.connect(f"file:{NEW_DATABASE}?mode=ro", uri=True)) as source, \
                closing(sqlite3.connect(partial)) as copy:
            source.backup(copy)
        os.replace(partial, template)
    except (OSError, sqlite3.Error) as e:
        partial.unlink(missing_ok=True)
        log.debug("no Prefect database template kept at %s: %s", template, e)


def start_run_server(home: Path) -> subprocess.Popen | None:
    """The run's temporary Prefect server, started here instead of by Prefect on first use, so that it
    runs in a session of its own: a terminal's Ctrl-C or a SIGTERM to the whole process group (systemd's
    default, KillMode=control-group) stops the run's processes but not the server, which the stopping
    run still needs to record its end (without it, Prefect's engine retries the gone server for a minute
    and then fails with a traceback). The server ends with this process however it ends: at exit, after
    a stop once the flow run is marked Cancelled (flows/stop.py), and through the kernel's parent-death
    signal where this process is killed outright (Linux). It runs the
    command Prefect's own temporary server runs (prefect.server.api.server.SubprocessASGIServer), its
    output in `home/server.log`.

    Returns once the server's process is started and PREFECT_API_URL names it, without waiting for it
    to answer: the caller imports the flow meanwhile (Prefect reads its settings at import; the server
    takes 5-13 s to start on 2 cores, the flow's imports 5 s), then calls wait_for_run_server. A new
    output folder's database is a copy of database_template's, where one was kept.
    None where the user named a server (PREFECT_API_URL) or Prefect is imported already (its settings,
    read at import, keep the server it has)."""
    if os.environ.get("PREFECT_API_URL") or "prefect" in sys.modules:
        return None
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
    home.mkdir(parents=True, exist_ok=True)
    seed_database(home)
    with (home / "server.log").open("ab") as output:
        server = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--factory", "prefect.server.api.server:create_app", "--host",
             "127.0.0.1", "--port", str(port), "--log-level", "error", "--lifespan", "on"],
            env=env, stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=end_with_parent)
    atexit.register(stop_server, server)
    global RUN_SERVER
    RUN_SERVER = server
    os.environ["PREFECT_API_URL"] = f"http://127.0.0.1:{port}/api"
    os.environ.setdefault("PREFECT_UI_URL", "")  # no UI on the run's server: no "View at" link answering 404
    return server


def wait_for_run_server(home: Path) -> None:
    """Until the server start_run_server started answers (nothing to wait for where it started none);
    RuntimeError, the server stopped, where it exits or does not answer in SERVER_START_TIMEOUT_S."""
    if RUN_SERVER is None:
        return
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if RUN_SERVER.poll() is not None:
            raise RuntimeError(f"the run's Prefect server exited at start (code {RUN_SERVER.returncode}): see "
                               f"{home / 'server.log'}")
        try:
            with urllib.request.urlopen(f"{os.environ['PREFECT_API_URL']}/health", timeout=2) as response:
                if response.status == 200:
                    keep_database_template()
                    return
        except OSError:
            pass
        time.sleep(0.2)
    stop_server(RUN_SERVER)
    raise RuntimeError(f"the run's Prefect server did not answer in {SERVER_START_TIMEOUT_S} s: see "
                       f"{home / 'server.log'}")


def end_with_parent() -> None:
    """In the server's process before it starts: SIGTERM when the process that started it dies."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the exit handler alone ends it
        pass


def stop_server(server: subprocess.Popen) -> None:
    if server.poll() is None:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
