"""What can be checked without loading a model fails before the flow's first task: exit 2, one line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from flows.cli import main

GOOD_ROW = {"conversations": [{"from": "human", "value": "What is 2+2?"}, {"from": "gpt", "value": "It is 4."}]}


@pytest.fixture
def setup(smollm2, tmp_path):
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps(GOOD_ROW) + "\n")
    config = {"name": "preflight", "output_dir": str(tmp_path / "out"), "verifier": {"path": smollm2},
              "data": {"sources": [str(data)], "max_seq_len": 96}, "extract": {"batch_tokens": 1024},
              "validation": {"live": "skip"}}
    return tmp_path, config


def run_cli(tmp_path: Path, config: dict, capsys, *overrides: str) -> tuple[int, list[str]]:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    code = main(["run", str(path), *[a for o in overrides for a in ("--set", o)]])
    return code, capsys.readouterr().err.strip().splitlines()


def test_each_problem_is_named_in_one_line_before_any_work(setup, capsys):
    tmp_path, config = setup
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "a-file").write_text("")
    cases = [
        (["verifier.path=" + str(tmp_path / "no-such-model")], "verifier folder not found"),
        (["data.sources=[" + str(tmp_path / "missing.jsonl") + "]"], "data source not found: " + str(tmp_path)),
        (["data.sources=[" + str(tmp_path / "empty.jsonl") + "]"], "empty.jsonl is empty"),
        (["extract.aux_layers=[2, 15, 40]"], "outside the verifier's depth: ids run 1..30"),
        (["extract.aux_layers=[0, 15, 27]"], "extract.aux_layers: Value error, layer ids must be distinct and >= 1"),
        (["output_dir=/sys/eagle3-out"], "output_dir /sys/eagle3-out is not writable"),
        (["output_dir=" + str(tmp_path / "a-file" / "out")], "a-file is a file, not a folder"),
        (["validation.live=auto", "validation.prompts=" + str(tmp_path / "prompts.jsonl")], "validation.prompts"),
    ]
    for overrides, expected in cases:
        code, err = run_cli(tmp_path, config, capsys, *overrides)
        assert code == 2, (overrides, err)
        assert any(expected in line for line in err), (overrides, err)
        if "aux_layers=[0" not in overrides[0]:  # a config error lists its fields below its first line
            assert len(err) == 1 and err[0].startswith("error: "), err
    assert not (tmp_path / "out").exists()  # nothing was created, Prefect never started
    assert not os.environ.get("PREFECT_HOME", "").startswith(str(tmp_path))
