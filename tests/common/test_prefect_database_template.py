"""A new output folder's Prefect database starts as a copy of a migrated, empty one kept per Prefect
version (flows/prefect_env.py), the run's server then starting in about half the time."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from contextlib import closing
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# the CLI's start of the run's server, in a process of its own (it starts none where Prefect is imported);
# then what the server answers about block types (written at its start) and flow runs
START = """
import json, sys, urllib.request
from flows.prefect_env import use_private_prefect_home, start_run_server, wait_for_run_server
home = use_private_prefect_home(sys.argv[1])
start_run_server(home)
wait_for_run_server(home)
import os
api = os.environ["PREFECT_API_URL"]
def count(what):
    request = urllib.request.Request(f"{api}/{what}/filter", data=b"{}", method="POST",
                                     headers={"Content-Type": "application/json"})
    return len(json.load(urllib.request.urlopen(request, timeout=30)))
print(json.dumps({"block_types": count("block_types"), "flow_runs": count("flow_runs")}))
"""


def start_server(output: Path, cache: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    done = subprocess.run([sys.executable, "-c", START, str(output)], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env={**env, "XDG_CACHE_HOME": str(cache), "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def query(database: Path, sql: str):
    """One statement's first row, the connection closed after it (in WAL mode, as Prefect's database is,
    the last connection's close writes its changes into the file that is copied)."""
    with closing(sqlite3.connect(database)) as db:
        return db.execute(sql).fetchone()


def mark(database: Path) -> int:  # SQLite's user_version, which neither Prefect nor its migrations use
    return query(database, "PRAGMA user_version")[0]


@pytest.mark.system  # four starts of a Prefect server: about 30 s
def test_a_new_folder_starts_from_the_kept_template_and_an_old_one_is_never_kept(tmp_path):
    cache = tmp_path / "cache"
    first = start_server(tmp_path / "a", cache)  # no template yet: this server migrates, its database is kept
    templates = list((cache / "eagle3-pipeline").glob("prefect-*.db"))
    assert len(templates) == 1 and not list(templates[0].parent.glob("*.partial")), templates
    template = templates[0]
    assert first["block_types"] > 0 and first["flow_runs"] == 0
    assert query(template, "SELECT count(*) FROM flow_run") == (0,)
    query(template, "PRAGMA user_version = 7")

    second = start_server(tmp_path / "b", cache)  # a copy of it: a server that answers as the first did
    assert second == first and mark(tmp_path / "b" / ".prefect" / "prefect.db") == 7

    # a template damaged on disk since is not copied: this folder migrates its own, kept as the new template
    template.write_bytes(template.read_bytes()[:4096] + b"\xff" * 8192)
    assert start_server(tmp_path / "c", cache) == first
    assert mark(tmp_path / "c" / ".prefect" / "prefect.db") == 0 and mark(template) == 0
    assert query(template, "SELECT count(*) FROM flow_run") == (0,) and query(template, "PRAGMA quick_check") == ("ok",)

    # a folder with a database of its own (its run history) is never made the template
    template.unlink()
    assert start_server(tmp_path / "b", cache) == first
    assert not template.exists()
