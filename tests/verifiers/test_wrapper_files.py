"""A multimodal wrapper (Kimi-K2.5, families.py) whose folder lacks its image processor's file: vLLM has an
EAGLE-3 interface for its class, but its engine builds the processor at start and dies ("OSError: Can't load
image processor"). `plan` and the preflight ask vLLM to build that processor as its engine does
(tasks/common/vllm_support.py `serving_problem`) and name the missing file at the start: under
`validation.live: auto` validation is static only and the plan says why; under `required` the run is
refused before any work. A run under `auto` trains and validates statically, exit 0, the reason in its report.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from families import AUX_LAYERS, BY_NAME, build

from flows.cli import main
from tasks.common.vllm_support import ENGINE_WILL_NOT_START, installed_vllm

KIMI = BY_NAME["kimi_k25"]
STATIC_ONLY = "validation will run the static checks only (validation.live: auto)"


@pytest.fixture(scope="module")
def wrappers(smollm2, tmp_path_factory) -> tuple[Path, Path]:
    """The tiny Kimi-K2.5 as families.py builds it (with preprocessor_config.json), and the same folder
    without that file, as a user's copy that left it out."""
    root = tmp_path_factory.mktemp("wrapper")
    complete = build(KIMI, smollm2, root / "kimi-k25")
    assert (complete / "preprocessor_config.json").is_file()
    lacking = root / "kimi-k25-no-image-processor"
    lacking.mkdir()
    for f in complete.iterdir():
        if f.name != "preprocessor_config.json":
            os.symlink(f, lacking / f.name)
    return complete, lacking


def config(verifier: Path, out: Path, sharegpt: str, mtbench: str, live: str) -> dict:
    return {"name": "wrapper", "output_dir": str(out), "verifier": {"path": str(verifier), "trust_remote_code": True},
            "data": {"sources": [sharegpt], "max_rows": 6, "max_seq_len": 256},
            "extract": {"aux_layers": AUX_LAYERS, "batch_tokens": 2048, "shard_tokens": 4000},
            "vocab": {"draft_vocab_size": 512},
            "train": {"max_steps": 2, "total_seq_len": 512, "val_fraction": 0.0, "eval_every": 2},
            "validation": {"live": live, "prompts": mtbench, "max_prompts": 2, "max_new_tokens": 8}}


def cli(tmp_path: Path, command: str, settings: dict, capsys, *args: str) -> tuple[int, str, str]:
    path = tmp_path / f"{command}.yaml"
    path.write_text(yaml.safe_dump(settings))
    code = main([command, str(path), *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.system  # the wrapper's build and two vLLM processor probes: 90-150 s on the loaded 2-core machine
def test_plan_and_preflight_name_the_image_processor_file_a_wrapper_folder_lacks(wrappers, sharegpt, mtbench,
                                                                                   tmp_path, capsys):
    complete, lacking = wrappers
    reason = f"{ENGINE_WILL_NOT_START}{lacking} lacks preprocessor_config.json (its image processor)"

    code, out, err = cli(tmp_path, "plan", config(lacking, tmp_path / "out", sharegpt, mtbench, "auto"), capsys,
                         "--json")
    assert code == 0, err
    assert json.loads(out)["live_validation"] == f"{reason}: {STATIC_ONLY}"

    code, out, err = cli(tmp_path, "plan", config(complete, tmp_path / "out", sharegpt, mtbench, "auto"), capsys,
                         "--json")
    assert code == 0, err
    assert json.loads(out)["live_validation"] == (f"vLLM {installed_vllm()} serves KimiK25ForConditionalGeneration "
                                                  "with an EAGLE-3 draft")

    # required: refused before any work, by `plan` and by `run` (the folder's state is remembered: no new probe)
    required = config(lacking, tmp_path / "out", sharegpt, mtbench, "required")
    for command in ("plan", "run"):
        code, out, err = cli(tmp_path, command, required, capsys)
        lines = err.strip().splitlines()
        assert code == 2 and lines[-1] == f"error: validation.live: required, but {reason}; set validation.live: " \
                                          "auto to train anyway and validate statically, or skip", err
    assert not (tmp_path / "out").exists()


@pytest.mark.system  # a whole run through the CLI, and vLLM's engine refusing the folder: minutes
def test_a_run_on_the_wrapper_under_auto_validates_statically_and_says_why(prefect_api, wrappers, sharegpt, mtbench,
                                                                             tmp_path, monkeypatch, capsys, caplog):
    _, lacking = wrappers
    for name in ("PREFECT_HOME", "PREFECT_RESULTS_LOCAL_STORAGE_PATH", "PREFECT_SERVER_MEMO_STORE_PATH"):
        monkeypatch.setenv(name, str(tmp_path / "prefect-home" / name.lower()))  # the CLI's, undone after the test
    out = tmp_path / "out"

    code, _, err = cli(tmp_path, "run", config(lacking, out, sharegpt, mtbench, "auto"), capsys)
    assert code == 0, err[-3000:]
    reason = f"{lacking} lacks preprocessor_config.json (its image processor)"
    assert any(reason in r.getMessage() and STATIC_ONLY in r.getMessage() for r in caplog.records)  # at the start
    reports = list(out.rglob("report.md"))
    assert len(reports) == 1, reports
    report = reports[0].read_text()
    assert "Verdict: passed" in report and "## Static checks: passed" in report, report
    skipped = next(line for line in report.splitlines() if line.startswith("vLLM not run: "))
    assert skipped == f"vLLM not run: {ENGINE_WILL_NOT_START}{reason}.", report  # no engine started to find out
    assert not list(out.rglob("drafted.log")), "an engine was started"
