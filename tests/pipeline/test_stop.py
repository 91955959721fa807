"""The CLI as a process: SIGTERM to it alone (`kill PID`, systemd's KillMode=process, a container
runtime signalling PID 1) ends every process of the run and lets go of the folder; the next run
starts even when the Prefect database was damaged meanwhile."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import yaml
from flow_support import small_config, write_sample_data

from tasks.common.folder_lock import held_by_live_process

ROOT = Path(__file__).resolve().parents[2]


def command_line(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.Error:  # gone, or a zombie not yet reaped by its parent
        return ""


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


def stop_and_wait(cli: subprocess.Popen, signum: int, group: bool) -> None:
    """`signum` to the CLI alone or to its whole process group: the CLI exits 128 + the signal, and
    every process of its run (the trainer or workers, Prefect's server, ...) ends."""
    run_tree = psutil.Process(cli.pid).children(recursive=True)
    if group:
        os.killpg(cli.pid, signum)
    else:
        cli.send_signal(signum)
    assert cli.wait(timeout=60) == 128 + signum
    _, alive = psutil.wait_procs(run_tree, timeout=30)
    assert not alive, [command_line(p) for p in alive]


def assert_stopped_politely(log: Path, signame: str, out: Path) -> None:
    text = log.read_text()
    assert f"stopped by {signame}: every process of the run ended" in text and "run the same command to resume" in text
    assert "Traceback" not in text.split(f"stopped by {signame}")[-1]
    assert held_by_live_process(out) is False
    for stage_folder in out.glob("*/*"):
        if (stage_folder / ".lock").is_file():
            assert held_by_live_process(stage_folder) is False, stage_folder


def test_sigterm_to_the_cli_alone_ends_every_process_and_the_next_run_survives_a_damaged_database(
        sharegpt, tmp_path):
    data = write_sample_data(sharegpt, tmp_path / "chats.jsonl", 14)
    out = tmp_path / "out"
    config = small_config(out, data, train={"epochs": 200, "eval_every": 5})  # trains long past the signal
    cli, command, log = start_cli(config, tmp_path)
    env = cli_environment()
    try:
        deadline, trainer = time.monotonic() + 600, None
        while time.monotonic() < deadline and cli.poll() is None:
            children = psutil.Process(cli.pid).children(recursive=True)
            trainer = next((p for p in children if "tasks.train" in command_line(p)), None)
            if trainer is not None and list(out.glob("train/*/checkpoints/step-*")):
                break
            time.sleep(1)
        assert trainer is not None and cli.poll() is None, log.read_text()[-3000:]
        stop_and_wait(cli, signal.SIGTERM, group=False)  # to the CLI's process alone, not its group
    finally:
        if cli.poll() is None or psutil.pid_exists(cli.pid):
            os.killpg(cli.pid, signal.SIGKILL)
    assert_stopped_politely(log, "SIGTERM", out)
    assert held_by_live_process(next(out.glob("train/*"))) is False

    # the database damaged while no run is on: the next run sets it aside, keeps the cache, and finishes
    database = out / ".prefect" / "prefect.db"
    for journal in database.parent.glob("prefect.db-*"):  # SQLite's write-ahead log would mask the damage
        journal.unlink()
    with database.open("r+b") as f:
        f.write(b"not a database" * 8)
    rerun = subprocess.run([*command, "--set", "train.max_steps=6"], capture_output=True, text=True, env=env,
                           cwd=ROOT, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"the Prefect database {database} is damaged" in rerun.stderr
    assert list(database.parent.glob("prefect.db.damaged-*")) and database.is_file()
    assert '"from_cache": true' in rerun.stdout  # the task cache outlived the database


def test_ctrl_c_to_the_whole_process_group_during_extraction_ends_every_process(sharegpt, tmp_path):
    """A terminal's Ctrl-C: SIGINT to every process of the group at once (the CLI, its Prefect server,
    the extraction worker), while the worker extracts."""
    out = tmp_path / "out"
    data = write_sample_data(sharegpt, tmp_path / "chats.jsonl", 160)
    config = small_config(out, data, data={"max_seq_len": 256})  # ~30k tokens: extraction takes a while
    cli, _, log = start_cli(config, tmp_path)
    try:
        deadline, worker = time.monotonic() + 300, None
        while time.monotonic() < deadline and cli.poll() is None and worker is None:
            worker = next((p for p in psutil.Process(cli.pid).children(recursive=True)
                           if "tasks.extract.stage" in command_line(p)), None)
            time.sleep(0.2)
        assert worker is not None and cli.poll() is None, log.read_text()[-3000:]
        arguments = worker.cmdline()
        progress = Path(arguments[arguments.index("--progress-file") + 1])
        while cli.poll() is None and not (progress.is_file() and progress.stat().st_size):
            time.sleep(0.2)  # the worker is under way: its first progress report written
        stop_and_wait(cli, signal.SIGINT, group=True)
    finally:
        if cli.poll() is None or psutil.pid_exists(cli.pid):
            os.killpg(cli.pid, signal.SIGKILL)
    assert_stopped_politely(log, "SIGINT", out)
    assert not list(out.glob("train/*")), "stopped during extraction, training never began"
