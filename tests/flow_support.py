"""Helpers for tests that run the real flow: a small real config and reading task states back."""

from __future__ import annotations

import json
from pathlib import Path

from tasks.common.config import PipelineConfig
from tasks.prepare.chat_data import Dropped, read_rows


def write_sample_data(sharegpt: str, path: Path, rows: int) -> Path:
    """The first `rows` ShareGPT conversations as a JSONL file the test can edit."""
    data = [r.data for r in read_rows([sharegpt], rows) if not isinstance(r.data, Dropped)]
    path.write_text("".join(json.dumps(r) + "\n" for r in data))
    return path


def small_config(out: Path, data: Path, /, **sections) -> PipelineConfig:
    """The demo's real model and data, shrunk to run the five stages in about a minute."""
    base = {
        "name": "test",
        "output_dir": str(out),
        "verifier": {"path": "demo://smollm2-135m-instruct"},
        "data": {"sources": [str(data)], "max_seq_len": 96},
        "extract": {"batch_tokens": 1024, "shard_tokens": 600},
        "vocab": {"draft_vocab_size": 512},
        "train": {"epochs": 1, "total_seq_len": 256, "eval_every": 100, "val_fraction": 0.2},
        "validation": {"live": "skip"},
    }
    for section, values in sections.items():
        base[section] = {**base.get(section, {}), **values} if isinstance(values, dict) else values
    return PipelineConfig.model_validate(base)


def task_states(flow_run_id) -> dict[str, tuple[str, int]]:
    """{task name: (state name, run count)} of a flow run, once the Prefect server recorded them."""
    from flows.cli import recorded_task_runs

    return {r.name.rsplit("-", 1)[0]: (r.state.name, r.run_count) for r in recorded_task_runs(flow_run_id)}


def run_summary(stdout: str) -> dict:
    """The summary a finished CLI run prints before its last line."""
    return json.loads(stdout[stdout.index("{"): stdout.index("\neagle3-pipeline: done")])


def untimed(metrics: list[dict]) -> list[dict]:
    """Training metrics without their rates, which differ between equal runs."""
    return [{k: v for k, v in m.items() if k != "tokens_per_s"} for m in metrics]
