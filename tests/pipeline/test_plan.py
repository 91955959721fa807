"""`eagle3-pipeline plan`: the presets sized on this CPU machine from config-only folders, nothing
written unless asked."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from flows.cli import main
from tasks.common.config import load_config
from tasks.common.progress import format_seconds
from tasks.common.verifier import TOKENIZER_FILES, WEIGHT_SUFFIXES
from tasks.extract.plan import MEASURED_MAX_TOKENS_PER_S
from tasks.plan import H100_BF16_TFLOPS, MEASURED_DISK_BYTES_PER_S, MEASURED_PARAMETERS, MEASURED_TOKENS_PER_S
from tasks.prepare.dataset import read_report
from tasks.train.sizing import MEASURED_MAX_STEPS_PER_S, MEASURED_TRAIN_TOKENS_PER_S

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
    assert sized["storage_dtype"] == "bf16" and sized["recommended_storage_dtype"] == "fp8_e4m3"  # half the bytes
    assert sized["regenerate"] is True and sized["problems_here"] == []
    assert sized["tokenizer"] == "the verifier's own tokenizer"
    # streamed: one shard here, so the whole data is the window; the verifier runs once per epoch
    assert sized["stream_disk_peak_gb"] == sized["bytes_total_gb"] and sized["stream_verifier_passes"] == 10
    # training: every epoch of the held-in tokens in 8192-token steps, at the rate measured for this very
    # draft shape (8B), which its matmuls bound; offline extracts then trains
    config = load_config(PRESET)
    assert sized["train_steps"] == 10 * math.ceil(tokens * (1 - config.train.val_fraction) / 8192)
    assert sized["train_bound_by"] == "arithmetic"
    assert sized["train_tokens_per_s"] == pytest.approx(MEASURED_TRAIN_TOKENS_PER_S, rel=1e-3)
    train_s = sized["train_steps"] * 8192 / sized["train_tokens_per_s"]
    assert sized["estimated_train_time"] == format_seconds(train_s)
    # on one machine the producer takes turns with training on the GPU: at most the sum of the two
    assert sized["stream_shares_gpus"] is True
    assert sized["stream_time"] == format_seconds(train_s + 10 * tokens * 4 * 4096 * 2 / MEASURED_DISK_BYTES_PER_S)
    assert (tmp_path / "out" / "hidden_states").is_dir() and not list((tmp_path / "out" / "hidden_states").iterdir())

    # the weights' index gives the parameter count when present; the text names the caveats
    (config_only / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 16_060_522_496}}))
    code, text = plan(capsys, *settings, json_output=False)
    assert code == 0
    assert "8.03 B parameters (from safetensors index)" in text and "with regeneration on" in text
    assert f"{tokens:,} tokens in 1 shards" in text and "the disk and host memory checks pass" in text
    assert "offline: " in text and "stream (extract.mode" in text and "the verifier runs once per epoch" in text
    # in fp8 shards the forward binds, at the measured rate: the disk takes their 4 x (4096 + 4) bytes a token in time
    assert tokens * 4 * (4096 + 4) / MEASURED_DISK_BYTES_PER_S < tokens / MEASURED_TOKENS_PER_S["compiled"]
    fp8_time = format_seconds(tokens / MEASURED_TOKENS_PER_S["compiled"] * 8.03e9 / MEASURED_PARAMETERS)
    assert f"the disk binds bf16 shards: extract.storage_dtype: fp8_e4m3 writes half the bytes, about {fp8_time}" in text

    main(["plan", str(PRESET), *[a for s in settings for a in ("--set", s)], "--json", "--disk-gb-per-s", "10"])
    faster_disk = json.loads(capsys.readouterr().out)  # a disk 10x faster: the forward's measured rate binds
    assert faster_disk["bound_by"] == "compute" and faster_disk["estimated_time_on_gpu"] == format_seconds(
        tokens / MEASURED_TOKENS_PER_S["compiled"] * 8.03e9 / MEASURED_PARAMETERS)
    assert faster_disk["recommended_storage_dtype"] == "bf16"  # the configured one, where the disk does not bind

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
    # both presets require live validation, and vLLM has an EAGLE-3 interface for both classes; Kimi-K2.5's
    # engine also loads its processor, from files the run's folder holds and this config-only one does not
    serving = sized["live_validation"]
    assert "with an EAGLE-3 draft" in serving and serving.endswith(
        "holds no weights, so its own files were not checked") == (verifier == "kimi-k2.5"), serving


def test_a_small_drafts_training_is_planned_at_the_hosts_step_rate_and_streams_at_its_pace(tmp_path, capsys):
    """The SmolLM2 preset: a draft too small to fill a GPU trains at the step rate measured on the host;
    its max_steps ends training within a few epochs, and a stream extracts only the epochs begun. On GPUs
    of their own (Ray) the stream goes at training's pace (its shards write far faster than the draft
    trains); on one machine the producer takes turns with training on the GPU (at most the sum)."""
    preset = DEPLOYMENTS / "smollm2-h200.yaml"
    settings = (f"output_dir={tmp_path / 'out'}", "data.max_rows=300", "data.synthesize.prompts=0",
                "extract.reserve_disk_gb=0", "train.max_steps=100", "train.total_seq_len=1024")
    code, out_json = plan(capsys, *settings, keep=False, preset=preset)
    assert code == 0, out_json
    sized = json.loads(out_json)
    steps_per_epoch = math.ceil(sized["tokens"] * (1 - load_config(preset).train.val_fraction) / 1024)
    assert sized["train_bound_by"] == "host" and sized["train_tokens_per_s"] == round(MEASURED_MAX_STEPS_PER_S * 1024)
    assert sized["train_steps"] == 100 < 6 * steps_per_epoch  # max_steps, before the preset's 6 epochs end
    passes = sized["stream_verifier_passes"]
    assert passes == math.ceil(100 / steps_per_epoch) < 6
    train_s, extract_s = 100 / MEASURED_MAX_STEPS_PER_S, sized["tokens"] / MEASURED_MAX_TOKENS_PER_S  # fp8: compute
    assert sized["estimated_train_time"] == format_seconds(train_s)
    assert sized["stream_shares_gpus"] and sized["stream_time"] == format_seconds(train_s + passes * extract_s)
    assert sized["offline_time"] == format_seconds(train_s + extract_s)

    code, out_json = plan(capsys, *settings, "cluster.executor=ray", keep=False, preset=preset)
    assert code == 0, out_json
    on_ray = json.loads(out_json)
    assert not on_ray["stream_shares_gpus"] and on_ray["stream_time"] == on_ray["estimated_train_time"]

    # on a disk that takes anything, a small verifier's extraction is bound by the fastest one measured,
    # not by its FLOPs (135M parameters: ~50x that rate scaled from 8B shapes)
    main(["plan", str(preset), "--set", f"output_dir={tmp_path / 'out'}", "--set", "data.max_rows=300", "--set",
          "data.synthesize.prompts=0", "--set", "extract.reserve_disk_gb=0", "--json", "--disk-gb-per-s", "1000"])
    fast_disk = json.loads(capsys.readouterr().out)
    assert fast_disk["bound_by"] == "compute"
    assert fast_disk["estimated_time_on_gpu"] == format_seconds(fast_disk["tokens"] / MEASURED_MAX_TOKENS_PER_S)


def test_plan_names_a_missing_verifier_folder(tmp_path, capsys):
    code = main(["plan", str(PRESET), "--set", f"verifier.path={tmp_path / 'absent'}",
                 "--set", f"output_dir={tmp_path / 'out'}"])
    assert code == 2 and "verifier folder not found" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_cluster_plan_bench_sizes_both_modes_from_the_plan_code():
    """bench/cluster_plan.py (docs/SCALE.md's tables) on the pipeline's own plan and sizing code: the
    shards, the nodes' shares and training on every GPU against one node's."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "bench/cluster_plan.py", "--conversations", "3000", "--nodes", "1", "2"],
                         capture_output=True, text=True, cwd=DEPLOYMENTS.parent, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    sized = json.loads(run.stdout[run.stdout.index("{"):])
    assert sized["plan"]["tokens"] == 3000 * 2048 and sized["bytes_per_token"] == 4 * 7168 * 2
    one, two = sized["nodes"]
    assert one["tokens_per_node"] == sized["plan"]["tokens"] and two["shards_per_node"] == math.ceil(
        sized["plan"]["shards"] / 2)
    assert one["training_time_all_gpus"] == one["training_time_one_node"] == two["training_time_one_node"]
    assert two["training_time_all_gpus"] != two["training_time_one_node"]  # 16 GPUs against 8
    assert sized["stream"]["verifier_passes"] == 3
