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

Answers are kept by content (tasks/prepare/answer_store.py): a store named by the verifier and the
settings holds every answer by its conversation's content, and a run answers only the conversations
the store does not hold. A new file costs its own conversations, moved or repeated conversations
nothing, and each file is batched on its own: its answers are the bytes a fresh run writes (a generator's
output depends on its batches: tasks/prepare/generators.py).

Same inputs, same bytes, on the same machine under any load: a chunk's answers depend on its conversations
and the machine (the report's `generated_on`: the CPU's model, the instruction sets that choose its
kernels and the threads it computes with, or the GPU; the versions of torch and the backend), not on
timing. On a CPU vLLM's engine runs in the worker's own process, is given a call's prompts all at once and
schedules them in order; it computes with one thread whatever the cores; each chunk starts without the
prefixes of earlier ones (2026-12-07, this project's 2-core machine: the same answers and logprobs bit
for bit beside a CPU burner and alone). Where vLLM keeps its engine in a process of its own (GPUs, latent
attention), that process may start on a call's first prompts before the last arrive. Another machine may
decide near-ties otherwise.

By rank, as extraction: the run is planned once (the pending conversations in chunks, file by file in
source order), then chunk c is answered by rank c % N of N (one rank locally; on a Ray cluster one
Prefect task per rank, flows/ray_stages.py). Each process appends each finished chunk to a part file
of its own in the store (tasks/common/journal.py), so a crash costs at most one chunk; a rerun skips
the chunks already written, and its answers are byte for byte those of an uninterrupted run (the same
chunks, the same batches, each begun by an engine that holds no earlier chunk's prompts). Once every
rank is done, the run's folder gets `conversations.jsonl` and `failed.jsonl` in source order, each row
under its own id: the same files for any number of ranks.
One regeneration per answer store at a time (tasks/common/folder_lock.py).
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

from tasks.common.folder_lock import folder_lock
from tasks.common.progress import Progress, ProgressCallback, RoundHeartbeat
from tasks.common.workers import rank_worker_main, run_one_worker
from tasks.prepare.answer_store import (
    answer_journal,
    chunks_of_rank,
    content_key,
    read_plan,
    run_fingerprint,
    run_plan,
    store_fingerprint,
)
from tasks.prepare.chat_data import Dropped, job_source, read_conversation, read_rows
from tasks.prepare.chat_template import for_template

log = logging.getLogger(__name__)

OVERRUN = 16  # tokens generated past max_seq_len (re-tokenizing decoded text can shorten it by a few)
LINE_EVERY_S = 10.0  # while a chunk is generated, a line and a progress event this often


@dataclass(frozen=True)
class RegenerateJob:
    sources: list[str]
    max_rows: int | None
    verifier_path: str
    out_dir: str  # the run's folder: its plan, outputs and report
    max_seq_len: int
    settings: dict = field(default_factory=dict)  # RegenerateSettings fields
    trust_remote_code: bool = False
    # the answer store (tasks/prepare/answer_store.py), shared by the runs of one verifier and settings;
    # "": out_dir itself
    store_dir: str = ""

    @property
    def store(self) -> Path:
        return Path(self.store_dir or self.out_dir)

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
    generated_on: dict = field(default_factory=dict)  # what the answers depend on besides the inputs (generators.py)
    first_chunk_s: float = 0.0  # the first chunk of this attempt (model load excluded), apart
    first_chunk_tokens: int = 0

    @property
    def steady_tokens_per_s(self) -> float | None:
        """Generated tokens/s after the first chunk (which holds compilation and CUDA graph capture)."""
        s, n = self.generate_s - self.first_chunk_s, self.generated_tokens - self.first_chunk_tokens
        return round(n / s, 1) if s > 0 and n > 0 else None


def regenerate_chunk(conversations: list[tuple[str, list[dict]]], generate, tokenizer, max_seq_len: int,
                     report: RegenerateReport, settings, stops: frozenset[int] = frozenset(),
                     rounds: RoundHeartbeat | None = None) -> tuple[list[tuple[str, list[dict]]], dict[str, str]]:
    """`conversations` are (id, messages). The conversations with their assistant turns rewritten, each from the regenerated conversation
    so far (at most `settings.max_turns` of them; later turns are dropped), and {id: reason} of
    those that failed. An answer cut at its token limit (it did not end with one of `stops`) is
    marked `unfinished`: prepare then supervises no end-of-turn after it.

    Turns go in rounds across the chunk (turn j of every conversation, then turn j + 1); `rounds`, if
    given, counts each round's answers as the generator returns them. The generator forgets earlier chunks
    first, so a chunk's answers are the same wherever a run (or a resumed one) begins."""
    generate.start_chunk()
    done: dict[str, list[dict]] = {conv_id: [] for conv_id, _ in conversations}
    pending = {conv_id: list(messages) for conv_id, messages in conversations}
    failed: dict[str, str] = {}
    limits: dict[str, int] = {}

    def next_prompt(conv_id: str) -> list[int] | None:
        """The conversation's prompt for its next assistant turn, or None: it is over."""
        rest = pending[conv_id]
        if settings.max_turns and sum(m["role"] == "assistant" for m in done[conv_id]) >= settings.max_turns:
            del pending[conv_id]  # the conversation ends with its last regenerated answer
            return None
        # copy the turns before the next assistant turn; the assistant turn itself is regenerated
        while rest and rest[0]["role"] != "assistant":
            done[conv_id].append(rest.pop(0))
        if not rest:
            del pending[conv_id]
            return None
        prompt = tokenizer.apply_chat_template(for_template(tokenizer, done[conv_id]), add_generation_prompt=True,
                                               tokenize=True)["input_ids"]  # rendered as prepare renders it
        if len(prompt) >= max_seq_len:  # nothing after this point survives prepare's truncation
            del pending[conv_id]
            if not any(m["role"] == "assistant" for m in done[conv_id]):
                failed[conv_id] = "prompt_too_long"
            return None
        # no answer longer than what prepare keeps of it (max_seq_len, and OVERRUN tokens more so that
        # the re-tokenized text still fills max_seq_len)
        limits[conv_id] = min(settings.max_new_tokens, max_seq_len - len(prompt) + OVERRUN)
        return prompt

    def take_answer(conv_id: str, tokens: list[int]) -> None:
        text = tokenizer.decode(tokens, skip_special_tokens=True).strip()
        pending[conv_id].pop(0)
        report.generated_tokens += len(tokens)
        if not text:
            failed[conv_id] = "empty_generation"
            del pending[conv_id]
            return
        answer = {"role": "assistant", "content": text}
        if len(tokens) >= limits[conv_id] and tokens[-1] not in stops:
            answer["unfinished"] = True
            report.unfinished += 1
        done[conv_id].append(answer)
        report.assistant_turns += 1

    turn = 0
    while pending:
        batch = [(conv_id, p) for conv_id in list(pending) if (p := next_prompt(conv_id)) is not None]
        if not batch:
            break
        turn += 1
        t0 = time.monotonic()
        if rounds is not None:
            rounds.start_round(f"assistant turn {turn}", len(batch))
            generate.on_answers = partial(count_answers, rounds, t0)
        outputs = generate([p for _, p in batch], [limits[conv_id] for conv_id, _ in batch])
        report.generate_s += time.monotonic() - t0
        for (conv_id, _), tokens in zip(batch, outputs, strict=True):
            take_answer(conv_id, tokens)
    for conv_id, messages in done.items():
        if conv_id not in failed and not any(m["role"] == "assistant" for m in messages):
            failed[conv_id] = "no_assistant_turn"
    for reason in failed.values():
        report.failed[reason] = report.failed.get(reason, 0) + 1
    finished = [(conv_id, messages) for conv_id, messages in done.items() if conv_id not in failed]
    return finished, failed


def count_answers(rounds: RoundHeartbeat, started: float, done: int, tokens: int | None) -> None:
    """A generator's `on_answers` during a round begun at `started` (time.monotonic()): its answers
    done, and the tokens they hold (answers still being generated hold more), in the round's lines."""
    if tokens is None:
        rounds.count(done)
        return
    rate = tokens / max(time.monotonic() - started, 1e-9)
    rounds.count(done, f"{tokens:,} tokens in the answers done: {rate:,.1f}/s from the turn's start to the latest")


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


def keyed(rows: list[tuple[str, list[dict]]]) -> list[tuple[str, str]]:
    """(row id, content key) of each row."""
    return [(row_id, content_key(messages)) for row_id, messages in rows]


def plan_regeneration(job: RegenerateJob) -> list[list[str]]:
    """Plan the run (tasks/prepare/answer_store.py `run_plan`) before its ranks start: its chunks of
    conversations the store does not hold, as content keys."""
    rows, _ = conversations(job)
    chunks = run_plan(Path(job.out_dir), keyed(rows), answer_journal(job.store).entries(),
                      job.regenerate_settings.chunk_size)
    log.info("regenerate: this run answers %d of its %d conversations, in %d chunks (the others are in the answer "
             "store %s, or repeat an earlier row)", sum(map(len, chunks)), len(rows), len(chunks), job.store)
    return chunks


def rank_report_path(out_dir: Path, rank: int, world_size: int) -> Path:
    return out_dir / "progress" / f"rank-{rank}-of-{world_size}.report.json"


def regenerate_rank(job: RegenerateJob, rank: int = 0, world_size: int = 1,
                    callback: ProgressCallback | None = None) -> RegenerateReport:
    """Answer rank `rank`'s pending chunks of the run's plan in this process, appending each to this
    process's part file in the store when it is done; the rank's report goes next to its progress file."""
    from tasks.prepare.generators import make_generator
    from tasks.prepare.stage import end_of_turn_ids, load_tokenizer

    s = job.regenerate_settings
    out_dir = Path(job.out_dir)
    rows, _ = conversations(job)
    messages_of = {key: messages for (_, key), (_, messages) in zip(keyed(rows), rows, strict=True)}
    store = answer_journal(job.store)
    chunks = chunks_of_rank(read_plan(out_dir, keyed(rows), s.chunk_size), store.entries(), rank, world_size)
    report = RegenerateReport(conversations=sum(map(len, chunks)))
    if chunks:
        log.info("regenerate: %d conversations in %d chunks to answer", report.conversations, len(chunks))
        tokenizer = load_tokenizer(job.verifier_path, job.trust_remote_code)
        generate = make_generator(job.verifier_path, tokenizer, s, job.max_seq_len, job.trust_remote_code)
        stops = end_of_turn_ids(job.verifier_path, tokenizer)  # what ends an answer the verifier finished
        report.backend, report.generated_on = generate.name, generate.generated_on
        log.info("regenerate: answers by %s on %s", generate.name, generate.generated_on)
        progress = Progress("regenerate", report.conversations, "conversation", callback)
        for i, chunk in enumerate(chunks):
            # a chunk can take minutes: every LINE_EVERY_S a line and a progress event say how many answers of
            # its current round are done, their rate and the round's ETA
            with RoundHeartbeat(f"regenerate: chunk {i + 1} of {len(chunks)} ({len(chunk)} conversations)", "answer",
                                callback, LINE_EVERY_S) as rounds:
                finished, failed = regenerate_chunk([(key, messages_of[key]) for key in chunk], generate, tokenizer,
                                                    job.max_seq_len, report, s, stops, rounds)
            store.append(*[{"key": key, "messages": m} for key, m in finished],
                         *[{"key": key, "reason": reason} for key, reason in failed.items()])
            report.regenerated += len(finished)
            if i == 0:
                report.first_chunk_s, report.first_chunk_tokens = report.generate_s, report.generated_tokens
            # forced: the run's own count follows the chunk's last line, in the log and the progress artifact
            progress.update(len(chunk), force=True, note=f"{report.generated_tokens / max(report.generate_s, 1e-9):,.0f}"
                                                         " generated tok/s over the chunks done")
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
    """Once every rank is done: the run's `conversations.jsonl` and `failed.jsonl` in source order,
    each row's answer from the store under the row's id (the same files for any number of ranks), and
    `report.json`: the ranks' reports summed, with how many conversations this run answered
    (`answered_now`: its plan, over all its attempts, failures included) and how many rows took an
    answer made before (`reused`: the store held it, or an earlier row of the run has the same content)."""
    out_dir = Path(job.out_dir)
    rows, dropped = conversations(job)
    rows_keyed = keyed(rows)
    records = answer_journal(job.store).entries()
    missing = [row_id for row_id, key in rows_keyed if key not in records]
    if missing:
        raise RuntimeError(f"{len(missing)} of {len(rows)} conversations were not regenerated (e.g. {missing[0]}): a "
                           "rank did not finish; a rerun regenerates only those")
    ordered = [{"id": row_id, **({"messages": records[key]["messages"]} if "messages" in records[key]
                                 else {"reason": records[key]["reason"]})} for row_id, key in rows_keyed]
    finished = [r for r in ordered if "messages" in r]
    for name, lines in (("conversations.jsonl", finished), ("failed.jsonl", [r for r in ordered if "reason" in r])):
        tmp = out_dir / f"{name}.tmp"
        tmp.write_text("".join(json.dumps(r) + "\n" for r in lines))
        tmp.replace(out_dir / name)
    answered_now = sum(map(len, read_plan(out_dir, rows_keyed, job.regenerate_settings.chunk_size)))
    ranks = [json.loads(rank_report_path(out_dir, r, world_size).read_text()) for r in range(world_size)]
    steady = [r["steady_tokens_per_s"] for r in ranks if r["steady_tokens_per_s"]]
    ons = [r["generated_on"] for r in ranks]
    report = {"conversations": len(rows), "regenerated": len(finished),
              "answered_now": answered_now, "reused": len(rows) - answered_now,
              "failed": dict(Counter(dropped) + Counter(r["reason"] for r in ordered if "reason" in r)),
              "backend": next((r["backend"] for r in ranks if r["backend"]), ""),
              **{k: sum(r[k] for r in ranks) for k in ("assistant_turns", "unfinished", "generated_tokens", "generate_s")},
              "steady_tokens_per_s": round(sum(steady), 1) if steady else None,  # the ranks run side by side
              # where this run's answers were made (none: every answer was in the store)
              "generated_on": [on for i, on in enumerate(ons) if on and on not in ons[:i]],
              "answer_store": str(job.store), "ranks": ranks}
    (out_dir / "report.json").write_text(json.dumps(report, indent=1))
    log.info("regenerated %d of %d conversations (%d answered in this run, %d reused from the answer store or a "
             "repeated row; %d ranks); failed %s", report["regenerated"], len(rows), answered_now, report["reused"],
             world_size, report["failed"] or "none")
    return out_dir / "conversations.jsonl"


def regenerate(job: RegenerateJob, *, in_process: bool = False, callback: ProgressCallback | None = None) -> Path:
    """Plan the run, answer it as one rank, in a subprocess (vLLM's engine, its memory and any crash
    stay there) unless `in_process`, then write the outputs; returns the conversations file. The store
    stays locked until the outputs are written (the subprocess inherits the lock)."""
    with folder_lock(job.store, "regeneration") as lock_fd:
        plan_regeneration(job)
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
    data.sources and the `synthesized` prompts, under the outputs' `regenerated/`: its answers in the
    store `answers-<store fp>` (shared by every run of this verifier and these settings), its outputs in
    a folder named by the run's fingerprint (the store's, the sources' and max_rows)."""
    from tasks.common.verifier import verifier_fingerprint
    from tasks.prepare.stage import sources_fingerprint

    data = config.data
    if not data.regenerate.enabled:
        return None
    settings = data.regenerate.model_dump()  # generating takes the GPUs extraction's forward takes, unless told
    settings["tensor_parallel_size"] = settings["tensor_parallel_size"] or config.extract.tensor_parallel_size
    sources = [*map(job_source, data.sources), *([str(synthesized)] if synthesized else [])]
    store_fp = store_fingerprint(verifier_fingerprint(config.verifier.path), data.regenerate.output_settings(),
                                 data.max_seq_len)
    run_fp = run_fingerprint(store_fp, sources_fingerprint(sources), data.max_rows)
    root = Path(config.output_dir) / "regenerated"
    return RegenerateJob(sources, data.max_rows, config.verifier.path, str(root / run_fp[:16]), data.max_seq_len,
                         settings, config.verifier.trust_remote_code, store_dir=str(root / f"answers-{store_fp[:16]}"))


if __name__ == "__main__":
    raise SystemExit(main())
