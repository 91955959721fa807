"""Answer regeneration: the verifier rewrites every assistant turn (on-policy data makes better
drafts: the draft learns what the verifier says, not what another model said).

Turn by turn: assistant turn j of every conversation in a chunk is generated from the
regenerated conversation so far, all conversations batched together. Once a conversation's
prompt passes `max_seq_len`, its remaining turns are cut (prepare would truncate them anyway).
Conversations are processed in chunks and appended to `conversations.jsonl` as each chunk
finishes, so a crash costs at most one chunk; a rerun skips the chunks already written, and its
answers are byte for byte those of an uninterrupted run (the same chunks, the same batches).
Failures (a prompt that no longer fits, an empty answer) are counted by reason and the
conversation left out. vLLM generates where it imports (in a subprocess); transformers
`generate` everywhere else.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tasks.chat_data import Dropped, normalize, read_rows
from tasks.folder_lock import folder_lock
from tasks.progress import Progress

log = logging.getLogger(__name__)

REGENERATE_FORMAT = "regenerate-v1"


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
        from tasks.config import RegenerateSettings

        return RegenerateSettings.model_validate(self.settings)


@dataclass
class RegenerateReport:
    backend: str = ""
    conversations: int = 0
    regenerated: int = 0
    failed: dict[str, int] = field(default_factory=dict)
    assistant_turns: int = 0
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
    s = {k: v for k, v in job.settings.items() if k not in ("enabled", "backend", "chunk_size", "batch_size")}
    parts = {"format": REGENERATE_FORMAT, "sources": sources_fp, "verifier": verifier_fp, "max_rows": job.max_rows,
             "max_seq_len": job.max_seq_len, "settings": s}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


class TransformersGenerator:
    """transformers `generate` where vLLM is not installed.

    Throughput comes from keeping one compiled decoding step busy: prompts are sorted by length
    (little padding), cut into batches of a fixed number of rows (the last one filled up), and
    every batch reuses one static KV cache of max_seq_len + max_new_tokens positions, so shapes
    never change and, on a GPU, transformers compiles the decoding step once (torch.compile with
    CUDA graphs). Rows that finish early idle until their batch ends; sorting keeps that small.
    On a GPU the number of rows is what fits in half the free memory, unless `batch_size` says.
    """

    name = "transformers"

    def __init__(self, verifier_path: str, tokenizer, settings, max_prompt_len: int, trust_remote_code: bool):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch, self.tokenizer, self.settings = torch, tokenizer, settings
        self.cuda = torch.cuda.is_available()
        self.model = AutoModelForCausalLM.from_pretrained(
            verifier_path, dtype=torch.bfloat16 if self.cuda else torch.float32,  # bf16 matmuls crawl on most CPUs
            device_map="auto" if self.cuda else "cpu", trust_remote_code=trust_remote_code).eval()
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        cache_len = max_prompt_len + settings.max_new_tokens
        self.rows = settings.batch_size or (self._rows_that_fit(cache_len) if self.cuda else 16)
        self.cache_len, self.cache, self.cache_rows = cache_len, None, 0
        log.info("transformers generator: %d rows per batch, a static KV cache of %d positions", self.rows, cache_len)

    def _rows_that_fit(self, cache_len: int) -> int:
        text = self.model.config.get_text_config()
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        kv_per_token = 2 * text.num_hidden_layers * text.num_key_value_heads * head_dim * 2  # K and V, bf16
        per_row = cache_len * kv_per_token + 4 * 4 * text.vocab_size  # the cache + a few fp32 logit rows
        free, _ = self.torch.cuda.mem_get_info()
        return max(1, min(1024, int(0.5 * free / per_row)))

    def __call__(self, prompts: list[list[int]]) -> list[list[int]]:
        from transformers import StaticCache

        torch = self.torch
        if not prompts:
            return []
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        outputs: list[list[int]] = [[] for _ in prompts]
        device = self.model.get_input_embeddings().weight.device
        sampling = {"do_sample": True, "temperature": self.settings.temperature} if self.settings.temperature else {
            "do_sample": False}
        # On a GPU every batch has the same rows (the last one filled up), so the compiled step is
        # never recompiled; on a CPU nothing is compiled and small calls stay small.
        rows = self.rows if self.cuda else min(self.rows, len(prompts))
        if rows != self.cache_rows:
            self.cache, self.cache_rows = StaticCache(config=self.model.config, max_cache_len=self.cache_len), rows
        for start in range(0, len(order), rows):
            batch = [prompts[i] for i in order[start: start + rows]]
            batch += [batch[-1]] * (rows - len(batch))
            width = max(map(len, batch))
            ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in batch])  # left padding
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            with torch.inference_mode():  # the cache's tensors are inference tensors: reset them in here
                self.cache.reset()
                out = self.model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                          pad_token_id=self.pad, past_key_values=self.cache,
                                          max_new_tokens=self.settings.max_new_tokens, **sampling)
            for i, row in zip(order[start: start + rows], out[:, width:].tolist(), strict=False):
                outputs[i] = [t for t in row if t != self.pad]
        return outputs


class VllmGenerator:
    name = "vllm"

    def __init__(self, verifier_path: str, settings, max_model_len: int, trust_remote_code: bool):
        import torch
        from vllm import LLM, SamplingParams

        on_cpu = not torch.cuda.is_available()
        if on_cpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        self.llm = LLM(model=verifier_path, dtype="bfloat16", seed=0, enforce_eager=on_cpu,
                       max_model_len=max_model_len, trust_remote_code=trust_remote_code)
        self.sampling = SamplingParams(temperature=settings.temperature, max_tokens=settings.max_new_tokens, seed=0)

    def __call__(self, prompts: list[list[int]]) -> list[list[int]]:
        from vllm import TokensPrompt

        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], self.sampling, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]


def regenerate_chunk(conversations: list[tuple[str, list[dict]]], generate, tokenizer, max_seq_len: int,
                     report: RegenerateReport, max_turns: int | None = None
                     ) -> tuple[list[tuple[str, list[dict]]], dict[str, str]]:
    """The conversations with their assistant turns rewritten, turn by turn across the chunk (at
    most `max_turns` of them; later turns are dropped), and {row id: reason} of those that failed."""
    done: dict[str, list[dict]] = {row_id: [] for row_id, _ in conversations}
    pending = {row_id: list(messages) for row_id, messages in conversations}
    failed: dict[str, str] = {}
    while pending:
        batch, prompts = [], []
        for row_id, rest in list(pending.items()):
            if max_turns and sum(m["role"] == "assistant" for m in done[row_id]) >= max_turns:
                del pending[row_id]  # the conversation ends with its last regenerated answer
                continue
            # copy the turns before the next assistant turn; the assistant turn itself is regenerated
            while rest and rest[0]["role"] != "assistant":
                done[row_id].append(rest.pop(0))
            if not rest:
                del pending[row_id]
                continue
            prompt = tokenizer.apply_chat_template(done[row_id], add_generation_prompt=True, tokenize=True)["input_ids"]
            if len(prompt) >= max_seq_len:  # nothing after this point survives prepare's truncation
                del pending[row_id]
                if not any(m["role"] == "assistant" for m in done[row_id]):
                    failed[row_id] = "prompt_too_long"
                continue
            batch.append(row_id)
            prompts.append(prompt)
        if not batch:
            break
        t0 = time.monotonic()
        outputs = generate(prompts)
        report.generate_s += time.monotonic() - t0
        for row_id, tokens in zip(batch, outputs, strict=True):
            text = tokenizer.decode(tokens, skip_special_tokens=True).strip()
            pending[row_id].pop(0)
            report.generated_tokens += len(tokens)
            if not text:
                failed[row_id] = "empty_generation"
                del pending[row_id]
                continue
            done[row_id].append({"role": "assistant", "content": text})
            report.assistant_turns += 1
    for reason in failed.values():
        report.failed[reason] = report.failed.get(reason, 0) + 1
    finished = [(row_id, messages) for row_id, messages in done.items()
                if row_id not in failed and any(m["role"] == "assistant" for m in messages)]
    return finished, failed


def append_lines(path: Path, records: list[dict]) -> None:
    with path.open("a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))
        f.flush()
        os.fsync(f.fileno())


def run_regeneration(job: RegenerateJob) -> Path:
    """Regenerate in this process; returns the conversations file (resumable, see the module doc)."""
    from transformers import AutoTokenizer

    from tasks.vllm_backend import vllm_available

    s = job.regenerate_settings
    out_dir = Path(job.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    output, failures = out_dir / "conversations.jsonl", out_dir / "failed.jsonl"
    written = {json.loads(line)["id"] for line in _complete_lines(output)}
    failed_before = [json.loads(line) for line in _complete_lines(failures)]
    recorded = written | {f["id"] for f in failed_before}
    tokenizer = AutoTokenizer.from_pretrained(job.verifier_path)
    rows = []  # every usable conversation in input order: chunks are cut from this whole list
    report = RegenerateReport()
    for row in read_rows(job.sources, job.max_rows):
        messages = row.data if isinstance(row.data, Dropped) else normalize(row.data)
        if isinstance(messages, Dropped):
            report.failed[f"input_{messages.reason}"] = report.failed.get(f"input_{messages.reason}", 0) + 1
            continue
        report.conversations += 1
        rows.append((row.row_id, messages))
    report.regenerated = len(written)
    for f in failed_before:
        report.failed[f["reason"]] = report.failed.get(f["reason"], 0) + 1
    # A chunk is redone whole if any of its conversations is unrecorded (a kill between its two
    # appends leaves it part-recorded): its batches, and so its answers, stay the uninterrupted run's.
    chunks = [rows[i: i + s.chunk_size] for i in range(0, len(rows), s.chunk_size)]
    pending = [chunk for chunk in chunks if any(row_id not in recorded for row_id, _ in chunk)]
    if pending:
        use_vllm = s.backend == "vllm" or (s.backend == "auto" and vllm_available())
        generate = (VllmGenerator(job.verifier_path, s, job.max_seq_len + s.max_new_tokens, job.trust_remote_code)
                    if use_vllm else TransformersGenerator(job.verifier_path, tokenizer, s, job.max_seq_len,
                                                           job.trust_remote_code))
        report.backend = generate.name
        progress = Progress("regenerate", sum(map(len, pending)), "conversation")
        for n, chunk in enumerate(pending):
            finished, failed = regenerate_chunk(chunk, generate, tokenizer, job.max_seq_len, report, s.max_turns)
            finished = [(row_id, m) for row_id, m in finished if row_id not in recorded]
            append_lines(output, [{"id": row_id, "messages": m} for row_id, m in finished])
            append_lines(failures, [{"id": row_id, "reason": reason} for row_id, reason in failed.items()
                                    if row_id not in recorded])
            report.regenerated += len(finished)
            if n == 0:
                report.first_chunk_s, report.first_chunk_tokens = report.generate_s, report.generated_tokens
            progress.update(len(chunk), note=f"{report.generated_tokens / max(report.generate_s, 1e-9):,.0f} "
                                             "generated tok/s")
        progress.close()
    (out_dir / "report.json").write_text(json.dumps(
        {**asdict(report), "steady_tokens_per_s": report.steady_tokens_per_s}, indent=1))
    log.info("regenerated %d of %d conversations with %s (%d assistant turns, %d tokens in %.0f s of generation; "
             "steady state after the first chunk: %s generated tokens/s); failed %s",
             report.regenerated, report.conversations, report.backend or "nothing new", report.assistant_turns,
             report.generated_tokens, report.generate_s, report.steady_tokens_per_s or "n/a", report.failed or "none")
    return output


def _complete_lines(path: Path) -> list[str]:
    """Lines of a JSONL file without a torn last line (a crash mid-write)."""
    if not path.is_file():
        return []
    lines = path.read_text().split("\n")
    complete = [line for line in lines[:-1] if line]
    if lines[-1]:  # no trailing newline: the last write was cut off
        with path.open("r+") as f:
            f.truncate(sum(len(line) + 1 for line in lines[:-1]))
    return complete


def regenerate(job: RegenerateJob, *, in_process: bool = False) -> Path:
    """Regenerate in a subprocess (vLLM's engine, memory and any crash stay there) unless `in_process`;
    one run per output folder at a time (tasks/folder_lock.py)."""
    out_dir = Path(job.out_dir)
    with folder_lock(out_dir, "regeneration") as lock_fd:
        if in_process:
            return run_regeneration(job)
        job_file = out_dir / "job.json"
        job_file.write_text(json.dumps(asdict(job)))
        proc = subprocess.run([sys.executable, "-m", "tasks.regenerate", "--job", str(job_file)], pass_fds=(lock_fd,))
    if proc.returncode != 0:
        raise RuntimeError(f"answer regeneration failed (exit {proc.returncode}); a rerun resumes after the "
                           "conversations already written")
    return out_dir / "conversations.jsonl"


def main(argv: list[str] | None = None) -> int:
    """`python -m tasks.regenerate --job JOB.json`"""
    p = argparse.ArgumentParser(prog="python -m tasks.regenerate", description=main.__doc__)
    p.add_argument("--job", required=True)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_regeneration(RegenerateJob(**json.loads(Path(a.job).read_text())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def regenerated_sources(config) -> tuple[list[str], int | None]:
    """The chat data prepare reads: the configured sources, or their regenerated version."""
    from tasks.prepare import sources_fingerprint
    from tasks.verifier import verifier_fingerprint

    data = config.data
    if not data.regenerate.enabled:
        return data.sources, data.max_rows
    job = RegenerateJob(data.sources, data.max_rows, config.verifier.path, "", data.max_seq_len,
                        data.regenerate.model_dump(), config.verifier.trust_remote_code)
    fp = regenerate_fingerprint(job, sources_fingerprint(data.sources), verifier_fingerprint(config.verifier.path))
    out_dir = Path(config.output_dir) / "regenerated" / fp[:16]
    return [str(regenerate(RegenerateJob(**{**asdict(job), "out_dir": str(out_dir)})))], None
