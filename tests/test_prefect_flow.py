"""The flow under real Prefect (ephemeral API): content caching, retries, surviving a killed worker."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import psutil
import pytest

from flow_support import small_config, task_states, write_sample_data
from tasks.vocab import vocab_fingerprint

STAGES = {"prepare", "extract", "vocab", "train", "validate"}


@pytest.fixture(scope="module")
def prefect_api(tmp_path_factory):
    from prefect.testing.utilities import prefect_test_harness

    home = tmp_path_factory.mktemp("prefect-home")
    os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    with prefect_test_harness(server_startup_timeout=120):
        yield home


@pytest.fixture(scope="module")
def workspace(sharegpt, tmp_path_factory):
    root = tmp_path_factory.mktemp("flow")
    return root, write_sample_data(sharegpt, root / "chats.jsonl", 14)


def run(config):
    from flows.pipeline import eagle3_pipeline

    state = eagle3_pipeline(config, return_state=True)
    assert state.is_completed(), state
    return state.result(), task_states(state.state_details.flow_run_id)


def test_rerun_is_all_cached_and_edited_data_reruns_what_depends_on_it(prefect_api, workspace):
    root, data = workspace
    config = small_config(root / "out", data)
    first, states = run(config)
    assert {name: s for name, (s, _) in states.items()} == {name: "Completed" for name in STAGES}
    assert first["extracted"].verifier_loaded

    second, states = run(config)
    assert {name: s for name, (s, _) in states.items()} == {name: "Cached" for name in STAGES}
    assert second["trained"].draft_path == first["trained"].draft_path

    with data.open("a") as f:  # one more conversation arrives
        f.write(json.dumps({"conversations": [{"from": "human", "value": "Name three primary colors."},
                                              {"from": "gpt", "value": "Red, yellow and blue."}]}) + "\n")
    third, states = run(config)
    assert {name: s for name, (s, _) in states.items()} == {name: "Completed" for name in STAGES}
    extracted = third["extracted"]
    assert extracted.samples == first["extracted"].samples + 1
    assert 0 < extracted.shards_extracted < extracted.shards  # earlier shards were reused, not redone


def test_transient_failure_succeeds_on_retry(prefect_api, workspace):
    """The vocab output folder is blocked (as by a stale mount) until the first attempt failed."""
    from flows.pipeline import eagle3_pipeline
    from prefect import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterName

    root, data = workspace
    config = small_config(root / "out", data, vocab={"draft_vocab_size": 256})
    prepared = run(small_config(root / "out", data))[0]["prepared"]  # cached: just its fingerprint
    blocked = root / "out" / "vocab" / vocab_fingerprint(prepared.fingerprint, 256, 49152)[:16]
    blocked.parent.mkdir(parents=True, exist_ok=True)
    blocked.write_text("not a folder")
    released = threading.Event()

    def release_after_first_failure():
        with get_client(sync_client=True) as client:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and not released.is_set():
                runs = client.read_task_runs(task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_="vocab")))
                if any(r.state.name == "AwaitingRetry" for r in runs):
                    blocked.unlink()
                    released.set()
                time.sleep(0.2)

    watcher = threading.Thread(target=release_after_first_failure, daemon=True)
    watcher.start()
    state = eagle3_pipeline(config, return_state=True)
    watcher.join(timeout=5)
    assert released.is_set() and state.is_completed()
    assert task_states(state.state_details.flow_run_id)["vocab"] == ("Completed", 2)


def test_extraction_worker_killed_mid_run_retries_and_resumes(prefect_api, workspace):
    root, data = workspace
    config = small_config(root / "out", data, extract={"aux_layers": [3, 14, 26]})
    journal = root / "out" / "hidden_states" / "journal"
    killed = []

    def kill_worker_after_first_shard():
        journal_lines = lambda: sum(len(p.read_text().splitlines()) for p in journal.glob("*.jsonl"))  # noqa: E731
        before = journal_lines() if journal.is_dir() else 0
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not killed:
            workers = [p for p in psutil.process_iter(["cmdline"]) if "tasks.extract" in " ".join(p.info["cmdline"] or [])]
            if workers and journal.is_dir() and journal_lines() > before:
                os.kill(workers[0].pid, signal.SIGKILL)
                killed.append(workers[0].pid)
            time.sleep(0.05)

    watcher = threading.Thread(target=kill_worker_after_first_shard, daemon=True)
    watcher.start()
    result, states = run(config)
    watcher.join(timeout=5)
    assert killed, "the extraction worker finished before it could be killed"
    assert states["extract"] == ("Completed", 2)
    extracted = result["extracted"]
    assert 0 < extracted.shards_extracted < extracted.shards  # the retry kept the shards written before the kill
    assert extracted.layers == [3, 14, 26, 30]
