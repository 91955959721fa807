"""Answer regeneration: the verifier rewrites every assistant turn (on-policy data makes better
drafts: the draft learns what the verifier says, not what another model said).

Turn by turn: assistant turn j of every conversation in a chunk is generated from the
regenerated conversation so far, all conversations batched together. Once a conversation's
prompt passes `max_seq_len`, its remaining turns are cut (prepare would truncate them anyway), and no
answer is generated much past what `max_seq_len` keeps of it: a later turn's long prompt leaves
its answer little room, and decoding tokens that prepare throws away would cost the most there.
Failures (a prompt that no longer fits, an empty answer) are counted by reason and the
conversation left out. vLLM generates where it imports (in a subprocess); transformers
`generate` everywhere else (tasks/prepare/generators.py).

By rank, as extraction: conversations are processed in chunks (in source order), chunk c by rank
c % N of N (one rank locally; on a Ray cluster one Prefect task per rank, flows/ray_stages.py).
Each process appends each finished chunk to a part file of its own under `parts/`
(tasks/common/journal.py), so a crash costs at most one chunk; a rerun skips the chunks already written,
and its answers are byte for byte those of an uninterrupted run (the same chunks, the same batches).
Once every rank is done, `conversations.jsonl` and `failed.jsonl` are written in source order: the
same files for any number of ranks. One regeneration per output folder at a time
(tasks/common/folder_lock.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from tasks.common.folder_lock import folder_lock
from tasks.common.journal import Journal
from tasks.common.progress import Heartbeat, Progress, ProgressCallback
from tasks.common.workers import rank_worker_main, run_one_worker
from tasks.prepare.chat_data import Dropped, read_conversation, read_rows
from tasks.prepare.chat_template import for_template

log = logging.getLogger(__name__)

# v2: part files per process, merged in source order; v3: answers no longer than what max_seq_len keeps;
# v4: prompts without an answer are answered (they were left out); prompts rendered as prepare renders
# them (content parts for templates that take only those, tool calls as text where not rendered)
REGENERATE_FORMAT = "regenerate-v4"
OVERRUN = 16  # tokens generated past max_seq_len (re-tokenizing decoded text can shorten it by a few)


@dataclass(frozen=True)
class RegenerateJob:
    sources: list[str]
    max_rows: int | None
    verifier_path: str
    out_dir: str
    max_seq_len: int
    settings: dict = field(default_factory=dict)  # RegenerateSettings fields
    trust_remote_code: bool = False

    @property
    def regenerate_settings(self):
        from tasks.common.config import RegenerateSettings

        return RegenerateSettings.model_validate(self.settings)


@dataclass
class RegenerateReport:
    backend: str = ""
    conversations: int = 0
    regenerated: int = 0
    failed: dict[str, int] = field(default_factory=dict)
    assistant_turns: int = 0
    unfinished: int = 0  # answers cut at their token limit (max_new_tokens, or what max_seq_len keeps)
    generated_tokens: int = 0
    generate_s: float = 0.0  # time inside the generator, the first chunk's compilation and warm-up included
    first_chunk_s: float = 0.0  # the first chunk of this attempt (model load excluded), apart
    first_chunk_tokens: int = 0

    @property
    def steady_tokens_per_s(self) -> float | None:
        """Generated tokens/s after the first chunk (which holds compilation and CUDA graph capture)."""
        s, n = self.generate_s - self.first_chunk_s, self.generated_tokens - self.first_chunk_tokens
        return round(n / s, 1) if s > 0 and n > 0 else None


def regenerate_fingerprint(job: RegenerateJob, sources_fp: str, verifier_fp: str) -> str:
    parts = {"format": REGENERATE_FORMAT, "sources": sources_fp, "verifier": verifier_fp, "max_rows": job.max_rows,
             "max_seq_len": job.max_seq_len, "settings": job.regenerate_settings.output_settings()}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def regenerate_chunk(conversations: list[tuple[str, list[dict]]], generate, tokenizer, max_seq_len: int,
                     report: RegenerateReport, settings, stops: frozenset[int] = frozenset()
                     ) -> tuple[list[tuple[str, list[dict]]], dict[str, str]]:
    """The conversations with their assistant turns rewritten, each from the regenerated conversation
    so far (at most `settings.max_turns` of them; later turns are dropped), and {row id: reason} of
    those that failed. An answer cut at its token limit (it did not end with one of `stops`) is
    marked `unfinished`: prepare then supervises no end-of-turn after it.

    Turns go in rounds across the chunk (turn j of every conversation, then turn j + 1)."""
    done: dict[str, list[dict]] = {row_id: [] for row_id, _ in conversations}
    pending = {row_id: list(messages) for row_id, messages in conversations}
    failed: dict[str, str] = {}
    limits: dict[str, int] = {}

    def next_prompt(row_id: str) -> list[int] | None:
        """The conversation's prompt for its next assistant turn, or None: it is over."""
        rest = pending[row_id]
        if settings.max_turns and sum(m["role"] == "assistant" for m in done[row_id]) >= settings.max_turns:
            del pending[row_id]  # the conversation ends with its last regenerated answer
            return None
        # copy the turns before the next assistant turn; the assistant turn itself is regenerated
        while rest and rest[0]["role"] != "assistant":
            done[row_id].append(rest.pop(0))
        if not rest:
            del pending[row_id]
            return None
        prompt = tokenizer.apply_chat_template(for_template(tokenizer, done[row_id]), add_generation_prompt=True,
                                               tokenize=True)["input_ids"]  # rendered as prepare renders it
        if len(prompt) >= max_seq_len:  # nothing after this point survives prepare's truncation
            del pending[row_id]
            if not any(m["role"] == "assistant" for m in done[row_id]):
                failed[row_id] = "prompt_too_long"
            return None
        # no answer longer than what prepare keeps of it (max_seq_len, and OVERRUN tokens more so that
        # the re-tokenized text still fills max_seq_len)
        limits[row_id] = min(settings.max_new_tokens, max_seq_len - len(prompt) + OVERRUN)
        return prompt

    def take_answer(row_id: str, tokens: list[int]) -> None:
        text = tokenizer.decode(tokens, skip_special_tokens=True).strip()
        pending[row_id].pop(0)
        report.generated_tokens += len(tokens)
        if not text:
            failed[row_id] = "empty_generation"
            del pending[row_id]
            return
        answer = {"role": "assistant", "content": text}
        if len(tokens) >= limits[row_id] and tokens[-1] not in stops:
            answer["unfinished"] = True
            report.unfinished += 1
        done[row_id].append(answer)
        report.assistant_turns += 1

    while pending:
        batch = [(row_id, p) for row_id in list(pending) if (p := next_prompt(row_id)) is not None]
        if not batch:
            break
        t0 = time.monotonic()
        outputs = generate([p for _, p in batch], [limits[row_id] for row_id, _ in batch])
        report.generate_s += time.monotonic() - t0
        for (row_id, _), tokens in zip(batch, outputs, strict=True):
            take_answer(row_id, tokens)
    for row_id, messages in done.items():
        if row_id not in failed and not any(m["role"] == "assistant" for m in messages):
            failed[row_id] = "no_assistant_turn"
    for reason in failed.values():
        report.failed[reason] = report.failed.get(reason, 0) + 1
    finished = [(row_id, messages) for row_id, messages in done.items() if row_id not in failed]
    return finished, failed


