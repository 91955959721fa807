"""The CLI as a process: SIGTERM to it alone (`kill PID`, systemd's KillMode=process, a container
runtime signalling PID 1) or SIGINT to its group (Ctrl-C) ends every process of the run within 10 s on
a loaded machine (a process spinning on every core beside it), the CLI's line says truly how long that
took, and the folder is let go; a streamed producer abandons the shard it was extracting; the next run
starts even when the Prefect database was damaged meanwhile."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import yaml
from flow_support import small_config, write_sample_data

from bench.fault_injection.stages import cpu_burner
from tasks.common.folder_lock import held_by_live_process

pytestmark = pytest.mark.system  # whole runs stopped beside a CPU burner: `make test` runs it, `make test-fast` does not

ROOT = Path(__file__).resolve().parents[2]
STOP_PROMISE_S = 10.0  # README and docs/RELIABILITY.md


def command_line(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.Error:  # gone, or a zombie not yet reaped by its parent
        return ""


def processes_of_run(out: Path) -> dict[int, psutil.Process]:
    """The processes of the run writing `out`, found by what names them: a command line holding the
    folder (workers, the trainer, producers: their job files there), or a Prefect server whose home
    is in it (the run's temporary server)."""
    found = {}
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if str(out) in command_line(process) or (
                    "prefect.server" in command_line(process)
                    and process.environ().get("PREFECT_HOME", "").startswith(str(out))):
                found[process.pid] = process
    return found


def gone(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE  # ended; its parent has not reaped it yet
    except psutil.NoSuchProcess:
        return True




def cli_environment() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    for name in ("PREFECT_HOME", "PREFECT_API_URL"):  # the CLI's own Prefect home and server, as a user gets
        env.pop(name, None)
    return env


def start_cli(config, tmp_path: Path) -> tuple[subprocess.Popen, list[str], Path]:
    """`eagle3-pipeline run` in a session of its own (its process group: what a terminal's Ctrl-C reaches)."""
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config.model_dump()))
    command = [sys.executable, "-m", "flows.cli", "run", str(tmp_path / "run.yaml")]
    log = tmp_path / "cli.log"
    with log.open("w") as f:
        cli = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, env=cli_environment(), cwd=ROOT,
                               start_new_session=True)
    return cli, command, log


