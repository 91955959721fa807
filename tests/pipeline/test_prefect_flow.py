"""The flow under real Prefect (ephemeral API): content caching, retries, surviving a killed worker."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
import yaml
from flow_support import run_summary, small_config, task_states, write_sample_data

from tasks.vocab import vocab_fingerprint

STAGES = {"prepare", "extract", "vocab", "train", "validate"}


@pytest.fixture(scope="module")
def workspace(sharegpt, tmp_path_factory):
    root = tmp_path_factory.mktemp("flow")
    return root, write_sample_data(sharegpt, root / "chats.jsonl", 14)


def run(config):
    from flows.pipeline import eagle3_pipeline

    state = eagle3_pipeline(config, return_state=True)
    assert state.is_completed(), state
    return state.result(), task_states(state.state_details.flow_run_id)


def use_cli_prefect_env(monkeypatch, tmp_path) -> None:
    """What the CLI sets up (it keeps Prefect's files under the outputs), undone after the test."""
    for name in ("PREFECT_HOME", "PREFECT_RESULTS_LOCAL_STORAGE_PATH", "PREFECT_SERVER_MEMO_STORE_PATH"):
        monkeypatch.setenv(name, str(tmp_path / "prefect-home" / name.lower()))


@pytest.mark.system  # four whole runs: `make test` runs it, `make test-fast` does not
def test_rerun_is_all_cached_and_edited_data_reruns_what_depends_on_it(prefect_api, workspace, monkeypatch, capsys,
                                                                       tmp_path):
    from flows.cli import main

    root, data = workspace
    config = small_config(root / "out", data)
    first, states = run(config)
    assert {name: s for name, (s, _) in states.items()} == {name: "Completed" for name in STAGES}
    assert first["extracted"].verifier_loaded

    second, states = run(config)
    assert {name: s for name, (s, _) in states.items()} == {name: "Cached" for name in STAGES}
    assert second["trained"].draft_path == first["trained"].draft_path

    # the CLI's summary of a cached run says so, with absolute paths and the verifier folder
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config.model_dump()))
    use_cli_prefect_env(monkeypatch, tmp_path)
    capsys.readouterr()
    assert main(["run", str(tmp_path / "run.yaml")]) == 0
    out = capsys.readouterr().out
    summary = run_summary(out)
    assert summary["verifier"].endswith("smollm2-135m-instruct") and Path(summary["verifier"]).is_dir()
    assert all(summary[key]["from_cache"] for key in ("prepared", "extracted", "vocab", "trained", "validated"))
    assert summary["extracted"]["manifest"] == first["extracted"].manifest
    assert Path(summary["extracted"]["manifest"]).is_absolute()

    # a copied output folder runs from its own contents, the original out of reach meanwhile: a cache miss
    # (the keys hold the output folder, so a hit never hands back another folder's paths) whose stages find
    # their fingerprinted outputs in the copy and redo nothing
    original, copy = root / "out", root / "copy"
    shutil.copytree(original, copy)
    original.rename(root / "out-away")
    try:
        copied, states = run(config.model_copy(update={"output_dir": str(copy)}))
    finally:
        (root / "out-away").rename(original)
    assert {name: s for name, (s, _) in states.items()} == {name: "Completed" for name in STAGES}
    assert not copied["extracted"].verifier_loaded and copied["extracted"].shards_extracted == 0
    assert copied["trained"].trained_tokens == 0
    for path in (copied["prepared"].path, copied["extracted"].manifest, copied["vocab"].path,
                 copied["trained"].draft_path):
        assert Path(path).is_relative_to(copy), path
    draft, original_draft = Path(copied["trained"].draft_path), Path(first["trained"].draft_path)
    assert (draft / "model.safetensors").read_bytes() == (original_draft / "model.safetensors").read_bytes()

    with data.open("a") as f:  # one more conversation arrives
        f.write(json.dumps({"conversations": [{"from": "human", "value": "Name three primary colors."},
                                              {"from": "gpt", "value": "Red, yellow and blue."}]}) + "\n")
    third, states = run(config)
    assert {name: s for name, (s, _) in states.items()} == {name: "Completed" for name in STAGES}
    extracted = third["extracted"]
    assert extracted.samples == first["extracted"].samples + 1
    assert 0 < extracted.shards_extracted < extracted.shards  # earlier shards were reused, not redone