def conversations(job: RegenerateJob) -> tuple[list[tuple[str, list[dict]]], dict[str, int]]:
    """The conversations to regenerate, in source order, and the input rows left out, by reason. A
    prompt without an answer (a user turn alone: prompt-only data, synthesized prompts) gets an
    empty assistant turn, which regeneration writes."""
    rows, dropped = [], Counter()
    for row in read_rows(job.sources, job.max_rows):
        conversation = row.data if isinstance(row.data, Dropped) else read_conversation(row.data, prompt_only_ok=True)
        if isinstance(conversation, Dropped):
            dropped[f"input_{conversation.reason}"] += 1
            continue
        messages = conversation.messages
        if not any(m["role"] == "assistant" for m in messages):
            messages = [*messages, {"role": "assistant", "content": ""}]
        rows.append((row.row_id, messages))
    return rows, dict(dropped)


def written(out_dir: Path) -> Journal:
    """Every process's record of the conversations it finished ({"id", "messages"}) or gave up on
    ({"id", "reason"}), appended chunk by chunk under `parts/`."""
    return Journal(out_dir, "parts", key="id")


def chunks_of_rank(rows: list, done: dict, chunk_size: int, rank: int, world_size: int) -> list[list]:
    """Rank `rank`'s chunks not yet done. Chunk c (the conversations c * chunk_size onwards, in
    source order) belongs to rank c % world_size whatever is done, so a retried rank takes the same
    conversations as before and no two ranks ever take the same one; and the chunks, hence the
    generation batches, are the same for any number of ranks. A chunk a kill left part-recorded
    (its entries are one write, which a kill can cut) is redone whole: the same batches, so the
    answers of an uninterrupted run."""
    chunks = [rows[i: i + chunk_size] for i in range(0, len(rows), chunk_size)]
    return [chunk for chunk in chunks[rank::world_size] if any(row_id not in done for row_id, _ in chunk)]


