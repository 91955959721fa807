"""What every stage task shares: which failures are retried, content-keyed cache keys, where
results are stored, and the artifacts a run shows in the Prefect UI (progress, tables, pictures).
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import json
from functools import cache
from pathlib import Path

from prefect.artifacts import create_image_artifact, create_progress_artifact, update_progress_artifact
from prefect.logging import get_run_logger
from prefect.tasks import exponential_backoff

from tasks.common.config import PipelineConfig
from tasks.common.errors import describe, is_deterministic
from tasks.common.plots import data_uri
from tasks.common.progress import ProgressEvent
from tasks.prepare.chat_data import source_name


def retry_transient(task, task_run, state) -> bool:
    """Prefect's retry condition: retry what a retry can change, never a deterministic error
    (bad input or settings, a verifier the backend cannot load: tasks/common/errors.py)."""
    exc = state.result(raise_on_failure=False)
    if isinstance(exc, BaseException) and is_deterministic(exc):
        get_run_logger().error("%s: not retried, the same inputs would fail the same way", describe(exc))
        return False
    return True


RETRY_TRANSIENT = {"retry_condition_fn": retry_transient}
GPU_STAGE = {"retries": 2, "retry_delay_seconds": exponential_backoff(backoff_factor=10), "retry_jitter_factor": 0.2,
             **RETRY_TRANSIENT}


@cache
def source_of(module: str) -> str:
    """A module's source, read from its file without importing it (some import vLLM)."""
    return Path(importlib.util.find_spec(module).origin).read_text()


def cache_key(ctx, *parts, code: tuple[str, ...] = ()) -> str:
    """The task's name and source, the source of the modules doing its work, and its inputs' content."""
    sources = inspect.getsource(ctx.task.fn) + "".join(source_of(m) for m in code)
    blob = json.dumps([ctx.task.name, hashlib.sha256(sources.encode()).hexdigest(), *parts], sort_keys=True,
                      default=str)
    return f"{ctx.task.name}-{hashlib.sha256(blob.encode()).hexdigest()}"


def stage_dir(config: PipelineConfig, stage: str) -> Path:
    return Path(config.output_dir) / stage


class ProgressArtifact:
    """A Prefect progress artifact updated in place from progress events, and a line in the run's
    log once a minute (the stage's subprocess already prints every event to the console)."""

    def __init__(self, description: str, log_every_s: float = 60.0):
        self.id = create_progress_artifact(progress=0.0, description=description)
        self.logger = get_run_logger()
        self.log_every_s, self.last_log = log_every_s, -float("inf")

    def __call__(self, event: ProgressEvent) -> None:
        update_progress_artifact(self.id, 100 * event.fraction, description=event.describe())
        if event.elapsed_s - self.last_log >= self.log_every_s or event.fraction >= 1:
            self.last_log = event.elapsed_s
            self.logger.info(event.describe())


def result_storage(config: PipelineConfig):
    """Where task results (the cache) go: the configured block, or a local one under the outputs.

    Keeping the cache next to the outputs it describes means deleting an output folder also
    forgets its cached results, whichever way the flow was started (CLI, deployment, schedule)."""
    if config.result_storage:
        return config.result_storage
    from prefect.filesystems import LocalFileSystem

    path = (Path(config.output_dir) / ".prefect" / "results").resolve()
    block = LocalFileSystem(basepath=str(path))
    block.save(f"eagle3-results-{hashlib.sha256(str(path).encode()).hexdigest()[:12]}", overwrite=True)
    return block


def run_name() -> str:
    """Flow run names say which verifier and data: 'smollm2-135m-instruct on sharegpt_v3.json (demo)'."""
    from prefect.runtime import flow_run

    config = flow_run.parameters["config"]
    config = config if isinstance(config, PipelineConfig) else PipelineConfig.model_validate(config)
    data = ", ".join(Path(source_name(s).removeprefix("demo://")).name for s in config.data.sources)
    return f"{Path(config.verifier.path.removeprefix('demo://')).name} on {data} ({config.name})"


def show_picture(path: Path, key: str, description: str) -> None:
    """A PNG (tasks/common/plots.py) as an image artifact holding it as a data: URL, which both of Prefect
    3.7's UIs show without a file server. Not inside a markdown artifact: the new UI's markdown
    renderer blanks data: URLs (react-markdown's default URL filter)."""
    create_image_artifact(image_url=data_uri(path), key=key, description=description)
    get_run_logger().info("%s: %s", description, path)


def table(rows: dict) -> list[dict]:
    return [{"item": k, "value": json.dumps(v) if isinstance(v, dict | list) else v} for k, v in rows.items()]