def test_a_streamed_run_keeping_its_shards_is_an_offline_run_cache_hit(prefect_api, workspace, tmp_path):
    """extract.mode 'stream' through the flow, with extract.stream_cache_epochs: the extract task hands
    training the shards to come, the train task extracts them beside training, once (the second epoch
    reads them) and keeps them; the same settings offline then find every shard on disk, and training
    is a cache hit (the mode is no part of its key: it is the same draft). Releasing and deleting
    shards as training moves on: tests/train/test_stream.py."""
    _, data = workspace
    train = {"shuffle_block_shards": 1, "epochs": 2}
    streamed, states = run(small_config(tmp_path / "out", data, train=train,
                                        extract={"mode": "stream", "stream_window": 2, "stream_cache_epochs": True}))
    assert {name: s for name, (s, _) in states.items()} == {name: "Completed" for name in STAGES}
    extracted, trained = streamed["extracted"], streamed["trained"]
    assert extracted.streamed and trained.stream["shards_produced"] == extracted.shards
    assert trained.stream["shards_deleted"] == 0

    offline, states = run(small_config(tmp_path / "out", data, train=train))
    assert states["extract"][0] == "Completed" and states["train"][0] == "Cached", states
    assert offline["extracted"].shards_extracted == 0 and not offline["extracted"].streamed
    assert offline["trained"].draft_path == trained.draft_path


@pytest.mark.system  # three whole runs: `make test` runs it, `make test-fast` does not
def test_damage_found_after_a_cached_run_is_repaired_by_the_same_command(prefect_api, workspace):
    """A shard flipped in place (size and mtime kept, so only its checksum tells), then a changed
    training setting: training finds it, fails naming it, and the same command again extracts that
    shard again, though the extraction was cached. A vocabulary file deleted later is rebuilt likewise, and
    a validation report deleted is written again.
    The module's run folder (cached by the first test, when it ran; repaired here by the end)."""
    from flows.pipeline import eagle3_pipeline

    root, data = workspace
    config = small_config(root / "out", data)
    first, _ = run(config)
    manifest = Path(first["extracted"].manifest)
    shard = manifest.parent / json.loads(manifest.read_text())["shards"][-1]["name"]  # the folder holds others
    stat, blob = shard.stat(), bytearray(shard.read_bytes())
    blob[-10] ^= 0xFF
    shard.write_bytes(bytes(blob))
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))

    changed = config.model_copy(update={"train": config.train.model_copy(update={"seed": 1})})
    state = eagle3_pipeline(changed, return_state=True)
    assert state.is_failed()
    with pytest.raises(Exception, match=f"{shard.name}.*damaged.*moved aside.*run the same command again"):
        state.result()
    assert (shard.parent / f"{shard.name}.damaged").is_file()
    second, states = run(changed)
    assert states["extract"][0] == "Completed" and second["extracted"].shards_extracted == 1
    assert shard.read_bytes() != bytes(blob) and second["extracted"].manifest == first["extracted"].manifest

    (Path(second["vocab"].path) / "d2t.npy").unlink()
    third, states = run(changed.model_copy(update={"train": changed.train.model_copy(update={"seed": 2})}))
    assert states["vocab"][0] == "Completed" and states["extract"][0] == "Cached"
    assert (Path(third["vocab"].path) / "d2t.npy").is_file() and third["vocab"].fingerprint == first["vocab"].fingerprint

    # a validation report gone (the summary names it, the registry reads it): validated again, nothing else
    report = Path(third["validated"].report_json)
    report.unlink()
    seed_2 = changed.model_copy(update={"train": changed.train.model_copy(update={"seed": 2})})
    fourth, states = run(seed_2)
    assert states["validate"][0] == "Completed" and states["train"][0] == "Cached", states
    assert report.is_file() and fourth["validated"].report_json == str(report)
    _, states = run(seed_2)  # the cache's record names the report written anew: a hit again
    assert {name: s for name, (s, _) in states.items()} == {name: "Cached" for name in STAGES}, states


