"""The pipeline as a Prefect flow: prepare -> extract -> vocab -> train -> validate.

Each stage is a task (flows/stages.py) wrapping a plain function in tasks/; this file is the
whole DAG.
"""

from __future__ import annotations

from prefect import flow

from flows.stages import extract_task, prepare_task, train_task, validate_task, vocab_task
from tasks.config import PipelineConfig
from tasks.demo_assets import resolve_config


@flow(name="eagle3-draft")
def eagle3_pipeline(config: PipelineConfig) -> dict:
    config = resolve_config(config)  # demo://... paths become local assets (built once)
    prepared = prepare_task(config)
    extracted = extract_task(config, prepared)
    vocab = vocab_task(config, prepared)
    trained = train_task(config, prepared, extracted, vocab)
    validated = validate_task(config, trained, extracted)
    return {"prepared": prepared, "extracted": extracted, "vocab": vocab, "trained": trained,
            "validated": validated}
