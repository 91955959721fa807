"""Regeneration's answer store: answers kept by the content of the conversation they answer, so a
run answers only the conversations no earlier run answered (tasks/prepare/regenerate.py).

- A store is a folder named by what decides an answer besides the conversation itself
  (`store_fingerprint`: the verifier's fingerprint, the settings that change answers, max_seq_len,
  the format). It holds a journal (tasks/common/journal.py: one part file per writer process) of
  records {"key", "messages"}, or {"key", "reason"} for a conversation given up on (kept, not
  retried), keyed by the conversation's `content_key`.
- A run (its sources and max_rows, in a folder of its own) plans its work once, before any rank
  starts (`run_plan`): each source file's conversations whose key neither the store nor an earlier
  row of the run holds, `chunk_size` at a time in source order; no chunk spans two files. So a
  file's new conversations are batched alike whether the other files were answered in an earlier
  run or in this one, and get the same answers. Chunk c is rank c % N's. The plan stays in the
  run's folder: a run resumed after a kill redoes a chunk the kill left part-recorded whole, in the
  batches of an uninterrupted run.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Container
from itertools import groupby
from pathlib import Path

from tasks.common.errors import PermanentError
from tasks.common.journal import Journal

# v5: answers stored by the conversation's content, runs batched file by file
REGENERATE_FORMAT = "regenerate-v5"
PLAN_NAME = "plan.json"


def content_key(messages: list[dict]) -> str:
    """The identity of a conversation: sha256 of its messages' canonical JSON (as read_conversation
    normalizes them, with the empty assistant turn a prompt alone gets)."""
    text = json.dumps(messages, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def store_fingerprint(verifier_fp: str, output_settings: dict, max_seq_len: int) -> str:
    """What decides an answer besides its conversation: the folder name of the store that keeps it."""
    parts = {"format": REGENERATE_FORMAT, "verifier": verifier_fp, "settings": output_settings,
             "max_seq_len": max_seq_len}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def run_fingerprint(store_fp: str, sources_fp: str, max_rows: int | None) -> str:
    """A run's outputs: its store's answers to its sources' rows, in their order."""
    parts = {"store": store_fp, "sources": sources_fp, "max_rows": max_rows}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def answer_journal(store: Path) -> Journal:
    """Every process's records of the conversations it answered ({"key", "messages"}) or gave up on
    ({"key", "reason"}), appended chunk by chunk under `parts/`."""
    return Journal(store, "parts", key="key")


def source_file_of(row_id: str) -> str:
    """The file a row comes from: its id is "<source file name>:<index>" (tasks/prepare/chat_data.py)."""
    return row_id.rsplit(":", 1)[0]


def plan_chunks(rows: list[tuple[str, str]], answered: Container[str], chunk_size: int) -> list[list[str]]:
    """The content keys to answer, chunk by chunk: `rows` are (row id, content key) in source order;
    a file's conversations not `answered` and not already planned for an earlier row, `chunk_size` at
    a time. Rows of one file are consecutive, so a file's chunks never take another file's rows."""
    chunks: list[list[str]] = []
    planned: set[str] = set()
    for _, file_rows in groupby(rows, key=lambda row: source_file_of(row[0])):
        pending = []
        for _, key in file_rows:
            if key not in answered and key not in planned:
                planned.add(key)
                pending.append(key)
        chunks += [pending[i: i + chunk_size] for i in range(0, len(pending), chunk_size)]
    return chunks


def rows_fingerprint(rows: list[tuple[str, str]], chunk_size: int) -> str:
    return hashlib.sha256(json.dumps([rows, chunk_size]).encode()).hexdigest()


def run_plan(run_dir: Path, rows: list[tuple[str, str]], answered: Container[str], chunk_size: int
             ) -> list[list[str]]:
    """The run's chunks: those an earlier attempt of this run planned (the same rows, the same chunk
    size), else planned now from what the store holds and written to `run_dir`. Call it once per
    attempt, before any rank starts: the ranks read the plan (`read_plan`), so they all take the same
    chunks whatever the others have written since. An earlier plan that leaves a row unanswered (its
    answer since removed from the store, or damaged) is made again."""
    identity = rows_fingerprint(rows, chunk_size)
    path = run_dir / PLAN_NAME
    if path.is_file():
        plan = json.loads(path.read_text())
        planned = {key for chunk in plan["chunks"] for key in chunk}
        if plan["rows"] == identity and all(key in answered or key in planned for _, key in rows):
            return plan["chunks"]
    chunks = plan_chunks(rows, answered, chunk_size)
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"rows": identity, "chunks": chunks}))
    tmp.replace(path)
    return chunks


class NoPlanError(PermanentError, RuntimeError):
    """A rank started before its run was planned (or for other rows than the plan's): no retry plans it."""


def read_plan(run_dir: Path, rows: list[tuple[str, str]], chunk_size: int) -> list[list[str]]:
    """The chunks `run_plan` wrote for these rows."""
    path = run_dir / PLAN_NAME
    plan = json.loads(path.read_text()) if path.is_file() else None
    if plan is None or plan["rows"] != rows_fingerprint(rows, chunk_size):
        raise NoPlanError(f"{path} is missing or plans other conversations: a regeneration rank runs after its run "
                          "is planned (tasks.prepare.regenerate.plan_regeneration), as regenerate() and "
                          "flows/ray_stages.py regenerate_on_ray do")
    return plan["chunks"]


def chunks_of_rank(chunks: list[list[str]], answered: Container[str], rank: int, world_size: int
                   ) -> list[list[str]]:
    """Rank `rank`'s chunks not yet answered. Chunk c belongs to rank c % world_size whatever is
    answered, so a retried rank takes the same conversations as before and no two ranks ever take the
    same one; and the chunks, hence the generation batches, are the same for any number of ranks. A
    chunk a kill left part-recorded (its records are one write, which a kill can cut) is redone
    whole: the same batches, so the answers of an uninterrupted run."""
    return [chunk for chunk in chunks[rank::world_size] if any(key not in answered for key in chunk)]
