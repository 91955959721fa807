"""Prompts written by the verifier: the Magpie method (Xu et al., 2024, arXiv 2406.08464).

An instruction-tuned model given only the beginning of a user turn under its own chat template
(ChatML: its default system turn, then `<|im_start|>user\\n`) writes a user prompt: the kind of
thing it saw there in its tuning data. Sampled many times, these prompts are as broad as that data,
which is what a draft for this verifier will serve; regeneration then answers them
(tasks/prepare/regenerate.py), so the draft trains on the verifier's own prompts and answers.
Left to itself a small verifier writes a narrow mix (SmolLM2-135M: 28% of its prompts begin "Can
you"; the draft trained on them accepts least on mathematics and science: docs/BENCHMARKS.md), so
`system_prompts` can steer chunks in turn with a system turn about a domain (as Magpie does for
its domain sets); only the user turn is kept.

Prompt i is sampled with seed `seed + i` (the transformers generator seeds each batch instead), in
chunks of `chunk_size`. Each chunk's outcomes (the prompt, or why it is left out) are appended to
a journal under `parts/` when the chunk is done, so a crash costs at most one chunk and a rerun
goes on with the next. Left out: a prompt the verifier did not end within `max_prompt_tokens`
(`unfinished`: a question with its end cut off), one shorter than `min_prompt_chars` (`too_short`),
and a repeat of an earlier one, compared case- and whitespace-blind (`duplicate`). Chunks are
sampled until `prompts` are kept, or until ATTEMPTS times as many were sampled (a verifier that
keeps repeating itself: the run goes on with what was kept, and says so). `prompts.jsonl` holds the
kept prompts in sample order as rows `{"id", "messages": [{"role": "user", "content"}]}`, which
regeneration reads as prompts without answers; `report.json` the counts and a few examples. One
synthesis per folder at a time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from tasks.common.errors import PermanentError
from tasks.common.folder_lock import folder_lock
from tasks.common.journal import Journal
from tasks.common.progress import Heartbeat, Progress, ProgressCallback
from tasks.common.workers import rank_worker_main, run_one_worker

log = logging.getLogger(__name__)

SYNTHESIZE_FORMAT = "synthesize-v1"
ATTEMPTS = 4  # prompts sampled at most per prompt asked for
MARKER = "\ue000USER-PROMPT\ue000"  # a private-use character no template rewrites


class SynthesisError(PermanentError):
    """The verifier cannot write prompts this way (its template, or nothing usable sampled)."""


@dataclass(frozen=True)
class SynthesizeJob:
    verifier_path: str
    out_dir: str
    settings: dict  # SynthesizeSettings fields
    generation: dict  # RegenerateSettings fields: the backend, rows and GPUs regeneration generates with
    trust_remote_code: bool = False

    @property
    def synthesize_settings(self):
        from tasks.common.config import SynthesizeSettings

        return SynthesizeSettings.model_validate(self.settings)


def synthesize_fingerprint(settings, verifier_fp: str) -> str:
    parts = {"format": SYNTHESIZE_FORMAT, "verifier": verifier_fp, "settings": settings.output_settings()}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def pre_query_ids(tokenizer, system: str | None = None) -> list[int]:
    """The verifier's chat template for one user turn, up to where the user's words begin (its
    default system turn included, or `system` as the system turn), as token ids."""
    from tasks.prepare.chat_template import for_template, render

    messages = [*([{"role": "system", "content": system}] if system else []), {"role": "user", "content": MARKER}]
    try:
        text = render(tokenizer, for_template(tokenizer, messages))  # content parts where the template takes those
    except Exception as e:  # jinja raises what the template raises: one that refuses a system turn
        raise SynthesisError(f"the verifier's chat template refuses a system turn ({e}): data.synthesize."
                             "system_prompts cannot steer it") from e
    if MARKER not in text:
        raise SynthesisError("the verifier's chat template does not render a user turn's text as given, so where a "
                             "user prompt begins cannot be found; data.synthesize needs a template that does")
    if system and system not in text:
        raise SynthesisError("the verifier's chat template leaves out the system turn, so data.synthesize."
                             "system_prompts cannot steer it")
    return tokenizer(text[: text.index(MARKER)], add_special_tokens=False)["input_ids"]


def chunk_prefixes(tokenizer, settings) -> list[list[int]]:
    """The text each chunk continues, in turn: one per system prompt, or the template's default."""
    return [pre_query_ids(tokenizer, system) for system in settings.system_prompts] or [pre_query_ids(tokenizer)]


