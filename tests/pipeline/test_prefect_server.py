"""The deployments on a real `prefect server start`, a process worker and the UI in headless Chromium."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
import yaml
from flow_support import run_summary, small_config, write_sample_data
from pictures import colour_pixels
from prefect_stack import PrefectStack, chromium

from tasks.common.folder_lock import folder_lock, held_by_live_process
from tasks.common.plots import TRAIN, VAL
from tasks.prepare.chat_data import Dropped, read_rows

pytestmark = pytest.mark.system  # a Prefect server, a worker and whole runs: `make test` runs it, `make test-fast` does not

ROOT = Path(__file__).resolve().parents[2]
STAGES = ["prepare", "extract", "vocab", "train", "validate"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    stack = PrefectStack(home=tmp_path_factory.mktemp("prefect-server"), project=ROOT)
    try:
        stack.start()
        stack.cli("work-pool", "create", "eagle3", "--type", "process")
        stack.cli("concurrency-limit", "create", "gpu", "1")
        stack.cli("--no-prompt", "deploy", "--all")
        stack.spawn("worker", "worker", "start", "--pool", "eagle3")
        yield stack
    finally:
        stack.stop()
        for proc in stack.processes:
            assert proc.poll() is not None, f"process {proc.args[:3]} still running"


def deployment_run(stack: PrefectStack, name: str, config) -> tuple[str | None, str]:
    """The run created as a user creates it; its id and the command's output. Not `--watch`: that follows the
    run through Prefect's event stream, whose reconnection replays only the last 60 s of events, so a stall of
    the server or of the watching command for about a minute around the run's end loses the terminal event and
    the watch waits out its timeout on a run that has finished (seen here under load; wait_final asks the API)."""
    param = json.dumps(config if isinstance(config, dict) else config.model_dump(mode="json"))
    proc = stack.cli("deployment", "run", f"eagle3-draft/{name}", "--param", f"config={param}", check=False)
    output = proc.stdout + proc.stderr
    ids = [line.split()[-1] for line in output.splitlines() if "UUID:" in line]
    return (ids[0] if ids else None), output


def states(stack: PrefectStack, flow_run_id: str) -> dict[str, str]:
    runs = stack.post("/task_runs/filter", {"flow_runs": {"id": {"any_": [flow_run_id]}}})
    return {r["name"].rsplit("-", 1)[0]: r["state_name"] for r in runs}


def wait_final(stack: PrefectStack, flow_run_id: str) -> str:
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        try:
            run = stack.post("/flow_runs/filter", {"flow_runs": {"id": {"any_": [flow_run_id]}}})[0]
        except httpx.TimeoutException:  # the server's sqlite stalls for up to a minute under a run's writes
            continue  # ("database is locked" in its log): no answer yet, so ask again
        if run["state_type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            return run["state_name"]
        time.sleep(1)
    raise TimeoutError(why_not_final(stack, flow_run_id))


def why_not_final(stack: PrefectStack, flow_run_id: str) -> str:
    """What holds a run that has not ended: its state, the other unfinished runs of its deployment (one
    holding its concurrency slot), the concurrency limits' taken slots, its tasks, and the worker."""
    worker = stack.spawned["worker"]
    lines = [f"worker: {'alive' if worker.poll() is None else f'exited with status {worker.returncode}'}"]
    try:
        run = stack.post("/flow_runs/filter", {"flow_runs": {"id": {"any_": [flow_run_id]}}})[0]
        lines.append(f"flow run {flow_run_id}: {run['state_type']} {run['state_name']!r} "
                     f"({(run['state'] or {}).get('message')}), created {run['created']}, started {run['start_time']}")
        if run["deployment_id"]:
            body = {"deployments": {"id": {"any_": [run["deployment_id"]]}}, "flow_runs": {"state": {"type": {
                "any_": ["SCHEDULED", "PENDING", "RUNNING", "CANCELLING"]}}}}
            others = [f"{r['id']} {r['state_name']!r} (expected to start {r['expected_start_time']})"
                      for r in stack.post("/flow_runs/filter", body) if r["id"] != flow_run_id]
            lines.append(f"other unfinished runs of its deployment: {others or 'none'}")
        limits = stack.post("/v2/concurrency_limits/filter", {})
        lines.append("concurrency limits, slots taken: " + ", ".join(
            f"{limit['name']} {limit['active_slots']}/{limit['limit']}" for limit in limits))
        lines.append(f"its tasks: {states(stack, flow_run_id)}")
    except httpx.HTTPError as e:
        lines.append(f"the Prefect server did not answer: {e!r}")
    return "\n".join([*lines, "the worker's log ends:", stack.log("worker")[-3000:]])


