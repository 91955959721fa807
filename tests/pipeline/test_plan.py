"""`eagle3-pipeline plan`: the presets sized on this CPU machine from config-only folders, nothing
written unless asked."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from flows.cli import main
from tasks.common.progress import format_seconds
from tasks.common.verifier import TOKENIZER_FILES, WEIGHT_SUFFIXES
from tasks.plan import H100_BF16_TFLOPS, MEASURED_DISK_BYTES_PER_S, MEASURED_PARAMETERS, MEASURED_TOKENS_PER_S
from tasks.prepare.dataset import read_report

DEPLOYMENTS = Path(__file__).resolve().parents[2] / "deployments"

PRESET = Path(__file__).resolve().parents[2] / "deployments" / "llama-8b-1gpu.yaml"
# Llama-3.1-8B-Instruct's config.json (the shapes; no weights anywhere)
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 131072, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
}


@pytest.fixture
def config_only(smollm2, tmp_path) -> Path:
    """An 8B verifier as a user downloads it to size a run: config.json and the tokenizer (SmolLM2's here)."""
    folder = tmp_path / "llama-8b-config-only"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA_31_8B))
    for name in TOKENIZER_FILES:
        if (Path(smollm2) / name).is_file():
            shutil.copy(Path(smollm2) / name, folder / name)
    return folder


def plan(capsys, *settings: str, json_output: bool = True, keep: bool = True, preset: Path = PRESET
         ) -> tuple[int, str]:
    args = ["plan", str(preset), *[a for s in settings for a in ("--set", s)]] + (["--json"] if json_output else [])
    args += ["--keep"] if keep else []
    code = main(args)
    return code, capsys.readouterr().out


def test_the_one_gpu_preset_is_planned_on_cpu_without_weights(config_only, tmp_path, capsys):
    settings = (f"verifier.path={config_only}", "data.max_rows=40", f"output_dir={tmp_path / 'out'}",
                "extract.reserve_disk_gb=0")
    code, out = plan(capsys, *settings)
    assert code == 0, out
    sized = json.loads(out)
    assert not [p for p in config_only.iterdir() if p.suffix in WEIGHT_SUFFIXES]
    tokens = read_report(sized["prepared"])["tokens"]  # prepare ran: the tokenizer was all it needed
    assert sized["tokens"] == tokens > 10_000 and sized["tokens_to_extract"] == tokens
    assert sized["layers"] == [2, 16, 29, 32]  # EAGLE-3's default aux layers for 32 layers, and the last
    assert sized["bytes_total_gb"] == round(tokens * 4 * 4096 * 2 / 1e9, 3)
    assert sized["shards"] == 1 and sized["host_buffers_gb_per_worker"] == round(3 * tokens * 4 * 4096 * 2 / 1e9, 2)
    assert sized["parameters_from"] == "config.json" and sized["verifier_parameters_b"] == 8.03  # Llama-3.1-8B
    assert sized["gpu_tflops"] == H100_BF16_TFLOPS and sized["gpus"] == 1  # the measured H200 rate, unscaled
    # 8B shapes write 32 KB a token: at the H200 machine's 1.0 GB/s its disk binds before the forward does
    assert sized["disk_gb_per_s"] == MEASURED_DISK_BYTES_PER_S / 1e9 and sized["bound_by"] == "disk"
    assert sized["estimated_time_on_gpu"] == format_seconds(tokens * 4 * 4096 * 2 / MEASURED_DISK_BYTES_PER_S)
    assert sized["regenerate"] is True and sized["problems_here"] == []
    assert sized["tokenizer"] == "the verifier's own tokenizer"
    # streamed: one shard here, so the whole data is the window; the verifier runs once per epoch
    assert sized["stream_disk_peak_gb"] == sized["bytes_total_gb"] and sized["stream_verifier_passes"] == 10
    assert (tmp_path / "out" / "hidden_states").is_dir() and not list((tmp_path / "out" / "hidden_states").iterdir())

    # the weights' index gives the parameter count when present; the text names the caveats
    (config_only / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 16_060_522_496}}))
    code, text = plan(capsys, *settings, json_output=False)
    assert code == 0
    assert "8.03 B parameters (from safetensors index)" in text and "with regeneration on" in text
    assert f"{tokens:,} tokens in 1 shards" in text and "the disk and host memory checks pass" in text
    assert "offline: " in text and "stream (extract.mode" in text and "the verifier runs once per epoch" in text

    main(["plan", str(PRESET), *[a for s in settings for a in ("--set", s)], "--json", "--disk-gb-per-s", "10"])
    faster_disk = json.loads(capsys.readouterr().out)  # a disk 10x faster: the forward's measured rate binds
    assert faster_disk["bound_by"] == "compute" and faster_disk["estimated_time_on_gpu"] == format_seconds(
        tokens / MEASURED_TOKENS_PER_S["compiled"] * 8.03e9 / MEASURED_PARAMETERS)

    code, text = plan(capsys, *settings[:-1], "extract.reserve_disk_gb=1000000", json_output=False)
    assert code == 1 and "extraction would refuse to start: not enough disk" in text


@pytest.mark.parametrize("preset, verifier, gpus", [
    ("llama-8b-1gpu.yaml", "llama-3.1-8b-instruct", 1),
    ("large-verifier.yaml", "kimi-k2.5", 8),
])
def test_a_preset_is_planned_from_its_config_only_folder_and_nothing_is_left_behind(preset, verifier, gpus, tmp_path,
                                                                                    monkeypatch, capsys):
    """What a user runs first on a fresh clone: no model anywhere, the verifier's config.json shipped
    under deployments/verifiers/, a stand-in tokenizer under the verifier's own chat template."""
    monkeypatch.chdir(DEPLOYMENTS.parent)  # the presets name the folders relative to the clone
    out = tmp_path / "out"
    code, out_json = plan(capsys, f"output_dir={out}", "data.max_rows=20", "extract.reserve_disk_gb=0",
                          keep=False, preset=DEPLOYMENTS / preset)
    assert code == 0, out_json
    sized = json.loads(out_json)
    assert sized["verifier"] == str(DEPLOYMENTS / "verifiers" / verifier) and sized["gpus"] == gpus
    assert sized["tokenizer"].startswith("a stand-in, SmolLM2's tokenizer (49,152 tokens) under the verifier's own "
                                         "chat template")
    assert sized["tokens"] > 2_000 and sized["prepared"] is None and sized["estimated_time_on_gpu"]
    assert not out.exists()  # nothing written: no prepared data, no hidden_states folder


def test_plan_names_a_missing_verifier_folder(tmp_path, capsys):
    code = main(["plan", str(PRESET), "--set", f"verifier.path={tmp_path / 'absent'}",
                 "--set", f"output_dir={tmp_path / 'out'}"])
    assert code == 2 and "verifier folder not found" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
