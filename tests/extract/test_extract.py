"""Extraction with the transformers backend: real SmolLM2 on real ShareGPT samples."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

from tasks.common.folder_lock import FolderLockedError, held_by_live_process
from tasks.extract.plan import ExtractError
from tasks.extract.shards import ShardError, ShardReader, read_manifest, read_metadata, shard_journal
from tasks.extract.stage import ExtractJob, run_extraction
from tasks.prepare.dataset import load_prepared
from tasks.prepare.stage import prepare

SETTINGS = {"batch_tokens": 2048, "shard_tokens": 1500}


@pytest.fixture(scope="module")
def prepared(smollm2, sharegpt, tmp_path_factory):
    return prepare(smollm2, [sharegpt], tmp_path_factory.mktemp("prep"), max_seq_len=256, max_rows=30)


def job_for(prepared, smollm2, out: Path, **settings) -> ExtractJob:
    return ExtractJob(prepared.path, prepared.fingerprint, smollm2, str(out), settings={**SETTINGS, **settings})


@pytest.fixture(scope="module")
def reference(prepared, smollm2, tmp_path_factory):
    """An uninterrupted single-process extraction, the yardstick of the other tests."""
    out = tmp_path_factory.mktemp("reference")
    result = run_extraction(job_for(prepared, smollm2, out), in_process=True)
    return out, result


def shard_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("shard-*.safetensors"))}


def test_states_equal_a_direct_forward_last_layer_pre_norm(reference, prepared, smollm2):
    from transformers import AutoModelForCausalLM

    _, result = reference
    assert result.layers == [2, 15, 27, 30] and result.shards >= 4
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.bfloat16).eval()
    pre_norm = {}
    model.model.layers[-1].register_forward_hook(lambda m, a, out: pre_norm.setdefault("h", out))
    reader = ShardReader(result.manifest)
    data = load_prepared(prepared.path)
    row_of = {sid: i for i, sid in enumerate(data["sample_id"])}
    for i in range(0, len(reader), 7):
        input_ids, stored = reader[i]
        assert input_ids.tolist() == data[row_of[reader.sample_ids[i]]]["input_ids"]
        pre_norm.clear()
        with torch.no_grad():
            out = model(input_ids[None], output_hidden_states=True)
        expected = [out.hidden_states[2], out.hidden_states[15], out.hidden_states[27], pre_norm["h"]]
        assert stored.shape == (len(input_ids), 4, 576) and stored.dtype == torch.bfloat16
        for j, ref in enumerate(expected):
            cos = torch.nn.functional.cosine_similarity(stored[:, j].float(), ref[0].float(), dim=-1)
            assert cos.min() > 0.995, (i, j, cos.min())
        # and the last one is not the post-norm state transformers reports as hidden_states[30]
        post = torch.nn.functional.cosine_similarity(stored[:, 3].float(), out.hidden_states[30][0].float(), dim=-1)
        assert post.mean() < 0.9


def test_kill_mid_run_then_resume_redoes_at_most_the_shard_in_flight(reference, prepared, smollm2, tmp_path):
    ref_dir, ref_result = reference
    job = job_for(prepared, smollm2, tmp_path)
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps(asdict(job)))
    worker = subprocess.Popen([sys.executable, "-m", "tasks.extract.stage", "--job", str(job_file)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not shard_journal(tmp_path).entries() and time.monotonic() < deadline:
        time.sleep(0.2)
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    finished = shard_bytes(tmp_path)
    assert 1 <= len(finished) < ref_result.shards
    result = run_extraction(job, in_process=True)
    assert result.shards_extracted == ref_result.shards - len(finished)
    after = shard_bytes(tmp_path)
    assert all(after[name] == data for name, data in finished.items())  # finished shards untouched
    assert after == shard_bytes(ref_dir)  # identical to the uninterrupted run
    assert not list(tmp_path.glob(".tmp-*"))


def test_the_plan_of_a_selection_reads_the_selected_rows_in_their_order(prepared):
    """The plan reads token ids a batch of rows at a time as Arrow buffers (a row at a time through
    `datasets` took 26 s for 64k rows): under a selection (an indices mapping, rows out of order,
    batches of 4 rows here) it sees the selected rows in their order, and plans what a dataset
    holding just those rows plans."""
    from tasks.extract.plan import plan_shards
    from tasks.prepare.dataset import token_rows

    data = load_prepared(prepared.path)
    order = list(range(len(data)))[::-2]
    selected = data.select(order)
    assert [ids.tolist() for ids in token_rows(selected, batch_size=4)] == [data[r]["input_ids"] for r in order]
    assert plan_shards(selected, "any", 512) == plan_shards(selected.flatten_indices(), "any", 512)


def test_complete_folder_rerun_does_not_load_the_verifier(reference, prepared, smollm2):
    ref_dir, ref_result = reference
    result = run_extraction(job_for(prepared, smollm2, ref_dir), in_process=True)
    assert (result.verifier_loaded, result.shards_extracted) == (False, 0)
    assert result.manifest == ref_result.manifest


def test_changed_layers_make_old_shards_stale(reference, prepared, smollm2, tmp_path):
    ref_dir, _ = reference
    shutil.copytree(ref_dir, tmp_path, dirs_exist_ok=True)
    result = run_extraction(job_for(prepared, smollm2, tmp_path, aux_layers=[3, 14, 26]), in_process=True)
    assert result.verifier_loaded and result.shards_extracted == result.shards
    assert result.layers == [3, 14, 26, 30]
    manifest = json.loads(Path(result.manifest).read_text())
    for shard in manifest["shards"]:
        assert json.loads(read_metadata(tmp_path / shard["name"])["layers"]) == [3, 14, 26, 30]
    assert len(list(tmp_path.glob("shard-*"))) == 2 * result.shards  # the old ones were never reused


def test_prune_removes_the_shards_of_other_inputs(reference, prepared, smollm2, tmp_path):
    from flows.cli import main

    ref_dir, _ = reference
    shutil.copytree(ref_dir, tmp_path, dirs_exist_ok=True)
    other = run_extraction(job_for(prepared, smollm2, tmp_path, aux_layers=[4, 12, 20]), in_process=True)
    before = shard_bytes(tmp_path)
    assert main(["prune-shards", str(tmp_path)]) == 0  # both manifests still list their shards
    assert shard_bytes(tmp_path) == before
    assert main(["prune-shards", str(tmp_path), "--keep", other.manifest]) == 0
    kept = {s["name"] for s in json.loads(Path(other.manifest).read_text())["shards"]}
    assert set(shard_bytes(tmp_path)) == kept and len(list(tmp_path.glob("manifest-*.json"))) == 1
    assert run_extraction(job_for(prepared, smollm2, tmp_path, aux_layers=[4, 12, 20]),
                          in_process=True).shards_extracted == 0


def test_truncated_or_corrupt_shard_is_detected_and_redone(reference, prepared, smollm2, tmp_path):
    ref_dir, _ = reference
    shutil.copytree(ref_dir, tmp_path, dirs_exist_ok=True)
    shards = sorted(tmp_path.glob("shard-*.safetensors"))
    with shards[0].open("r+b") as f:
        f.truncate(shards[0].stat().st_size // 2)
    data = bytearray(shards[1].read_bytes())
    data[-100] ^= 0xFF  # one flipped byte in the hidden states
    shards[1].write_bytes(bytes(data))
    result = run_extraction(job_for(prepared, smollm2, tmp_path), in_process=True)
    assert result.shards_extracted == 2
    assert shard_bytes(tmp_path) == shard_bytes(ref_dir)


def test_damage_that_keeps_size_and_mtime_is_repaired_by_the_final_verification(reference, prepared, smollm2,
                                                                               tmp_path):
    """Bit rot, or a copy tool that keeps times: the journal trusts the shard, the full final
    verification finds it and redoes it instead of failing the run."""
    ref_dir, _ = reference
    shutil.copytree(ref_dir, tmp_path, dirs_exist_ok=True)
    shard = sorted(tmp_path.glob("shard-*.safetensors"))[2]
    stat = shard.stat()
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    result = run_extraction(job_for(prepared, smollm2, tmp_path), in_process=True)
    assert (result.shards_extracted, result.verifier_loaded) == (1, True)
    assert shard_bytes(tmp_path) == shard_bytes(ref_dir)


@pytest.mark.parametrize("damage", [b"\x9c\xff\x00garbage\xfe" * 50, b"5\n", b'{"name": "x", "mtime_ns": 1}\n'],
                         ids=["random-bytes", "not-an-object", "missing-field"])
def test_damaged_journal_is_discarded_and_rebuilt_from_the_shards(reference, prepared, smollm2, tmp_path, damage):
    ref_dir, ref_result = reference
    shutil.copytree(ref_dir, tmp_path, dirs_exist_ok=True)
    journal = next((tmp_path / "journal").glob("*.jsonl"))
    journal.write_bytes(damage + journal.read_bytes())
    result = run_extraction(job_for(prepared, smollm2, tmp_path), in_process=True)
    assert (result.shards_extracted, result.verifier_loaded) == (0, False)  # verified in full, nothing redone
    assert shard_bytes(tmp_path) == shard_bytes(ref_dir)
    for path in (tmp_path / "journal").glob("*.jsonl"):  # the damaged file was discarded, then written anew
        assert not path.read_bytes().startswith(damage) and shard_journal(tmp_path).parse(path.read_bytes())
    rebuilt = shard_journal(tmp_path).entries()
    assert sorted(rebuilt) == sorted(shard_bytes(ref_dir)) and ref_result.shards == len(rebuilt)


def test_garbage_or_truncated_manifest_is_a_clear_error_and_a_rerun_rewrites_it(reference, prepared, smollm2,
                                                                                 tmp_path):
    ref_dir, ref_result = reference
    shutil.copytree(ref_dir, tmp_path, dirs_exist_ok=True)
    manifest = tmp_path / Path(ref_result.manifest).name
    good = manifest.read_bytes()
    unknown_dtype = json.dumps({**json.loads(good), "dtype": "int8"}).encode()
    for damaged in (bytes(range(256)) * 4, good[: len(good) // 2], b"[1, 2]", unknown_dtype):
        manifest.write_bytes(damaged)
        with pytest.raises(ShardError, match=f"manifest {manifest} is damaged"):
            ShardReader(manifest)
    result = run_extraction(job_for(prepared, smollm2, tmp_path), in_process=True)
    assert result.shards_extracted == 0 and read_manifest(manifest) == json.loads(good)


def test_a_second_run_on_a_locked_folder_is_refused_and_a_killed_holder_does_not_block(prepared, smollm2,
                                                                                      tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from tasks.common.folder_lock import folder_lock\n"
         "with folder_lock(sys.argv[1], 'extraction'):\n    print('locked', flush=True); time.sleep(600)",
         str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    assert held_by_live_process(tmp_path) is True  # what bench/recipe.py asks of a run's train folder
    with pytest.raises(FolderLockedError, match=f"in use by another extraction run \\(pid {holder.pid} on host "
                                                f"{socket.gethostname()}"):
        run_extraction(job_for(prepared, smollm2, tmp_path), in_process=True)
    assert not list(tmp_path.glob("shard-*"))  # refused before any work
    holder.send_signal(signal.SIGKILL)  # its lock file stays behind, its lock goes with it
    holder.wait()
    assert (tmp_path / ".lock").is_file() and held_by_live_process(tmp_path) is False
    with pytest.raises(ExtractError, match="not enough disk"):  # past the lock: the plan runs (and refuses)
        run_extraction(job_for(prepared, smollm2, tmp_path, reserve_disk_gb=1e9), in_process=True)


def test_two_worker_processes_fill_one_folder(reference, prepared, smollm2, tmp_path):
    ref_dir, ref_result = reference
    progress, plans = [], []
    result = run_extraction(job_for(prepared, smollm2, tmp_path, workers=2), callback=progress.append,
                            on_plan=lambda plan: plans.append(plan.summary()))
    assert result.shards_extracted == ref_result.shards
    # the plan before any model loads, then again with the time measured on the first batches
    assert len(plans) == 2 and "measured" not in plans[0]["estimated_time"]
    assert plans[1]["estimated_time"].endswith("(measured)") and plans[1]["measured_tokens_per_s"] > 0
    assert shard_bytes(tmp_path) == shard_bytes(ref_dir)
    reader = ShardReader(result.manifest)
    assert sorted(reader.sample_ids) == sorted(load_prepared(prepared.path)["sample_id"])
    assert progress and progress[-1].done == progress[-1].total == ref_result.tokens
    writers = {p.name for p in (tmp_path / "journal").glob("*.jsonl")}
    assert len(writers) == 2


def test_bad_inputs_fail_before_loading(prepared, smollm2, tmp_path):
    from tasks.common.verifier import VerifierError

    with pytest.raises(VerifierError, match="outside the verifier's depth"):
        run_extraction(job_for(prepared, smollm2, tmp_path, aux_layers=[2, 15, 40]), in_process=True)
    # sizes in a unit that shows them: this extraction's few MB do not read "0.0 GB"
    with pytest.raises(ExtractError, match=r"not enough disk in .*: [1-9][\d.]* MB to write \+ 1,000,000,000\.0 GB "
                                           r"reserve > [\d,.]+ [GM]B free"):
        run_extraction(job_for(prepared, smollm2, tmp_path, reserve_disk_gb=1e9), in_process=True)
    with pytest.raises(ExtractError, match="shard buffers need .* lower extract.shard_tokens"):
        run_extraction(job_for(prepared, smollm2, tmp_path, workers=10**6), in_process=True)
    with pytest.raises(ExtractError, match="exceeds extract.batch_tokens"):
        run_extraction(job_for(prepared, smollm2, tmp_path, batch_tokens=100), in_process=True)
    missing = replace(job_for(prepared, smollm2, tmp_path), prepared_path=str(tmp_path / "gone"))
    with pytest.raises(ExtractError, match="prepared data not found"):
        run_extraction(missing, in_process=True)
    assert not list(tmp_path.glob("shard-*"))


def test_the_plan_measures_the_disk_it_writes_to(tmp_path):
    """A small verifier's extraction is bound by the disk (SmolLM2 on the H200: 1.47M tokens/s of
    forward, ~240k written): the plan times a short synced write in the output folder."""
    from tasks.extract.plan import disk_write_rate

    rate = disk_write_rate(tmp_path)
    assert rate and rate > 1e6 and not list(tmp_path.iterdir())
    assert disk_write_rate(tmp_path / "absent") is None  # cannot write there: no disk bound, no error


def test_the_compute_estimate_divides_over_the_gpus_and_not_over_cpu_workers():
    """With extract.workers N (or a vLLM engine over N GPUs), each GPU extracts its share: the
    planned compute time is 1/N, each capped at the fastest extraction measured on one GPU; CPU
    workers share one machine's cores, and its measured rate."""
    from tasks.extract.plan import MEASURED_MAX_TOKENS_PER_S, compute_seconds

    parameters, tokens, flops = 8e9, 1_000_000, 4e14  # 8B shapes at 40% of 400 TFLOP/s: 100 s
    one = compute_seconds(parameters, tokens, flops, gpus=1)
    assert one == pytest.approx(2 * parameters * tokens / (0.4 * flops)) == pytest.approx(100)
    assert compute_seconds(parameters, tokens, flops, gpus=4) == pytest.approx(one / 4)
    small = 135e6  # SmolLM2: its FLOPs promise more than any GPU was measured to extract
    assert compute_seconds(small, tokens, flops, gpus=1) == pytest.approx(tokens / MEASURED_MAX_TOKENS_PER_S)
    assert compute_seconds(small, tokens, flops, gpus=2) == pytest.approx(tokens / MEASURED_MAX_TOKENS_PER_S / 2)
    assert compute_seconds(parameters, tokens, flops, gpus=None) == pytest.approx(one)  # the CPU: no cap, no share


def test_extraction_computes_on_one_gpu_per_worker_or_the_vllm_engines_tensor_parallel_size():
    from tasks.common.config import ExtractSettings

    assert ExtractSettings(workers=4).gpus == 4
    assert ExtractSettings(backend="vllm", tensor_parallel_size=8, workers=2).gpus == 8