@pytest.mark.system  # a whole run retried: `make test` runs it, `make test-fast` does not
def test_transient_failure_succeeds_on_retry(prefect_api, workspace):
    """The vocab output folder is blocked (as by a stale mount) until the first attempt failed."""
    from prefect import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterName

    from flows.pipeline import eagle3_pipeline

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
                # a task run can be read before its first state is recorded (state None)
                if any(r.state is not None and r.state.name == "AwaitingRetry" for r in runs):
                    blocked.unlink()
                    released.set()
                time.sleep(0.2)

    watcher = threading.Thread(target=release_after_first_failure, daemon=True)
    watcher.start()
    state = eagle3_pipeline(config, return_state=True)
    watcher.join(timeout=5)
    assert released.is_set() and state.is_completed()
    assert task_states(state.state_details.flow_run_id)["vocab"] == ("Completed", 2)


@pytest.mark.system  # a whole run with a kill: `make test` runs it, `make test-fast` does not
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
            workers = [p for p in psutil.process_iter(["cmdline"])
                       if "tasks.extract.stage" in " ".join(p.info["cmdline"] or [])]
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


def test_deterministic_worker_error_fails_at_once_and_reaches_the_cli(prefect_api, workspace, smollm2, tmp_path,
                                                                      monkeypatch, capsys):
    """A wrapper whose language model transformers does not know passes every check that needs no
    model, then fails in the extraction worker: the task fails on its first attempt with the
    worker's exception, and the CLI says so in one line and exits 2."""
    from prefect import get_client
    from prefect.client.schemas.sorting import FlowRunSort

    from flows.cli import main

    _, data = workspace
    verifier = tmp_path / "unknown-language-model"
    verifier.mkdir()
    for f in Path(smollm2).iterdir():
        if f.name != "config.json":
            os.symlink(f, verifier / f.name)
    text = json.loads((Path(smollm2) / "config.json").read_text())
    (verifier / "config.json").write_text(json.dumps({"architectures": ["FooForConditionalGeneration"],
                                                      "model_type": "foo", "text_config": {**text, "model_type": "foo_text"}}))
    config = small_config(tmp_path / "out", data, verifier={"path": str(verifier)})
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config.model_dump()))
    use_cli_prefect_env(monkeypatch, tmp_path)

    assert main(["run", str(tmp_path / "run.yaml")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "extract failed (not retried" in errors[0], errors
    assert "VerifierError: " in errors[0] and "does not know the language model" in errors[0]
    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_runs(sort=FlowRunSort.START_TIME_DESC, limit=1)[0]
    states = task_states(flow_run.id)
    assert states["prepare"][0] == "Completed" and states["extract"] == ("Failed", 1)
    with get_client(sync_client=True) as client:
        extract = next(r for r in client.read_task_runs() if r.flow_run_id == flow_run.id and r.name.startswith("extract"))
    assert "VerifierError" in extract.state.message and "foo_text" in extract.state.message


def test_a_completed_run_whose_state_comes_back_without_its_results_still_ends_done(prefect_api, tmp_path, capsys):
    """Prefect once handed the CLI a completed flow run's state without its data (after its
    database was locked for a minute): `state.result()` raised MissingResult and a finished run
    crashed. The server's own copy of a completed state carries no data either: given that, the
    CLI says the summary is missing and how to get it, and exits 0."""
    from prefect import flow, get_client

    from flows.cli import run_flow

    @flow(persist_result=False)
    def finished(config):
        return {"trained": None}

    def pipeline(config, return_state):
        state = finished(config, return_state=True)
        with get_client(sync_client=True) as client:
            return client.read_flow_run(state.state_details.flow_run_id).state  # completed, data None

    config = small_config(tmp_path / "out", tmp_path / "unused.jsonl")
    assert run_flow(pipeline, config, config, tmp_path / "out", tmp_path, tmp_path / "run.log") == 0
    err = capsys.readouterr().err
    assert "every stage completed, but Prefect returned the run's final state without its results" in err
