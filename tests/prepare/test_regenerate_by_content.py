"""Regeneration keyed by content (tasks/prepare/answer_store.py): a file added to a drop folder costs
only its own conversations, whose answers are the bytes a fresh run writes; a conversation repeated
or moved is answered once. The real SmolLM2 answers (transformers, on CPU), through the jobs the flow
builds (`regeneration_job`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.common.config import PipelineConfig
from tasks.prepare.chat_data import read_conversation, read_rows
from tasks.prepare.generators import TransformersGenerator
from tasks.prepare.regenerate import regenerate, regeneration_job


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def run(output_dir: Path, incoming: Path, smollm2: str) -> tuple[Path, dict]:
    """Regenerate the drop folder `incoming` as the flow does: the conversations file and its report."""
    job = regeneration_job(PipelineConfig.model_validate({
        "name": "t", "output_dir": str(output_dir), "verifier": {"path": smollm2},
        "data": {"sources": [str(incoming)], "max_seq_len": 256,
                 # chunk_size 2: files of several chunks; batches of 2 rows, padded (the batch changes the answer)
                 "regenerate": {"enabled": True, "backend": "transformers", "max_new_tokens": 4, "max_turns": 1,
                                "chunk_size": 2, "batch_size": 2}}}))
    output = regenerate(job, in_process=True)
    return output, json.loads((Path(job.out_dir) / "report.json").read_text())


@pytest.fixture
def prompts_generated(monkeypatch) -> list[list[int]]:
    """Every prompt the transformers generator answers in this test (the real generator does the work)."""
    prompts: list[list[int]] = []
    generate = TransformersGenerator.__call__

    def recording(self, batch, limits=None, seeds=None):
        prompts.extend(batch)
        return generate(self, batch, limits, seeds)

    monkeypatch.setattr(TransformersGenerator, "__call__", recording)
    return prompts


def test_a_new_file_costs_only_its_conversations_and_gets_a_fresh_runs_bytes(smollm2, sharegpt, tmp_path,
                                                                             prompts_generated):
    # conversations whose first question fits max_seq_len (each is then one prompt to the generator)
    # (short ones: a CPU answers them in seconds)
    usable = [row.data for row in read_rows([sharegpt], 100) if (c := read_conversation(row.data)) and
              not hasattr(c, "reason") and len(c.messages[0]["content"]) < 150][:7]
    assert len(usable) == 7
    a, b = usable[:4], [usable[4], usable[5], usable[1], usable[6], usable[4]]
    new_in_b = 3  # b's rows 2 (a's row 1) and 4 (its own row 0 again) are no new conversations
    incoming = tmp_path / "incoming"
    incoming.mkdir()
    write_jsonl(incoming / "a.jsonl", a)
    _, first = run(tmp_path / "out", incoming, smollm2)
    assert first["answered_now"] == len(prompts_generated) == len(a) and first["reused"] == 0

    write_jsonl(incoming / "b.jsonl", b)  # new traffic arrives
    prompts_generated.clear()
    added, report = run(tmp_path / "out", incoming, smollm2)
    assert len(prompts_generated) == report["answered_now"] == new_in_b  # only b's new conversations
    assert report["reused"] == len(a) + len(b) - new_in_b and report["conversations"] == len(a) + len(b)
    assert report["ranks"][0]["conversations"] == new_in_b

    prompts_generated.clear()
    fresh, fresh_report = run(tmp_path / "fresh", incoming, smollm2)
    assert len(prompts_generated) == fresh_report["answered_now"] == len(a) + new_in_b  # repeats answered once
    assert added.read_bytes() == fresh.read_bytes()  # b's answers (and a's) are a fresh run's, byte for byte
    lines = [json.loads(line) for line in added.read_text().splitlines()]
    assert [line["id"] for line in lines] == [f"a.jsonl:{i}" for i in range(4)] + [f"b.jsonl:{i}" for i in range(5)]
    by_id = {line["id"]: line["messages"] for line in lines}
    assert by_id["b.jsonl:2"] == by_id["a.jsonl:1"] and by_id["b.jsonl:4"] == by_id["b.jsonl:0"]

    # a's conversations moved to other positions: nothing to answer, each row keeps its conversation's answer
    write_jsonl(incoming / "a.jsonl", a[::-1])
    prompts_generated.clear()
    moved, moved_report = run(tmp_path / "out", incoming, smollm2)
    assert prompts_generated == [] and moved_report["answered_now"] == 0 and moved_report["backend"] == ""
    assert moved_report["reused"] == len(a) + len(b)
    moved_by_id = {line["id"]: line["messages"] for line in map(json.loads, moved.read_text().splitlines())}
    assert all(moved_by_id[f"a.jsonl:{i}"] == by_id[f"a.jsonl:{3 - i}"] for i in range(4))
    # one store, one folder per run (named by its sources)
    regenerated = tmp_path / "out" / "regenerated"
    assert len(list(regenerated.glob("answers-*"))) == 1 and len(list(regenerated.glob("*/conversations.jsonl"))) == 3


def test_a_run_keeps_its_plan_across_attempts_and_ranks_refuse_to_start_without_one(tmp_path, smollm2, sharegpt):
    from tasks.common.config import RegenerateSettings
    from tasks.prepare.answer_store import NoPlanError, read_plan, run_plan
    from tasks.prepare.regenerate import RegenerateJob, regenerate_rank

    rows = [(f"a.jsonl:{i}", f"c{i}") for i in range(5)]
    planned = run_plan(tmp_path, rows, {"c0": {}}, 2)
    assert planned == [["c1", "c2"], ["c3", "c4"]] == read_plan(tmp_path, rows, 2)
    # a second attempt after a kill recorded c1 alone: the same chunks (c1's chunk is redone whole)
    assert run_plan(tmp_path, rows, {"c0": {}, "c1": {}}, 2) == planned
    # c0's answer since removed from the store: no chunk of the plan would answer it, so the run is planned again
    assert run_plan(tmp_path, rows, {"c1": {}}, 2) == [["c0", "c2"], ["c3", "c4"]]
    with pytest.raises(NoPlanError, match="plans other conversations"):
        read_plan(tmp_path, rows[:4], 2)

    settings = RegenerateSettings(enabled=True, backend="transformers", max_new_tokens=4).model_dump()
    job = RegenerateJob([sharegpt], 2, smollm2, str(tmp_path / "unplanned"), 256, settings)
    with pytest.raises(NoPlanError, match="is missing"):
        regenerate_rank(job, 0, 2)
