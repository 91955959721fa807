"""The stages as Prefect tasks: caching by content, retries, tags, artifacts.

The work itself is in tasks/ as plain functions; this module only adds orchestration.
"""

from __future__ import annotations

import hashlib
import inspect

from prefect import task
from prefect.artifacts import create_table_artifact
from prefect.logging import get_run_logger

from tasks import prepare as prepare_stage
from tasks.config import PipelineConfig


def _key(*parts: object) -> str:
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()


def _prepare_key(ctx, params) -> str:
    # The content of the data and tokenizer, not the paths: an edited dataset re-runs prepare.
    c: PipelineConfig = params["config"]
    fp = prepare_stage.prepare_fingerprint(c.verifier.path, c.data.sources, c.data.max_rows, c.data.max_seq_len)
    return _key("prepare", fp, c.output_dir, inspect.getsource(prepare_task.fn))


@task(name="prepare", cache_key_fn=_prepare_key, retries=1, retry_delay_seconds=5)
def prepare_task(config: PipelineConfig) -> prepare_stage.PreparedData:
    log = get_run_logger()
    result = prepare_stage.prepare(
        config.verifier.path, config.data.sources, config.output_dir,
        max_seq_len=config.data.max_seq_len, max_rows=config.data.max_rows,
    )
    report = prepare_stage.read_report(result.path)
    create_table_artifact(
        key="prepare-report",
        table=[{"metric": k, "value": v} for k, v in report.items() if k != "dropped_examples"],
        description=f"prepare: {result.rows} rows kept, {result.supervised_tokens} supervised tokens",
    )
    log.info("prepared data: %s", result.path)
    return result