def wait_for(cli: subprocess.Popen, log: Path, ready: Callable[[], bool], timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and cli.poll() is None and not ready():
        time.sleep(0.2)
    assert cli.poll() is None and ready(), log.read_text()[-3000:]


def stop_and_measure(cli: subprocess.Popen, out: Path, signum: int, group: bool) -> float:
    """`signum` to the CLI alone or to its whole process group, a CPU burner beside it: the seconds
    until the CLI and every process of its run (its descendants when the signal came, and whatever
    names the output folder) were gone, asserted within STOP_PROMISE_S, and the CLI's exit 128 + signal."""
    with cpu_burner():
        run = {p.pid: p for p in psutil.Process(cli.pid).children(recursive=True)} | processes_of_run(out)
        t0 = time.monotonic()
        if group:
            os.killpg(cli.pid, signum)
        else:
            cli.send_signal(signum)
        last_scan = t0
        while time.monotonic() - t0 < 3 * STOP_PROMISE_S:
            if time.monotonic() - last_scan > 0.5:  # anything of the run started meanwhile
                run |= processes_of_run(out)
                last_scan = time.monotonic()
            if cli.poll() is not None and all(gone(p) for p in run.values()):
                break
            time.sleep(0.02)
        took = time.monotonic() - t0
        alive = [command_line(p) for p in run.values() if not gone(p)]
        if cli.poll() is None:
            alive.append("the CLI")
    assert not alive and took <= STOP_PROMISE_S, f"after {took:.1f} s, alive: {alive}"
    assert cli.returncode == 128 + signum
    return took


def stated_stop_time(log: Path, signame: str) -> float:
    """The CLI's own line: 'stopped by SIGTERM: every process of the run ended after 1.3 s; ...'."""
    said = re.findall(rf"stopped by {signame}: every process of the run ended after ([\d.]+) s; run the same "
                      "command to resume", log.read_text())
    assert said, log.read_text()[-3000:]
    return float(said[-1])


def assert_stopped_politely(log: Path, signame: str, out: Path, took: float) -> None:
    said = stated_stop_time(log, signame)
    assert abs(said - took) <= 1.0, f"the CLI said {said} s, measured {took:.1f} s"  # its own exit right after
    assert "Traceback" not in log.read_text().split(f"stopped by {signame}")[-1]
    assert held_by_live_process(out) is False
    for stage_folder in out.glob("*/*"):
        if (stage_folder / ".lock").is_file():
            assert held_by_live_process(stage_folder) is False, stage_folder


def test_sigterm_to_the_cli_alone_during_training_ends_every_process_and_the_next_run_survives_a_damaged_database(
        sharegpt, tmp_path):
    data = write_sample_data(sharegpt, tmp_path / "chats.jsonl", 14)
    out = tmp_path / "out"
    config = small_config(out, data, train={"epochs": 200, "eval_every": 1})  # trains long past the signal
    cli, command, log = start_cli(config, tmp_path)
    try:
        wait_for(cli, log, lambda: bool(list(out.glob("train/*/checkpoints/step-*"))))  # the trainer is stepping
        assert any("tasks.train" in command_line(p) for p in psutil.Process(cli.pid).children(recursive=True))
        took = stop_and_measure(cli, out, signal.SIGTERM, group=False)  # to the CLI's process alone, not its group
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(cli.pid, signal.SIGKILL)
    assert_stopped_politely(log, "SIGTERM", out, took)

    # the database damaged while no run is on: the next run sets it aside, keeps the cache, and finishes
    database = out / ".prefect" / "prefect.db"
    for journal in database.parent.glob("prefect.db-*"):  # SQLite's write-ahead log would mask the damage
        journal.unlink()
    with database.open("r+b") as f:
        f.write(b"not a database" * 8)
    rerun = subprocess.run([*command, "--set", "train.max_steps=2"], capture_output=True, text=True,
                           env=cli_environment(), cwd=ROOT, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"the Prefect database {database} is damaged" in rerun.stderr
    assert list(database.parent.glob("prefect.db.damaged-*")) and database.is_file()
    assert '"from_cache": true' in rerun.stdout  # the task cache outlived the database


def test_sigterm_to_the_cli_alone_while_a_streamed_producer_extracts_abandons_its_shard(sharegpt, tmp_path):
    """Extraction streamed into training (extract.mode 'stream'): the producer has loaded the verifier
    and training has published the order it reads shards in, so the producer is extracting its first
    shard (several seconds of work even on a fast machine). It ends at once instead of finishing it."""
    data = write_sample_data(sharegpt, tmp_path / "chats.jsonl", 60)
    out = tmp_path / "out"
    config = small_config(out, data, data={"max_seq_len": 256},
                          extract={"mode": "stream", "stream_window": 2, "shard_tokens": 3000},
                          train={"epochs": 3, "shuffle_block_shards": 1})
    cli, _, log = start_cli(config, tmp_path)
    shards = out / "hidden_states"

    def producer_at_its_first_shard() -> bool:
        loads = [json.loads(line) for line in (shards / "progress" / "rank-0.jsonl").read_text().splitlines()
                 if line.startswith("{")] if (shards / "progress" / "rank-0.jsonl").is_file() else []
        loaded = any(e["stage"].startswith("load verifier") and e["done"] >= e["total"] for e in loads)
        return loaded and (shards / "stream" / "sequence.json").is_file()

    try:
        wait_for(cli, log, producer_at_its_first_shard)
        assert not list(shards.glob("shard-*.safetensors"))  # the first shard under way, none finished
        took = stop_and_measure(cli, out, signal.SIGTERM, group=False)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(cli.pid, signal.SIGKILL)
    assert_stopped_politely(log, "SIGTERM", out, took)
    assert not list(shards.glob("shard-*.safetensors")), "the producer finished its shard instead of abandoning it"
    # heard in its shard's forward pass (its watch thread's line) or, on a loaded machine, between blocks before
    # it began one (the whole suite beside a demo run, 2026-12-07): either way nothing of the shard was kept
    producer = (shards / "progress" / "rank-0.log").read_text()
    assert ("streamed extraction: stopped by the stage" in producer
            or "streamed extraction [0/1]: 0 shards produced" in producer), producer[-2000:]


def test_ctrl_c_to_the_whole_process_group_during_extraction_ends_every_process(sharegpt, tmp_path):
    """A terminal's Ctrl-C: SIGINT to every process of the group at once (the CLI, the extraction
    worker; the Prefect server runs in a session of its own), while the worker extracts."""
    out = tmp_path / "out"
    data = write_sample_data(sharegpt, tmp_path / "chats.jsonl", 160)
    config = small_config(out, data, data={"max_seq_len": 256})  # ~30k tokens: extraction takes a while
    cli, _, log = start_cli(config, tmp_path)
    progress = out / "hidden_states" / "progress" / "rank-0.jsonl"
    try:
        wait_for(cli, log, lambda: progress.is_file() and progress.stat().st_size > 0)  # the worker under way
        took = stop_and_measure(cli, out, signal.SIGINT, group=True)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(cli.pid, signal.SIGKILL)
    assert_stopped_politely(log, "SIGINT", out, took)
    assert not list(out.glob("train/*")), "stopped during extraction, training never began"


HUNG_RUN = """
import subprocess, sys, time
from flows.stop import Stopped, run_began, stop_on_signals
stop_on_signals()
child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                          "time.sleep(600)"])
run_began()
print("ready", flush=True)
while True:
    try:
        time.sleep(600)
    except Stopped:
        pass  # a stage that swallows the stop and never unwinds
"""


def test_a_run_that_does_not_unwind_is_ended_by_the_watchdog_within_the_promise(tmp_path):
    """The main thread never reaches the stop's end and its process ignores SIGTERM: the watchdog
    thread ends both, says so, and exits 143 within the promise."""
    run = subprocess.Popen([sys.executable, "-c", HUNG_RUN], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, env=cli_environment(), cwd=ROOT)
    assert run.stdout.readline() == "ready\n"
    child = psutil.Process(run.pid).children()[0]
    with cpu_burner():
        t0 = time.monotonic()
        run.send_signal(signal.SIGTERM)
        output = run.communicate(timeout=3 * STOP_PROMISE_S)[0]
        psutil.wait_procs([child], timeout=STOP_PROMISE_S)
        took = time.monotonic() - t0
    assert run.returncode == 128 + signal.SIGTERM and gone(child) and took <= STOP_PROMISE_S, (took, output)
    said = float(re.findall(r"every process of the run ended after ([\d.]+) s \(ended by force", output)[0])
    assert abs(said - took) <= 1.0, output
