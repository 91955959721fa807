"""What a run leaves besides its outputs: the lock that makes it the only run of its output folder,
what it did anew and what it reused (in the UI), and its record under `<output_dir>/runs/`, which
`eagle3-pipeline gc` reads to know what the runs it keeps use."""

from __future__ import annotations

import json
import os
import time
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path

from prefect.artifacts import create_table_artifact
from prefect.logging import get_run_logger
from prefect.runtime import flow_run

from flows.task_support import table
from tasks.common.config import PipelineConfig
from tasks.common.folder_lock import folder_lock, held_here
from tasks.extract.job import ExtractResult
from tasks.prepare.dataset import PreparedData


def run_lock(config: PipelineConfig):
    """One run per output folder, however it started: the CLI holds the lock around the flow (and refuses a
    busy folder before Prefect starts); a deployment's run takes it here, where a busy folder fails the run
    in its first seconds instead of a stage after minutes."""
    output = Path(config.output_dir)
    return nullcontext() if held_here(output) else folder_lock(output, "eagle3-pipeline")


def show_new_work(prepared: PreparedData, extracted: ExtractResult) -> None:
    """What this run did anew and what it found done (answers, hidden states), in the log and the UI."""
    rows = {}
    if prepared.conversations_answered is not None:
        rows["conversations answered by the verifier"] = prepared.conversations_answered
        rows["conversations whose answers were reused"] = prepared.conversations_reused
    rows |= {"samples extracted": extracted.samples_extracted, "samples reused": extracted.samples_reused,
             "tokens extracted": extracted.tokens_extracted, "tokens reused": extracted.tokens_reused}
    line = "; ".join(f"{k}: {v:,}" for k, v in rows.items())
    create_table_artifact(table=table(rows), key="new-work", description=f"new and reused work: {line}")
    get_run_logger().info("new and reused work: %s", line)


def references(results: dict) -> list[str]:
    """The outputs this run used (absolute paths), which `eagle3-pipeline gc` keeps while the run's record
    or a registry version naming them is kept."""
    paths = []
    if "prepared" in results:
        paths += [results["prepared"].path, *results["prepared"].made_from]
    if "extracted" in results:
        paths.append(results["extracted"].manifest)
    if "vocab" in results:
        paths.append(results["vocab"].path)
    if "trained" in results:
        paths.append(str(Path(results["trained"].draft_path).parent))
    if "validated" in results:
        paths.append(str(Path(results["validated"].report_json).parent))
    return [str(Path(p).resolve()) for p in paths]


def write_run_record(config: PipelineConfig, results: dict) -> dict:
    """`<output_dir>/runs/<time>-<flow run>.json`: the run's results and the outputs it used; returns `results`."""
    folder = Path(config.output_dir) / "runs"
    folder.mkdir(parents=True, exist_ok=True)
    run_id = str(flow_run.get_id() or "no-flow-run")
    record = {"flow_run_id": run_id, "name": config.name, "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "references": references(results), "results": {k: asdict(v) for k, v in results.items()}}
    path = folder / f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{run_id[:8]}.json"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(record, indent=1, default=str))
    os.replace(tmp, path)
    get_run_logger().info("run record: %s", path)
    return results
