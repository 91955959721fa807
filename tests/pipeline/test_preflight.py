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
    (tmp_path / "unusable.jsonl").write_text("not json at all\n" + json.dumps(
        {"messages": [{"role": "system", "content": "You are helpful."}]}) + "\n")
    cases = [
        (["verifier.path=" + str(tmp_path / "no-such-model")], "verifier folder not found"),
        (["data.sources=[" + str(tmp_path / "missing.jsonl") + "]"], "data source not found: " + str(tmp_path)),
        (["data.sources=[" + str(tmp_path / "empty.jsonl") + "]"], "empty.jsonl is empty"),
        (["extract.aux_layers=[2, 15, 40]"], "outside the verifier's depth: ids run 1..30"),
        (["extract.aux_layers=[0, 15, 27]"], "extract.aux_layers (from --set extract.aux_layers=[0, 15, 27]): Value "
                                             "error, layer ids must be distinct and >= 1"),
        (["output_dir=/sys/eagle3-out"], "output_dir /sys/eagle3-out is not writable"),
        (["output_dir=" + str(tmp_path / "a-file" / "out")], "a-file is a file, not a folder"),
        (["validation.live=auto", "validation.prompts=" + str(tmp_path / "prompts.jsonl")], "validation.prompts"),
        (["train.init_from=" + str(tmp_path)], f"init_from {tmp_path}"),  # a folder that is no draft
        (["data.sources=[" + str(tmp_path / "unusable.jsonl") + "]"], "hold no usable conversation: 2 rows read"),
    ]
    for overrides, expected in cases:
        code, err = run_cli(tmp_path, config, capsys, *overrides)
        assert code == 2, (overrides, err)
        assert any(expected in line for line in err), (overrides, err)
        if "aux_layers=[0" not in overrides[0]:  # a config error lists its fields below its first line
            assert len(err) == 1 and err[0].startswith("error: "), err
    assert not (tmp_path / "out").exists()  # nothing was created, Prefect never started
    assert not os.environ.get("PREFECT_HOME", "").startswith(str(tmp_path))


def test_a_verifier_folder_without_a_usable_tokenizer_is_named(setup, smollm2, capsys):
    tmp_path, config = setup
    no_tokenizer = tmp_path / "no-tokenizer"
    no_tokenizer.mkdir()
    for f in Path(smollm2).iterdir():
        if f.name not in ("tokenizer.json", "vocab.json", "merges.txt"):
            os.symlink(f, no_tokenizer / f.name)
    code, err = run_cli(tmp_path, config, capsys, f"verifier.path={no_tokenizer}")
    assert code == 2 and err[0].startswith("error: ") and "has no tokenizer: none of tokenizer.json" in err[0], err

    remote = tmp_path / "remote-tokenizer"  # tokenizer code shipped with the model, as Kimi's is
    remote.mkdir()
    for f in Path(smollm2).iterdir():
        if f.name != "tokenizer_config.json":
            os.symlink(f, remote / f.name)
    tokenizer_config = json.loads((Path(smollm2) / "tokenizer_config.json").read_text())
    (remote / "tokenizer_config.json").write_text(json.dumps(
        {**tokenizer_config, "auto_map": {"AutoTokenizer": [None, "tokenization_kimi.TikTokenTokenizer"]}}))
    code, err = run_cli(tmp_path, config, capsys, f"verifier.path={remote}")
    assert code == 2 and "set verifier.trust_remote_code: true" in err[0] and "TikTokenTokenizer" in err[0], err
    assert not (tmp_path / "out").exists()