def rank_report_path(out_dir: Path, rank: int, world_size: int) -> Path:
    return out_dir / "progress" / f"rank-{rank}-of-{world_size}.report.json"


def regenerate_rank(job: RegenerateJob, rank: int = 0, world_size: int = 1,
                    callback: ProgressCallback | None = None) -> RegenerateReport:
    """Regenerate rank `rank`'s pending chunks in this process, appending each to this process's
    part file when it is done; the rank's report goes next to its progress file."""
    from tasks.prepare.generators import make_generator
    from tasks.prepare.stage import end_of_turn_ids, load_tokenizer

    s = job.regenerate_settings
    out_dir = Path(job.out_dir)
    rows, _ = conversations(job)
    chunks = chunks_of_rank(rows, written(out_dir).entries(), s.chunk_size, rank, world_size)
    report = RegenerateReport(conversations=sum(map(len, chunks)))
    if chunks:
        log.info("regenerate: %d conversations in %d chunks to answer", report.conversations, len(chunks))
        tokenizer = load_tokenizer(job.verifier_path, job.trust_remote_code)
        generate = make_generator(job.verifier_path, tokenizer, s, job.max_seq_len, job.trust_remote_code)
        stops = end_of_turn_ids(job.verifier_path, tokenizer)  # what ends an answer the verifier finished
        report.backend = generate.name
        parts = written(out_dir)
        progress = Progress("regenerate", report.conversations, "conversation", callback)
        for i, chunk in enumerate(chunks):
            # a chunk can take minutes: a log line every 10 s says it is being generated (the progress
            # artifact moves when a chunk is done)
            with Heartbeat(f"regenerate: chunk {i + 1} of {len(chunks)} ({len(chunk)} conversations)"):
                finished, failed = regenerate_chunk(chunk, generate, tokenizer, job.max_seq_len, report, s, stops)
            parts.append(*[{"id": row_id, "messages": m} for row_id, m in finished],
                         *[{"id": row_id, "reason": reason} for row_id, reason in failed.items()])
            report.regenerated += len(finished)
            if i == 0:
                report.first_chunk_s, report.first_chunk_tokens = report.generate_s, report.generated_tokens
            progress.update(len(chunk), note=f"{report.generated_tokens / max(report.generate_s, 1e-9):,.0f} "
                                             "generated tok/s")
        progress.close()
    steady = (f"{report.steady_tokens_per_s:,.0f} generated tokens/s" if report.steady_tokens_per_s
              else "not measured (one chunk: its rate includes loading the verifier)")
    log.info("rank %d of %d: regenerated %d of %d conversations with %s (%d assistant turns, %d of them cut at their "
             "token limit; %d tokens in %.0f s of generation; steady state after the first chunk: %s); failed %s",
             rank, world_size, report.regenerated, report.conversations, report.backend or "nothing new",
             report.assistant_turns, report.unfinished, report.generated_tokens, report.generate_s, steady,
             report.failed or "none")
    path = rank_report_path(out_dir, rank, world_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**asdict(report), "steady_tokens_per_s": report.steady_tokens_per_s}))
    return report