def cli_run(config, cwd: Path) -> dict:
    """The CLI's run of the config, as a user starts it (its own Prefect server, none of the stack's
    settings); its summary."""
    config_file = cwd / "config.yaml"
    config_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    cli = subprocess.run([str(Path(sys.executable).parent / "eagle3-pipeline"), "run", str(config_file)],
                         capture_output=True, text=True, timeout=900, cwd=cwd,
                         env={k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")})
    assert cli.returncode == 0, cli.stderr[-3000:]
    return run_summary(cli.stdout)


@pytest.mark.browser
def test_deployment_runs_on_a_worker_then_is_cached_and_shows_in_the_ui(stack, sharegpt, tmp_path):
    """A deployment's run, then the CLI's run of the same config and a deployment's run again: one system,
    every stage a cache hit either way."""
    config = small_config(tmp_path / "out", write_sample_data(sharegpt, tmp_path / "chats.jsonl", 10),
                          train={"log_every": 1})  # a curve, not a dot
    first, output = deployment_run(stack, "eagle3-train", config)
    assert first and wait_final(stack, first) == "Completed", output
    assert states(stack, first) == {s: "Completed" for s in STAGES}
    assert (tmp_path / "out" / "train").is_dir()  # the worker ran the real pipeline

    summary = cli_run(config, tmp_path)
    assert all(summary[key]["from_cache"] for key in ("prepared", "extracted", "vocab", "trained", "validated"))

    second, output = deployment_run(stack, "eagle3-train", config)
    assert second and wait_final(stack, second) == "Completed", output
    assert states(stack, second) == {s: "Cached" for s in STAGES}

    url = f"http://127.0.0.1:{stack.port}/v2/runs/flow-run/{first}?tab=TaskRuns"
    dom = chromium(url, "--dump-dom").stdout
    assert all(f">{stage}-" in dom or f"{stage}-" in dom for stage in STAGES), dom[-2000:]
    assert "smollm2-135m-instruct on chats.jsonl" in dom  # the run name says which verifier and data
    png = tmp_path / "flow-run.png"
    chromium(url, f"--screenshot={png}")
    assert png.stat().st_size > 20_000

    # the pictures: image artifacts of the first run, drawn in both UIs (the default at /, the new one at /v2)
    body = {"artifacts": {"flow_run_id": {"any_": [first]}, "type": {"any_": ["image"]}}}
    pictures = {a["key"]: a["id"] for a in stack.post("/artifacts/filter", body)}
    assert set(pictures) == {"extraction-rate", "training-curves", "draft-acceptance-per-position"}
    base = f"http://127.0.0.1:{stack.port}"
    for ui, url in (("default", f"{base}/artifacts/artifact/{pictures['training-curves']}"),
                    ("v2", f"{base}/v2/artifacts/artifact/{pictures['training-curves']}")):
        png = tmp_path / f"training-curves-{ui}-ui.png"
        chromium(url, f"--screenshot={png}")
        # the curves' own colours on screen: the picture is drawn, not a broken-image icon
        assert colour_pixels(png, TRAIN) > 200 and colour_pixels(png, VAL) > 30, (ui, png)


def test_invalid_parameters_are_rejected_when_the_run_is_created(stack, tmp_path):
    config = small_config(tmp_path, tmp_path / "x.jsonl").model_dump(mode="json")
    config["train"]["lr"] = -1
    flow_run, output = deployment_run(stack, "eagle3-train", config)
    assert flow_run is None
    assert "config.train.lr" in output and "minimum" in output


def test_prefect_yaml_deployments_and_presets(stack):
    deployments = stack.post("/deployments/filter", {})
    by_name = {d["name"]: d for d in deployments}
    assert set(by_name) >= {"eagle3-train", "eagle3-retrain"}
    assert "PipelineConfig" in json.dumps(by_name["eagle3-train"]["parameter_openapi_schema"])
    project = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    presets = project["definitions"]["presets"]
    assert presets["demo"] == yaml.safe_load((ROOT / "deployments" / "demo.yaml").read_text())
    assert presets["retrain_demo"] == yaml.safe_load((ROOT / "deployments" / "retrain-demo.yaml").read_text())
    # the nightly schedule really creates runs (it never does with SQLAlchemy 2.1 under Prefect 3.7.7)
    body = {"deployments": {"id": {"any_": [by_name["eagle3-retrain"]["id"]]}},
            "flow_runs": {"state": {"type": {"any_": ["SCHEDULED"]}}}}
    deadline, scheduled = time.monotonic() + 60, 0
    while time.monotonic() < deadline and not scheduled:
        scheduled = stack.post("/flow_runs/count", body)
        time.sleep(1)
    assert scheduled >= 1
    without_the_nightly_runs(stack, "eagle3-retrain")  # none of them runs the demo preset in this project folder


def test_a_cancel_from_the_ui_ends_every_process_of_the_run_and_marks_it_cancelled(stack, sharegpt, tmp_path):
    """What the UI's Cancel button does (the flow run set to Cancelling): the process worker sends the
    flow run's process SIGTERM; the trainer and every other process of the run end with it, the run
    ends Cancelled and the output folder is free for the next run."""
    out = tmp_path / "out"
    config = small_config(out, write_sample_data(sharegpt, tmp_path / "chats.jsonl", 14),
                          train={"epochs": 200, "eval_every": 5})  # trains long past the cancel
    param = json.dumps(config.model_dump(mode="json"))
    started = stack.cli("deployment", "run", "eagle3-draft/eagle3-train", "--param", f"config={param}")
    flow_run = next(line.split()[-1] for line in started.stdout.splitlines() if "UUID:" in line)

    deadline, trainer = time.monotonic() + 600, None
    while time.monotonic() < deadline and trainer is None:
        trainer = next((p for p in psutil.process_iter(["cmdline"])
                        if "tasks.train.loop" in " ".join(p.info["cmdline"] or []) and str(out) in " ".join(
                            p.info["cmdline"] or []) and list(out.glob("train/*/checkpoints/step-*"))), None)
        time.sleep(1)
    assert trainer is not None, stack.log("worker")[-3000:]
    # the flow run's own process (the worker's child) and everything under it
    run_process = next(p for p in [trainer, *trainer.parents()] if p.parent() and "worker" in " ".join(
        p.parent().cmdline()))
    run_tree = [run_process, *run_process.children(recursive=True)]

    cancelled_at = time.monotonic()
    stack.post(f"/flow_runs/{flow_run}/set_state", {"state": {"type": "CANCELLING", "name": "Cancelling"},
                                                     "force": True})
    _, alive = psutil.wait_procs(run_tree, timeout=60)
    took = time.monotonic() - cancelled_at
    assert not alive, [" ".join(p.cmdline()) for p in alive]
    # the worker looks for cancels every PREFECT_WORKER_QUERY_SECONDS (1 s here), sends the run's process SIGTERM
    # and SIGKILLs it alone 30 s later: every process gone before then ended on the SIGTERM, the trainer with it.
    # (Measured to the last process's end, not to the Cancelled state: the worker records that only after it has
    # imported the flow's module to look for on_cancellation hooks: 16 s on 2 cores at load 16.)
    assert took < 30, took
    assert wait_final(stack, flow_run) == "Cancelled"
    for stage_folder in (next(out.glob("hidden_states")), next(out.glob("train/*"))):
        assert held_by_live_process(stage_folder) is False, stage_folder  # free for the next run
    # the stage the cancel interrupted is recorded by Prefect's task engine as Crashed ("Execution was
    # aborted by an interrupt signal"), those before it as they ended
    assert states(stack, flow_run) == {"prepare": "Completed", "extract": "Completed", "vocab": "Completed",
                                       "train": "Crashed"}


def without_the_nightly_runs(stack: PrefectStack, deployment: str) -> None:
    """The deployment's schedule paused and the runs it created gone: at 03:00 UTC its nightly run of the
    demo preset would otherwise hold the deployment's one slot (concurrency_limit: 1) for minutes."""
    found = next(d for d in stack.post("/deployments/filter", {}) if d["name"] == deployment)
    with stack.http as http:
        for schedule in http.get(f"/deployments/{found['id']}/schedules").json():
            http.patch(f"/deployments/{found['id']}/schedules/{schedule['id']}", json={"active": False})
        body = {"deployments": {"id": {"any_": [found["id"]]}}, "flow_runs": {"state": {"type": {"any_": [
            "SCHEDULED", "PENDING", "RUNNING"]}}}}
        for run in http.post("/flow_runs/filter", json=body).json():
            if run["state_type"] == "RUNNING":
                stack.post(f"/flow_runs/{run['id']}/set_state", {"state": {"type": "CANCELLING"}, "force": True})
                wait_final(stack, run["id"])
            else:
                http.delete(f"/flow_runs/{run['id']}")


def test_the_retrain_deployment_does_only_the_new_work_and_promotes(stack, sharegpt, tmp_path):
    """Two runs of `eagle3-retrain` through the server and the process worker: the first trains a draft
    and makes it version 1; a file dropped into the incoming folder, the second extracts only its
    conversations, warm-starts from version 1 with a replay share of the old samples, and promotes version 2."""
    without_the_nightly_runs(stack, "eagle3-retrain")
    out, incoming = tmp_path / "out", tmp_path / "incoming"
    incoming.mkdir()
    rows = [r.data for r in read_rows([sharegpt], 40) if not isinstance(r.data, Dropped)]
    (tmp_path / "base.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:12]))
    config = small_config(out, tmp_path / "base.jsonl", data={"sources": [str(tmp_path / "base.jsonl"), str(incoming)]},
                          train={"init_from": "previous", "epochs": 2}, retrain={"when": "always"},
                          registry={"promote": True}).model_dump(mode="json")

    first, output = deployment_run(stack, "eagle3-retrain", config)
    assert first and wait_final(stack, first) == "Completed", output
    assert states(stack, first) == {**{s: "Completed" for s in STAGES}, "promote": "Completed"}
    registry = out / "registry" / "test"
    assert (registry / "current").resolve().name == "1"

    (incoming / "new.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[12:16]))
    second, output = deployment_run(stack, "eagle3-retrain", config)
    assert second and wait_final(stack, second) == "Completed", output
    assert states(stack, second) == {**{s: "Completed" for s in STAGES}, "promote": "Completed"}
    record = json.loads(max((out / "runs").glob("*.json"), key=lambda p: p.stat().st_mtime).read_text())
    assert record["flow_run_id"] == second
    extracted, trained = record["results"]["extracted"], record["results"]["trained"]
    first_record = json.loads(min((out / "runs").glob("*.json"), key=lambda p: p.stat().st_mtime).read_text())
    old_samples = first_record["results"]["extracted"]["samples_extracted"]
    # only the new conversations were extracted; every earlier sample was read from the first run's shards
    assert extracted["samples_reused"] == old_samples and 0 < extracted["samples_extracted"] <= 4
    # warm-started from version 1, on the new samples and a replay share of the old ones: fewer steps
    assert trained["init_from"] == str((registry / "versions" / "1" / "draft").resolve())
    assert 0 < trained["new_samples"] <= extracted["samples_extracted"] and trained["replayed_samples"] < old_samples
    assert trained["steps"] < first_record["results"]["trained"]["steps"]
    assert (registry / "current").resolve().name == "2"
    lineage = json.loads((registry / "versions" / "2" / "lineage.json").read_text())
    assert lineage["parent"] == "version 1"


def test_a_deployment_run_on_a_busy_folder_fails_at_once(stack, sharegpt, tmp_path):
    """A deployment's run on a folder another run holds fails in its first seconds, not retried, as the CLI
    refuses it (that a deployment's run and a CLI run share one cache: the first test)."""
    out = tmp_path / "out"
    config = small_config(out, write_sample_data(sharegpt, tmp_path / "chats.jsonl", 6))
    out.mkdir()
    with folder_lock(out, "a test standing in for another run"):
        started = time.monotonic()
        busy, output = deployment_run(stack, "eagle3-train", config)
        assert busy and wait_final(stack, busy) == "Failed", output
        took = time.monotonic() - started
    assert states(stack, busy) == {}, "no stage ran on the busy folder"
    run = stack.post("/flow_runs/filter", {"flow_runs": {"id": {"any_": [busy]}}})[0]
    assert run["run_count"] == 1 and "in use by another" in run["state"]["message"], run["state"]
    assert took < 120, took  # the worker's start of the flow process included; no stage, no retry