def comparable(text: str) -> str:
    return " ".join(text.lower().split())


def tally(done: dict[str, dict], settings) -> tuple[list[dict], Counter, int]:
    """Walking the samples of the finished chunks in order until `settings.prompts` are kept: the
    prompts kept, the samples walked left out, by reason, and the first chunk still to sample (the
    chunk after the last one walked, when enough were kept)."""
    kept, left_out, seen = [], Counter(), set()
    chunk = 0
    while len(kept) < settings.prompts:
        ids = chunk_ids(chunk, settings.chunk_size)
        if not all(i in done for i in ids):
            break
        for record in (done[i] for i in ids):
            if len(kept) == settings.prompts:
                break
            if "reason" in record:
                left_out[record["reason"]] += 1
            elif comparable(record["text"]) in seen:
                left_out["duplicate"] += 1
            else:
                seen.add(comparable(record["text"]))
                kept.append(record)
        chunk += 1
    return kept, left_out, chunk


def chunk_ids(chunk: int, chunk_size: int) -> list[str]:
    return [str(i) for i in range(chunk * chunk_size, (chunk + 1) * chunk_size)]


def sample_chunk(chunk: int, generate, tokenizer, prefixes: list[list[int]], settings,
                 stops: frozenset[int]) -> list[dict]:
    """Chunk `chunk`'s prompts, each as {"id", "text", "tokens"} or {"id", "reason", "tokens"}. The generator
    forgets earlier chunks first (a system prompt's prefix cached by one would change the next one's sums),
    so a chunk is sampled alike in an uninterrupted run and in a resumed one."""
    generate.start_chunk()
    ids = chunk_ids(chunk, settings.chunk_size)
    prefix = prefixes[chunk % len(prefixes)]
    outputs = generate([prefix] * len(ids), [settings.max_prompt_tokens] * len(ids),
                       seeds=[settings.seed + int(i) for i in ids])
    records = []
    for i, tokens in zip(ids, outputs, strict=True):
        text = tokenizer.decode(tokens, skip_special_tokens=True).strip()
        if len(tokens) >= settings.max_prompt_tokens and tokens[-1] not in stops:
            records.append({"id": i, "reason": "unfinished", "tokens": len(tokens)})
        elif len(text) < settings.min_prompt_chars:
            records.append({"id": i, "reason": "too_short", "tokens": len(tokens)})
        else:
            records.append({"id": i, "text": text, "tokens": len(tokens)})
    return records


def written(out_dir: Path) -> Journal:
    return Journal(out_dir, "parts", key="id")


def synthesize_rank(job: SynthesizeJob, rank: int = 0, world_size: int = 1,
                    callback: ProgressCallback | None = None) -> None:
    """Sample chunks in this process until enough prompts are kept (module docstring)."""
    from tasks.common.config import RegenerateSettings
    from tasks.prepare.generators import make_generator
    from tasks.prepare.stage import end_of_turn_ids, load_tokenizer

    s = job.synthesize_settings
    parts = written(Path(job.out_dir))
    done = parts.entries()
    kept, _, chunk = tally(done, s)
    budget = math.ceil(ATTEMPTS * s.prompts / s.chunk_size)
    if len(kept) >= s.prompts or chunk >= budget:
        return
    tokenizer = load_tokenizer(job.verifier_path, job.trust_remote_code)
    prefixes = chunk_prefixes(tokenizer, s)
    settings = RegenerateSettings.model_validate({**job.generation, "temperature": s.temperature,
                                                  "max_new_tokens": s.max_prompt_tokens})
    generate = make_generator(job.verifier_path, tokenizer, settings, max(map(len, prefixes)), job.trust_remote_code)
    stops = end_of_turn_ids(job.verifier_path, tokenizer)  # what ends a prompt the verifier finished
    log.info("synthesize: sampling prompts after %s with %s", " / ".join(repr(tokenizer.decode(p)) for p in prefixes),
             generate.name)
    progress = Progress("synthesize", s.prompts, "prompt", callback, done=len(kept))
    tokens, seconds = 0, 0.0
    while len(kept) < s.prompts and chunk < budget:
        t0 = time.monotonic()
        with Heartbeat(f"synthesize: chunk {chunk + 1} ({s.chunk_size} prompts sampled)"):
            records = sample_chunk(chunk, generate, tokenizer, prefixes, s, stops)
        seconds += time.monotonic() - t0
        tokens += sum(r["tokens"] for r in records)
        parts.append(*records)
        done.update({r["id"]: r for r in records})
        before = len(kept)
        kept, _, chunk = tally(done, s)
        progress.update(len(kept) - before, note=f"{tokens / seconds:,.0f} generated tok/s")
    progress.close()


