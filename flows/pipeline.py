"""The pipeline as a Prefect flow: prepare -> extract -> vocab -> train -> validate.

Each stage is a task (flows/stages.py) wrapping a plain function in tasks/; this file is the
whole DAG.
"""

from __future__ import annotations

from prefect import flow

from flows.ray_stages import cluster_for_run
from flows.stages import extract_task, prepare_task, train_task, validate_task, vocab_task
from flows.task_support import result_storage, run_name
from tasks.common.config import PipelineConfig
from tasks.common.demo_assets import resolve_config
from tasks.preflight import check_before_run


# its result persisted: a state read back from the API (the run's record, or a retried request's answer) still has it
@flow(name="eagle3-draft", flow_run_name=run_name, persist_result=True)
def eagle3_pipeline(config: PipelineConfig) -> dict:
    config = resolve_config(config)  # demo://... paths become local assets (built once)
    check_before_run(config)  # paths, data, output folder, layers: what fails without loading a model
    storage = result_storage(config)  # the task cache, next to the outputs by default
    prepare, extract, vocab, train, validate = (
        t.with_options(result_storage=storage)
        for t in (prepare_task, extract_task, vocab_task, train_task, validate_task)
    )
    with cluster_for_run(config):  # cluster.executor 'ray': the Ray cluster, every node seeing output_dir
        prepared = prepare(config)
        extracted = extract(config, prepared)
        vocabulary = vocab(config, prepared)
        trained = train(config, prepared, extracted, vocabulary)
        validated = validate(config, trained, extracted)
    return {"prepared": prepared, "extracted": extracted, "vocab": vocabulary, "trained": trained,
            "validated": validated}
