"""The configuration tree: presets load, bad values are rejected with the field's name."""

from __future__ import annotations

from pathlib import Path

import pytest

from flows.cli import main, parse_overrides
from tasks.common.config import ConfigError, load_config

DEPLOYMENTS = Path(__file__).resolve().parents[2] / "deployments"


@pytest.mark.parametrize("preset", sorted(p.name for p in DEPLOYMENTS.glob("*.yaml")))
def test_presets_load(preset):
    config = load_config(DEPLOYMENTS / preset)
    assert config.verifier.path and config.data.sources


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


BASE = "verifier: {path: /models/x}\ndata: {sources: [a.json]}\n"


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ("train: {lr: -1}", "train.lr"),
        ("train: {learning_rate: 0.1}", "train.learning_rate"),
        ("extract: {aux_layers: [2, 15, 27, 30]}", "extract.aux_layers"),
        ("extract: {backend: tensorrt}", "extract.backend"),
        ("validation: {num_speculative_tokens: 0}", "validation.num_speculative_tokens"),
        ("data: {sources: []}", "data.sources"),
    ],
)
def test_errors_name_the_field(tmp_path, extra, field):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, BASE + extra))
    assert field in str(err.value) and "c.yaml" in str(err.value)


def test_missing_section_and_cross_field_checks(tmp_path):
    with pytest.raises(ConfigError, match="verifier"):
        load_config(write(tmp_path, "data: {sources: [a.json]}\n"))
    with pytest.raises(ConfigError, match="batch_tokens"):
        load_config(write(tmp_path, BASE + "extract: {batch_tokens: 100}"))
    with pytest.raises(ConfigError, match="extract.compile applies to the transformers backend"):
        load_config(write(tmp_path, BASE + "extract: {backend: vllm, compile: true}"))
    with pytest.raises(ConfigError, match="extract.packing was removed: packed batches extracted slower"):
        load_config(write(tmp_path, BASE + "extract: {packing: false}"))
    with pytest.raises(ConfigError, match="set data.regenerate.enabled: true so the verifier answers them"):
        load_config(write(tmp_path, "verifier: {path: /models/x}\ndata: {sources: [a.json], synthesize: {prompts: 9}}"))
    synthesized_only = load_config(write(tmp_path, "verifier: {path: /models/x}\n"
                                                   "data: {synthesize: {prompts: 100}, regenerate: {enabled: true}}"))
    assert synthesized_only.data.sources == [] and synthesized_only.data.synthesize.prompts == 100
    with pytest.raises(ConfigError, match=r"data.max_rows \(50\) caps every source, the synthesized prompts too"):
        load_config(write(tmp_path, "verifier: {path: /models/x}\ndata: {max_rows: 50, synthesize: {prompts: 100}, "
                                    "regenerate: {enabled: true}}"))
    for settings, refusal in (("extract: {mode: stream}", "needs train.shuffle_block_shards"),
                              ("extract: {mode: stream, stream_window: 6}\ntrain: {shuffle_block_shards: 4}",
                               r"stream_window \(6\) must be at least 2 x train.shuffle_block_shards \(4\)")):
        with pytest.raises(ConfigError, match=refusal):
            load_config(write(tmp_path, BASE + settings))
    streamed = load_config(write(tmp_path, BASE + "extract: {mode: stream}\ntrain: {shuffle_block_shards: 4}"))
    assert streamed.extract.output_settings() == load_config(write(tmp_path, BASE)).extract.output_settings()
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "verifier: [unclosed"))
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "absent.yaml")


def test_overrides_merge_into_sections(tmp_path):
    overrides = parse_overrides(["train.epochs=2", "extract.aux_layers=[3, 10, 20]", "data.max_rows=7"])
    config = load_config(write(tmp_path, BASE + "train: {lr: 0.01}"), overrides)
    assert (config.train.epochs, config.train.lr, config.data.max_rows) == (2, 0.01, 7)
    assert config.extract.aux_layers == [3, 10, 20]


def test_cli_rejects_a_bad_config_before_any_work(tmp_path, capsys):
    assert main(["run", str(write(tmp_path, BASE + f"output_dir: {tmp_path / 'out'}\ntrain: {{lr: -1}}"))]) == 2
    assert "train.lr" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_empty_cache_variables_count_as_unset(monkeypatch, tmp_path):
    from tasks.common.demo_assets import cache_dir

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("EAGLE3_CACHE_DIR", "")
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    assert cache_dir() == tmp_path / ".cache" / "eagle3-pipeline"
    monkeypatch.setenv("EAGLE3_CACHE_DIR", str(tmp_path / "assets"))
    assert cache_dir() == tmp_path / "assets"


def test_cli_prints_a_config_as_json_for_deployment_parameters(tmp_path, capsys):
    from tasks.common.config import PipelineConfig

    for preset in sorted(DEPLOYMENTS.glob("*.yaml")):
        assert main(["config", str(preset), "--json", "--set", "train.epochs=3"]) == 0
        out = capsys.readouterr().out
        assert len(out.splitlines()) == 1  # one line: fits `--param config="$(...)"`
        config = PipelineConfig.model_validate_json(out)
        assert config == load_config(preset, {"train": {"epochs": 3}})
    assert main(["config", str(write(tmp_path, BASE + "train: {lr: -1}")), "--json"]) == 2
    captured = capsys.readouterr()
    assert "train.lr" in captured.err and captured.out == ""


def test_set_errors_name_the_set_option_not_the_file(tmp_path, capsys):
    config = str(write(tmp_path, BASE))
    assert main(["config", config, "--set", "train.lr=[1,"]) == 2  # YAML the shell left unquoted
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --set train.lr=[1,: the value is not valid YAML"), err
    assert main(["config", config, "--set", "train.lr=-1"]) == 2
    err = capsys.readouterr().err
    assert "train.lr (from --set train.lr=-1): Input should be greater than 0" in err and "Traceback" not in err
    assert main(["config", str(write(tmp_path, BASE + "train: {lr: -1}"))]) == 2
    assert "  train.lr: Input should be greater than 0" in capsys.readouterr().err  # from the file: no --set named


def test_a_reader_that_stops_early_ends_the_output_quietly(tmp_path):
    """`eagle3-pipeline config X | head`: the reader goes away before the output ends."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "flows.cli", "config", str(DEPLOYMENTS / "large-verifier.yaml")]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        proc.stdout.close()  # the reader has gone before the first line is written (`head -0`)
        err = proc.stderr.read().decode()
    assert proc.returncode == 0 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_relative_paths_become_absolute_for_every_stage(tmp_path, monkeypatch):
    """The draft's config names its verifier: a relative path would point elsewhere once read from
    another folder."""
    from tasks.common.config import PipelineConfig
    from tasks.common.demo_assets import resolve_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "v").mkdir(parents=True)  # there: a path `org/name` that is no folder is a Hub id
    config = PipelineConfig.model_validate({"name": "x", "output_dir": "out", "verifier": {"path": "models/v"},
                                            "data": {"sources": ["data/chats.jsonl"]},
                                            "validation": {"prompts": "prompts.jsonl"}})
    resolved = resolve_config(config)
    assert resolved.verifier.path == str(tmp_path / "models" / "v")
    assert resolved.data.sources == [str(tmp_path / "data" / "chats.jsonl")]
    assert resolved.validation.prompts == str(tmp_path / "prompts.jsonl")