def test_a_verifier_vllm_cannot_serve_is_refused_or_warned_before_any_model_loads(setup, smollm2, capsys, caplog):
    """validation.live: required with a verifier the installed vLLM has no EAGLE-3 for stops in
    preflight, naming the class, the vLLM version and the families it serves; auto warns and goes on."""
    tmp_path, config = setup
    gemma = tmp_path / "gemma"  # only config.json decides: the architecture vLLM resolves
    gemma.mkdir()
    for f in Path(smollm2).iterdir():
        if f.name != "config.json":
            os.symlink(f, gemma / f.name)
    smol = json.loads((Path(smollm2) / "config.json").read_text())
    (gemma / "config.json").write_text(json.dumps({**smol, "architectures": ["Gemma3ForCausalLM"]}))
    code, err = run_cli(tmp_path, config, capsys, f"verifier.path={gemma}", "validation.live=required",
                        "validation.prompts=" + str(gemma / "config.json"))
    assert code == 2 and len(err) == 1, err
    assert "validation.live: required, but vLLM 0.32.0's Gemma3ForCausalLM does not serve EAGLE-3" in err[0]
    assert "LlamaForCausalLM" in err[0] and "Qwen3ForCausalLM" in err[0]  # what it does serve
    assert not (tmp_path / "out").exists()

    from tasks.common.config import PipelineConfig
    from tasks.preflight import check_live_validation

    wanted = PipelineConfig.model_validate({**config, "verifier": {"path": str(gemma)}, "validation": {"live": "auto"}})
    assert check_live_validation(wanted).endswith(": validation will run the static checks only (validation.live: "
                                                  "auto)")
    served = PipelineConfig.model_validate({**config, "validation": {"live": "required"}})
    assert check_live_validation(served) is None  # SmolLM2: LlamaForCausalLM


def test_the_disk_training_needs_is_known_before_any_work_and_a_disk_too_small_is_refused(setup, smollm2, sharegpt,
                                                                                        capsys):
    """The need estimated from config.json alone, against the bytes of a real checkpoint and draft (one step
    of real training); the refusal through the check with a free-space figure (a real disk that small would
    take a mount), and through the command, whose real disk cannot hold a million checkpoints."""
    from tasks.common.config import PipelineConfig
    from tasks.common.progress import format_bytes
    from tasks.extract.stage import ExtractJob, run_extraction
    from tasks.preflight import PreflightError, check_training_disk, training_disk
    from tasks.prepare.stage import prepare
    from tasks.train.checkpoints import checkpoint_dirs
    from tasks.train.job import TrainJob
    from tasks.train.stage import run_training
    from tasks.vocab import build_vocab

    tmp_path, base = setup
    config = PipelineConfig.model_validate({**base, "vocab": {"draft_vocab_size": 512},
                                            "train": {"total_seq_len": 256, "max_steps": 1, "val_fraction": 0}})
    need = training_disk(config)
    code, err = run_cli(tmp_path, base, capsys, "train.keep_checkpoints=1000000")
    assert code == 2 and len(err) == 1 and "training needs" in err[0] and "1000000 recent ones" in err[0], err
    assert not Path(base["output_dir"]).exists()  # refused before any work

    prepared = prepare(smollm2, [sharegpt], tmp_path, max_seq_len=64, max_rows=6)
    extraction = run_extraction(ExtractJob(prepared.path, prepared.fingerprint, smollm2, str(tmp_path / "hs"),
                                           settings={"batch_tokens": 1024}), in_process=True)
    vocab = build_vocab(prepared.path, prepared.fingerprint, smollm2, tmp_path, draft_vocab_size=512)
    job = TrainJob(extraction.manifest, prepared.path, vocab.path, smollm2, str(tmp_path / "train"),
                   extraction.layers[:3], settings=config.train.model_dump())
    trained = run_training(job, extraction.fingerprint, vocab.fingerprint, in_process=True)

    def folder_bytes(folder: Path) -> int:
        return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())

    assert need.checkpoint_bytes == pytest.approx(folder_bytes(checkpoint_dirs(tmp_path / "train")[-1]), rel=0.1)
    assert need.draft_bytes == pytest.approx(folder_bytes(Path(trained.draft_path)), rel=0.1)
    assert need.needed_bytes == (config.train.keep_checkpoints + 2) * need.checkpoint_bytes

    assert check_training_disk(config, free_bytes=need.needed_bytes) == need
    with pytest.raises(PreflightError) as refused:
        check_training_disk(config, free_bytes=need.needed_bytes - 1)
    assert f"training needs {format_bytes(need.needed_bytes)}: 4 checkpoints of " \
           f"{format_bytes(need.checkpoint_bytes)}" in str(refused.value)
    assert f"{format_bytes(need.needed_bytes - 1)} is free on that disk" in str(refused.value)
