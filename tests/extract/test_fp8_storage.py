"""fp8 hidden-state storage (`extract.storage_dtype: fp8_e4m3`): real SmolLM2 on real ShareGPT
samples, extracted once in bf16 and once in fp8 from the same prepared data."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tasks.common.verifier import inspect_verifier
from tasks.extract.plan import make_plan
from tasks.extract.shards import ShardError, ShardReader, read_metadata
from tasks.extract.stage import ExtractJob, run_extraction
from tasks.extract.storage_dtype import all_finite, dequantize, quantize
from tasks.prepare.dataset import load_prepared
from tasks.prepare.stage import prepare
from tasks.train.job import TrainJob
from tasks.train.stage import run_training
from tasks.train.tracking import read_metrics
from tasks.vocab import build_vocab

SETTINGS = {"batch_tokens": 2048, "shard_tokens": 1000}
LAYERS = [2, 15, 27, 30]


@pytest.fixture(scope="module")
def prepared(smollm2, sharegpt, tmp_path_factory):
    return prepare(smollm2, [sharegpt], tmp_path_factory.mktemp("prep"), max_seq_len=192, max_rows=20)


def job_for(prepared, smollm2, out: Path, storage_dtype: str) -> ExtractJob:
    return ExtractJob(prepared.path, prepared.fingerprint, smollm2, str(out),
                      settings={**SETTINGS, "storage_dtype": storage_dtype})


@pytest.fixture(scope="module")
def extractions(prepared, smollm2, tmp_path_factory):
    """{storage dtype: (folder, result)}: the same extraction stored both ways."""
    out = {}
    for dtype in ("bf16", "fp8_e4m3"):
        folder = tmp_path_factory.mktemp(dtype)
        out[dtype] = folder, run_extraction(job_for(prepared, smollm2, folder, dtype), in_process=True)
    return out


def shard_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("shard-*.safetensors"))}


def test_fp8_shards_read_back_within_e4m3_error_of_the_bf16_ones(extractions, prepared, smollm2):
    (_, bf16), (fp8_dir, fp8) = extractions["bf16"], extractions["fp8_e4m3"]
    assert fp8.fingerprint != bf16.fingerprint and fp8.shards == bf16.shards >= 4

    # the layout: e4m3 states, a float32 scale per token and layer, the dtype in metadata and manifest
    manifest = json.loads(Path(fp8.manifest).read_text())
    assert manifest["dtype"] == "float8_e4m3fn" and json.loads(Path(bf16.manifest).read_text())["dtype"] == "bfloat16"
    for shard in manifest["shards"]:
        with safe_open(str(fp8_dir / shard["name"]), "pt") as f:
            states, scales = f.get_tensor("hidden_states"), f.get_tensor("hidden_states_scale")
        assert states.dtype == torch.float8_e4m3fn and states.shape == (shard["tokens"], 4, 576)
        assert scales.dtype == torch.float32 and scales.shape == (shard["tokens"], 4) and (scales > 0).all()
        assert read_metadata(fp8_dir / shard["name"])["storage_dtype"] == "fp8_e4m3"
        assert states.float().abs().amax(-1).max() == 448  # each token's largest value maps to e4m3's max

    # read back: bf16 samples either way, within e4m3's rounding (3-bit mantissa: <= 1/16 of a value)
    exact, stored = ShardReader(bf16.manifest), ShardReader(fp8.manifest)
    assert exact.sample_ids == stored.sample_ids
    worst_error, worst_cos = 0.0, 1.0
    for i in range(len(exact)):
        ids_a, a = exact[i]
        ids_b, b = stored[i]
        assert torch.equal(ids_a, ids_b) and b.dtype == torch.bfloat16 and b.shape == a.shape
        a, b = a.float(), b.float()
        worst_error = max(worst_error, ((b - a).norm(dim=-1) / a.norm(dim=-1)).max().item())
        worst_cos = min(worst_cos, torch.nn.functional.cosine_similarity(a, b, dim=-1).min().item())
    assert worst_error < 1 / 16 and worst_cos > 0.999, (worst_error, worst_cos)

    # half the bytes on disk, and the plan said so before any model loaded
    sizes = {d: sum(len(b) for b in shard_files(folder).values()) for d, (folder, _) in extractions.items()}
    assert sizes["fp8_e4m3"] / sizes["bf16"] <= 0.52, sizes
    verifier = inspect_verifier(smollm2)
    for dtype, (folder, _) in extractions.items():
        plan = make_plan(load_prepared(prepared.path), verifier, LAYERS, folder, compute_dtype="bfloat16",
                         shard_tokens=SETTINGS["shard_tokens"], storage_dtype=dtype)
        assert len(plan.done) == len(plan.shards) and plan.stale_bytes == 0  # its own shards, all valid
        assert plan.bytes_total <= sizes[dtype] <= 1.03 * plan.bytes_total, (dtype, plan.bytes_total, sizes[dtype])


def test_quantization_edges():
    states = torch.randn(3, 4, 64)
    states[0, 1] = 0  # an all-zero state: scale 1, zeros back, no 0/0
    states[1, 2, 7] = 1e4  # one huge value: the token's other values keep their own precision
    quantized, scales = quantize(states)
    back = dequantize(quantized, scales, torch.float32)
    assert all_finite({"hidden_states": quantized, "hidden_states_scale": scales})
    assert torch.equal(back[0, 1], torch.zeros(64)) and scales[0, 1] == 1
    assert back[1, 2, 7] == pytest.approx(1e4, rel=1e-6)
    error = (back - states).abs()
    assert (error <= states.abs() / 16 + scales[..., None] * 2**-9).all()  # e4m3: half an ulp, subnormals
    nan = quantized.clone()
    nan[2, 3, 5] = float("nan")
    assert not all_finite({"hidden_states": nan, "hidden_states_scale": scales})


def test_resume_into_a_folder_of_the_other_dtype_never_mixes(extractions, prepared, smollm2, tmp_path):
    """A folder holding every bf16 shard and all fp8 shards but one: an fp8 run redoes that one
    (the bf16 shard of the same rows is not taken), a bf16 run redoes nothing."""
    (bf16_dir, bf16), (fp8_dir, fp8) = extractions["bf16"], extractions["fp8_e4m3"]
    shutil.copytree(bf16_dir, tmp_path, dirs_exist_ok=True)
    fp8_shards = json.loads(Path(fp8.manifest).read_text())["shards"]
    for shard in fp8_shards[1:]:
        shutil.copy2(fp8_dir / shard["name"], tmp_path)
    result = run_extraction(job_for(prepared, smollm2, tmp_path, "fp8_e4m3"), in_process=True)
    assert result.verifier_loaded and result.shards_extracted == 1 and result.fingerprint == fp8.fingerprint
    listed = {s["name"] for s in json.loads(Path(result.manifest).read_text())["shards"]}
    assert {name: data for name, data in shard_files(tmp_path).items() if name in listed} == shard_files(fp8_dir)
    again = run_extraction(job_for(prepared, smollm2, tmp_path, "bf16"), in_process=True)
    assert (again.verifier_loaded, again.shards_extracted, again.fingerprint) == (False, 0, bf16.fingerprint)
    assert len(shard_files(tmp_path)) == bf16.shards + fp8.shards

    # a manifest that claims another dtype than its shards hold is refused when read
    tampered = json.loads(Path(result.manifest).read_text())
    tampered["dtype"] = "bfloat16"
    (tmp_path / "tampered.json").write_text(json.dumps(tampered))
    with pytest.raises(ShardError, match="stores F8_E4M3 hidden states, tampered.json says bfloat16"):
        ShardReader(tmp_path / "tampered.json")[0]


def test_training_runs_on_fp8_shards(extractions, prepared, smollm2, tmp_path):
    vocab = build_vocab(prepared.path, prepared.fingerprint, smollm2, tmp_path, draft_vocab_size=1024)
    settings = {"total_seq_len": 512, "lr": 2e-3, "log_every": 1, "val_fraction": 0.0, "seed": 3}
    logs = {}
    for dtype in ("fp8_e4m3", "bf16"):
        extracted = extractions[dtype][1]
        out = tmp_path / dtype
        result = run_training(TrainJob(extracted.manifest, prepared.path, vocab.path, smollm2, str(out), LAYERS[:3],
                                       settings={**settings, "max_steps": 3}),
                              extracted.fingerprint, vocab.fingerprint, in_process=True)
        assert result.steps == 3 and Path(result.draft_path, "model.safetensors").is_file()
        logs[dtype] = [m["loss"] for m in read_metrics(out) if m["split"] == "train"]
    # same seed, batches and initial weights: the trainer sees the bf16 run's data within e4m3's rounding
    assert len(logs["fp8_e4m3"]) == 3 and all(math.isfinite(x) for x in logs["fp8_e4m3"])
    assert logs["fp8_e4m3"] == pytest.approx(logs["bf16"], rel=0.02), logs