def write_synthesized(job: SynthesizeJob) -> Path:
    """`prompts.jsonl` and `report.json` from the journal; the prompts file."""
    s = job.synthesize_settings
    out_dir = Path(job.out_dir)
    done = written(out_dir).entries()
    kept, left_out, chunk = tally(done, s)
    sampled = len(kept) + sum(left_out.values())  # walked: the rest of the last chunk is not used
    if len(kept) < s.prompts and chunk < math.ceil(ATTEMPTS * s.prompts / s.chunk_size):
        raise RuntimeError(f"prompt synthesis did not finish ({len(kept)} of {s.prompts} prompts kept): a rerun "
                           "goes on from the last chunk written")
    if not kept:
        raise SynthesisError(f"the verifier wrote no usable prompt in {sampled} samples ({dict(left_out)}): check "
                             "its chat template, or raise data.synthesize.max_prompt_tokens")
    if len(kept) < s.prompts:
        log.warning("synthesize: kept %d of %d prompts after sampling %d (%s): the verifier repeats itself at "
                    "temperature %s; going on with these", len(kept), s.prompts, sampled, dict(left_out),
                    s.temperature)
    tmp = out_dir / "prompts.jsonl.tmp"
    tmp.write_text("".join(json.dumps({"id": f"synthesized-{r['id']}", "messages": [
        {"role": "user", "content": r["text"]}]}) + "\n" for r in kept))
    tmp.replace(out_dir / "prompts.jsonl")
    report = {"prompts": len(kept), "asked": s.prompts, "sampled": sampled, "left_out": dict(left_out),
              "generated_tokens": sum(done[str(i)]["tokens"] for i in range(chunk * s.chunk_size)),
              "examples": [r["text"][:300] for r in kept[:5]], "settings": s.model_dump()}
    if s.system_prompts:  # how many kept prompts each system prompt wrote (chunk c: system prompt c % n)
        written_by = Counter(int(r["id"]) // s.chunk_size % len(s.system_prompts) for r in kept)
        report["kept_by_system_prompt"] = [written_by[k] for k in range(len(s.system_prompts))]
    (out_dir / "report.json").write_text(json.dumps(report, indent=1))
    log.info("synthesize: kept %d prompts of the first %d sampled (left out: %s)", len(kept), sampled,
             dict(left_out) or "none")
    return out_dir / "prompts.jsonl"


def synthesize(job: SynthesizeJob, *, in_process: bool = False, callback: ProgressCallback | None = None) -> Path:
    """Sample the prompts in a subprocess (vLLM's engine and its memory stay there) unless
    `in_process`, then write them; returns the prompts file."""
    with folder_lock(job.out_dir, "prompt synthesis") as lock_fd:
        if in_process:
            synthesize_rank(job, callback=callback)
        else:
            run_one_worker("tasks.prepare.synthesize", job, "prompt synthesis", callback, lock_fd)
        return write_synthesized(job)


def synthesis_job(config) -> SynthesizeJob | None:
    """The synthesis prepare adds to its sources (None unless data.synthesize.prompts), in a folder
    named by its fingerprint under the outputs."""
    from tasks.common.verifier import verifier_fingerprint

    s = config.data.synthesize
    if not s.prompts:
        return None
    generation = config.data.regenerate.model_dump()
    generation["tensor_parallel_size"] = generation["tensor_parallel_size"] or config.extract.tensor_parallel_size
    fp = synthesize_fingerprint(s, verifier_fingerprint(config.verifier.path))
    return SynthesizeJob(config.verifier.path, str(Path(config.output_dir) / "synthesized" / fp[:16]),
                         s.model_dump(), generation, config.verifier.trust_remote_code)


def main(argv: list[str] | None = None) -> int:
    """One synthesis process: `python -m tasks.prepare.synthesize --job JOB.json`."""
    return rank_worker_main("tasks.prepare.synthesize", SynthesizeJob, synthesize_rank, argv)


if __name__ == "__main__":
    raise SystemExit(main())
