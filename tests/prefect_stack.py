"""A real Prefect server and process worker for tests, each in its own process group, stopped by id."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prefect.client.base import PrefectHttpxSyncClient

PREFECT = str(Path(sys.executable).parent / "prefect")
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_group(proc: subprocess.Popen, grace: float = 15.0) -> None:
    """SIGTERM the process group (flow-run processes live in the worker's), SIGKILL what remains."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            proc.poll()
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            continue
        break
    proc.wait(timeout=10)


@dataclass
class PrefectStack:
    home: Path
    project: Path
    port: int = field(default_factory=free_port)
    processes: list[subprocess.Popen] = field(default_factory=list)
    spawned: dict[str, subprocess.Popen] = field(default_factory=dict)  # by the name their log is written under

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    @property
    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        env.update(PREFECT_HOME=str(self.home), PREFECT_API_URL=self.api, PREFECT_SERVER_ANALYTICS_ENABLED="false",
                   PREFECT_RESULTS_LOCAL_STORAGE_PATH=str(self.home / "storage"),
                   PREFECT_WORKER_QUERY_SECONDS="1", PREFECT_CLI_COLORS="false", COLUMNS="250")
        return env

    def cli(self, *args: str, check: bool = True, timeout: float = 900) -> subprocess.CompletedProcess:
        return subprocess.run([PREFECT, *args], env=self.env, cwd=self.project, capture_output=True, text=True,
                              check=check, timeout=timeout)

    def spawn(self, name: str, *args: str) -> subprocess.Popen:
        log = (self.home / f"{name}.log").open("wb")
        proc = subprocess.Popen([PREFECT, *args], env=self.env, cwd=self.project, stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.processes.append(proc)
        self.spawned[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.home / f"{name}.log").read_text(errors="replace")

    def start(self) -> PrefectStack:
        self.home.mkdir(parents=True, exist_ok=True)
        server = self.spawn("server", "server", "start", "--host", "127.0.0.1", "--port", str(self.port))
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if server.poll() is not None:
                raise RuntimeError(f"prefect server exited:\n{self.log('server')[-3000:]}")
            try:
                if httpx.get(f"{self.api}/health", timeout=2).json() is True:
                    return self
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.5)
        raise TimeoutError("prefect server did not become healthy in 180 s")

    def stop(self) -> None:
        for proc in reversed(self.processes):
            stop_group(proc)

    @property
    def http(self) -> PrefectHttpxSyncClient:
        """Prefect's own HTTP client on the API: it retries what the server answers 503 to (SQLite's
        "database is locked" on a busy machine: CI saw one on a schedule's PATCH) and raises on errors."""
        return PrefectHttpxSyncClient(base_url=self.api, timeout=30)

    def post(self, path: str, body: dict) -> list | dict | int:
        with self.http as http:
            return http.post(path, json=body).json()


def chromium(url: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Headless Chromium on the UI; --virtual-time-budget lets the single-page app finish its requests."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
               "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync",
               "--hide-scrollbars", f"--user-data-dir={profile}", "--window-size=1600,1100",
               "--virtual-time-budget=15000", *args, url]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