def write_regenerated(job: RegenerateJob, world_size: int = 1) -> Path:
    """Once every rank is done: `conversations.jsonl` and `failed.jsonl` in source order (the same
    files for any number of ranks), and `report.json`, the ranks' reports summed."""
    out_dir = Path(job.out_dir)
    rows, dropped = conversations(job)
    records = written(out_dir).entries()
    missing = [row_id for row_id, _ in rows if row_id not in records]
    if missing:
        raise RuntimeError(f"{len(missing)} of {len(rows)} conversations were not regenerated (e.g. {missing[0]}): a "
                           "rank did not finish; a rerun regenerates only those")
    ordered = [records[row_id] for row_id, _ in rows]
    finished = [r for r in ordered if "messages" in r]
    for name, lines in (("conversations.jsonl", finished), ("failed.jsonl", [r for r in ordered if "reason" in r])):
        tmp = out_dir / f"{name}.tmp"
        tmp.write_text("".join(json.dumps(r) + "\n" for r in lines))
        tmp.replace(out_dir / name)
    ranks = [json.loads(rank_report_path(out_dir, r, world_size).read_text()) for r in range(world_size)]
    steady = [r["steady_tokens_per_s"] for r in ranks if r["steady_tokens_per_s"]]
    report = {"conversations": len(rows), "regenerated": len(finished),
              "failed": dict(Counter(dropped) + Counter(r["reason"] for r in ordered if "reason" in r)),
              "backend": next((r["backend"] for r in ranks if r["backend"]), ""),
              **{k: sum(r[k] for r in ranks) for k in ("assistant_turns", "unfinished", "generated_tokens", "generate_s")},
              "steady_tokens_per_s": round(sum(steady), 1) if steady else None,  # the ranks run side by side
              "ranks": ranks}
    (out_dir / "report.json").write_text(json.dumps(report, indent=1))
    log.info("regenerated %d of %d conversations (%d ranks); failed %s", report["regenerated"], len(rows),
             world_size, report["failed"] or "none")
    return out_dir / "conversations.jsonl"


def regenerate(job: RegenerateJob, *, in_process: bool = False, callback: ProgressCallback | None = None) -> Path:
    """Regenerate as one rank, in a subprocess (vLLM's engine, its memory and any crash stay there)
    unless `in_process`, then write the outputs; returns the conversations file. The folder stays
    locked until the outputs are written (the subprocess inherits the lock)."""
    with folder_lock(job.out_dir, "regeneration") as lock_fd:
        if in_process:
            regenerate_rank(job, callback=callback)
        else:
            run_one_worker("tasks.prepare.regenerate", job, "answer regeneration", callback, lock_fd)
        return write_regenerated(job)


def main(argv: list[str] | None = None) -> int:
    """One regeneration process: `python -m tasks.prepare.regenerate --job JOB.json --rank R --world-size W`."""
    return rank_worker_main("tasks.prepare.regenerate", RegenerateJob, regenerate_rank, argv)


def regeneration_job(config, synthesized: Path | None = None) -> RegenerateJob | None:
    """The regeneration prepare reads its data from (None unless data.regenerate.enabled): of
    data.sources and the `synthesized` prompts, in a folder named by its fingerprint under the outputs."""
    from tasks.common.verifier import verifier_fingerprint
    from tasks.prepare.stage import sources_fingerprint

    data = config.data
    if not data.regenerate.enabled:
        return None
    settings = data.regenerate.model_dump()  # generating takes the GPUs extraction's forward takes, unless told
    settings["tensor_parallel_size"] = settings["tensor_parallel_size"] or config.extract.tensor_parallel_size
    sources = [*data.sources, *([str(synthesized)] if synthesized else [])]
    job = RegenerateJob(sources, data.max_rows, config.verifier.path, "", data.max_seq_len, settings,
                        config.verifier.trust_remote_code)
    fp = regenerate_fingerprint(job, sources_fingerprint(sources), verifier_fingerprint(config.verifier.path))
    return replace(job, out_dir=str(Path(config.output_dir) / "regenerated" / fp[:16]))


if __name__ == "__main__":
    raise SystemExit(main())
