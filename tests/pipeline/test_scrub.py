"""`eagle3-pipeline verify OUTPUT_DIR` (tasks/scrub.py) on a real completed run: the damage a cached run
skips (a byte flipped in a shard, the newest checkpoint's weights cut to half, an answer edited in the
regeneration's journal; then a validation report cut short) is found by the command in its own process, moved
aside, and repaired by the next run of the same config, which gives the same draft and validates it again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from flow_support import small_config, task_states, write_sample_data

from tasks.prepare.answer_store import answer_journal
from tasks.train.checkpoints import checkpoint_dirs

pytestmark = pytest.mark.system  # a regenerating run, damaged and repaired: `make test` runs it, `make test-fast` does not

ROOT = Path(__file__).resolve().parents[2]
# a small regeneration: 4 conversations, one turn each, in chunks of 2 (a redone chunk is 2 answers)
REGENERATED_DATA = {"max_rows": 4, "regenerate": {"enabled": True, "backend": "transformers", "max_new_tokens": 4,
                                                  "max_turns": 1, "chunk_size": 2, "batch_size": 2}}


def run(config):
    from flows.pipeline import eagle3_pipeline

    state = eagle3_pipeline(config, return_state=True)
    assert state.is_completed(), state
    return state.result(), task_states(state.state_details.flow_run_id)


def verify(output_dir: Path) -> tuple[int, str]:
    """The command in a process of its own: its exit status and what it printed."""
    done = subprocess.run([sys.executable, "-m", "flows.cli", "verify", str(output_dir)], capture_output=True,
                          text=True, cwd=ROOT, timeout=300, check=False)
    return done.returncode, done.stdout + done.stderr


def test_verify_finds_what_a_cached_run_skips_and_the_next_run_repairs_it(prefect_api, sharegpt, tmp_path):
    data = write_sample_data(sharegpt, tmp_path / "chats.jsonl", 6)
    out = tmp_path / "out"
    config = small_config(out, data, data=REGENERATED_DATA, train={"epochs": 2, "eval_every": 1})
    first, _ = run(config)

    # a byte flipped in a shard, its size and mtime kept (only its checksum tells)
    manifest = Path(first["extracted"].manifest)
    shard = manifest.parent / json.loads(manifest.read_text())["shards"][-1]["name"]
    stat, blob = shard.stat(), bytearray(shard.read_bytes())
    blob[-10] ^= 0xFF
    shard.write_bytes(bytes(blob))
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    # the newest checkpoint's weights cut to half
    train_folder = Path(first["trained"].draft_path).parent
    checkpoints = checkpoint_dirs(train_folder)
    assert len(checkpoints) >= 2  # a resume has an intact one to start from
    weights = checkpoints[-1] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    # one answer edited in the regeneration's journal, still valid JSON
    [store] = out.glob("regenerated/answers-*")  # the regeneration's answer store
    journal = answer_journal(store)
    answers = journal.entries()
    part = min(journal.folder.glob("*.jsonl"))
    lines = part.read_text().splitlines()
    record = json.loads(lines[0])
    record["messages"][-1]["content"] += " (edited)"
    part.write_text("\n".join([json.dumps(record), *lines[1:]]) + "\n")
    draft = (Path(first["trained"].draft_path) / "model.safetensors").read_bytes()

    code, printed = verify(out)
    assert code == 1, printed
    for damaged in (shard, checkpoints[-1], part):
        assert f"damaged: {damaged}" in printed, printed
    assert "eagle3-pipeline run CONFIG" in printed
    assert shard.with_name(shard.name + ".damaged").is_file() and not shard.exists()
    assert (train_folder / "damaged" / checkpoints[-1].name).is_dir() and not checkpoints[-1].exists()
    assert part.with_name(part.name + ".damaged").is_file()
    assert journal.entries().keys() == answers.keys() - {record["key"]}  # the other records kept

    second, states = run(config)  # the same config, no refresh: each damaged stage runs again, the rest is cached
    assert {name: state for name, (state, _) in states.items()} == {
        "prepare": "Completed", "extract": "Completed", "vocab": "Cached", "train": "Completed", "validate": "Cached"}
    assert second["extracted"].shards_extracted == 1 and shard.is_file()
    assert journal.entries()[record["key"]]["messages"] == answers[record["key"]]["messages"]  # answered again
    assert checkpoints[-1].is_dir()
    assert (Path(second["trained"].draft_path) / "model.safetensors").read_bytes() == draft
    code, printed = verify(out)  # a clean folder
    intact = f"verified {out}: every shard, checkpoint, draft, journal, vocabulary and validation report is intact"
    assert code == 0 and intact in printed

    # the validation report cut short (the registry and the run summary read it; a cached run does not)
    report = Path(second["validated"].report_json)
    written = json.loads(report.read_text())
    report.write_text(report.read_text()[:100])
    code, printed = verify(out)
    assert code == 1 and f"damaged: {report}: not a validation report: not JSON (" in printed, printed
    assert "the next run validates that draft again" in printed and not report.exists()
    assert report.with_name("report.json.damaged").is_file()
    third, states = run(config)
    assert {name: state for name, (state, _) in states.items()} == {
        "prepare": "Cached", "extract": "Cached", "vocab": "Cached", "train": "Cached", "validate": "Completed"}
    assert json.loads(Path(third["validated"].report_json).read_text())["static"] == written["static"]
    code, printed = verify(out)
    assert code == 0 and intact in printed


def test_verify_refuses_a_folder_that_is_not_an_output_folder(tmp_path, capsys):
    from flows.cli import main

    assert main(["verify", str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'missing'} is not a folder\n"
    assert main(["verify", str(tmp_path)]) == 2
    assert "holds no pipeline outputs" in capsys.readouterr().err
