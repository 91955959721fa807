"""The pipeline as a Prefect flow: prepare -> extract -> vocab -> [drift check] -> train -> validate -> [promote].

Each stage is a task (flows/stages.py; the retraining loop's drift check and promotion:
flows/retraining.py) wrapping a plain function in tasks/; this file is the whole DAG.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from flows.ray_stages import cluster_for_run
from flows.retraining import current_draft, drift_task, promote_task
from flows.run_records import references, run_lock, show_new_work, write_run_record
from flows.stages import extract_task, prepare_task, train_task, validate_task, vocab_task
from flows.task_support import result_storage, run_name
from tasks.common.config import PipelineConfig
from tasks.common.demo_assets import resolve_config
from tasks.preflight import check_before_run


# its result persisted: a state read back from the API (the run's record, or a retried request's answer) still has it
@flow(name="eagle3-draft", flow_run_name=run_name, persist_result=True)
def eagle3_pipeline(config: PipelineConfig) -> dict:
    # an absolute output folder: a deployment's run and a CLI run of one config share its cache keys
    config = config.model_copy(update={"output_dir": str(Path(config.output_dir).resolve())})
    with run_lock(config):  # one run per output folder: a busy one fails here, in the run's first seconds
        config = resolve_config(config)  # demo://... paths become local assets (built once), Hub ids snapshots
        check_before_run(config)  # paths, data, output folder, layers: what fails without loading a model
        storage = result_storage(config)  # the task cache, next to the outputs by default
        prepare, extract, vocab, drift, train, validate, promote = (
            t.with_options(result_storage=storage)
            for t in (prepare_task, extract_task, vocab_task, drift_task, train_task, validate_task, promote_task))
        results = {}
        with cluster_for_run(config):  # cluster.executor 'ray': the Ray cluster, every node seeing output_dir
            results["prepared"] = prepared = prepare(config)
            results["extracted"] = extracted = extract(config, prepared)
            results["vocab"] = vocabulary = vocab(config, prepared)
            show_new_work(prepared, extracted)  # what this run answered and extracted, what it reused
            parent = current_draft(config)  # the registry's current version, if any
            if config.retrain.when == "drift" and parent is not None:
                results["drift"] = decision = drift(config, prepared, extracted, parent)
                if not decision.retrain:  # the run ends Completed, having trained nothing; the decision says why
                    return write_run_record(config, results)
            results["trained"] = trained = train(config, prepared, extracted, vocabulary, parent)
            results["validated"] = validated = validate(config, trained, extracted)
            if config.registry.promote:
                results["promoted"] = promote(config, prepared, extracted, trained, validated,
                                              references(results))
        return write_run_record(config, results)

