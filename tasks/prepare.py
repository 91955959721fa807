"""Stage 1, prepare: chat data -> verifier-tokenized `input_ids` and assistant-only loss masks.

The loss mask is derived from the verifier's own chat template, without `{% generation %}`
markers (most templates, SmolLM2's included, have none): the conversation is rendered once, each
assistant text is located in the rendering (it starts after the rendering of the conversation so
far plus the generation prompt), and the tokens whose characters lie inside an assistant text
are the supervised ones. Template tokens (role headers, end-of-turn markers) are never supervised.

Output: a `datasets` folder (`sample_id`, `input_ids`, `loss_mask`, `seq_len`) under
`<output_dir>/prepared/<fingerprint>/`, with `report.json`. The folder name is the fingerprint
of every input (data bytes, tokenizer and template, parameters, this code), so a result is
never overwritten by one made from other inputs.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tasks.chat_data import Dropped, normalize, read_rows, source_files
from tasks.errors import PermanentError
from tasks.verifier import tokenizer_fingerprint

log = logging.getLogger(__name__)

# Bump when the output for the same inputs changes.
PREPARE_FORMAT = "prepare-v1"


class PrepareError(PermanentError, ValueError):
    """Prepare cannot start; nothing has been written."""


@dataclass
class PrepareReport:
    fingerprint: str
    rows_read: int = 0
    rows_kept: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    dropped_examples: dict[str, list[str]] = field(default_factory=dict)  # a few row ids per reason
    truncated_rows: int = 0
    tokens: int = 0
    supervised_tokens: int = 0
    max_seq_len: int = 0
    wall_s: float = 0.0

    def drop(self, row_id: str, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        examples = self.dropped_examples.setdefault(reason, [])
        if len(examples) < 5:
            examples.append(row_id)


@dataclass(frozen=True)
class PreparedData:
    """What later stages get: where the dataset is and what produced it."""

    path: str
    fingerprint: str
    rows: int
    tokens: int
    supervised_tokens: int


def load_tokenizer(verifier_path: str):
    from transformers import AutoTokenizer

    if not Path(verifier_path).is_dir():
        raise PrepareError(f"verifier folder not found: {verifier_path}")
    tokenizer = AutoTokenizer.from_pretrained(verifier_path)
    if not tokenizer.chat_template:
        raise PrepareError(
            f"the tokenizer in {verifier_path} has no chat template; the loss mask is derived from it "
            "(add chat_template.jinja or a `chat_template` in tokenizer_config.json)"
        )
    return tokenizer


def end_of_turn_ids(verifier_path: str, tokenizer) -> frozenset[int]:
    """The tokens that end an answer: the tokenizer's eos and the verifier's generation eos ids
    (e.g. Llama 3's <|eot_id|>, ChatML's <|im_end|>)."""
    from transformers import GenerationConfig

    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    if (Path(verifier_path) / "generation_config.json").is_file():
        eos = GenerationConfig.from_pretrained(verifier_path).eos_token_id
        ids |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return frozenset(ids)


def tokenize_conversation(tokenizer, messages: list[dict], max_seq_len: int,
                          end_of_turn: frozenset[int] = frozenset()) -> tuple[list[int], list[int], bool] | Dropped:
    """(input_ids, loss_mask, truncated) for one conversation, or why it cannot be used. A token
    of `end_of_turn` right after an assistant text is supervised too: the verifier emits it at the
    end of every answer, and a draft that predicts it gets that token accepted."""
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        spans = assistant_spans(tokenizer, messages, text)
    except Exception as e:  # a template may raise on any input it dislikes (e.g. roles not alternating)
        return Dropped("template_error", str(e)[:200])
    if isinstance(spans, Dropped):
        return spans
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids = enc["input_ids"]
    loss_mask = [0] * len(input_ids)
    span_iter = iter(spans)
    start, end = next(span_iter)
    for i, (a, b) in enumerate(enc["offset_mapping"]):
        while a >= end:  # spans and tokens are both in text order
            nxt = next(span_iter, None)
            if nxt is None:
                break
            start, end = nxt
        if start <= a and b <= end and a < b:
            loss_mask[i] = 1
    if end_of_turn:
        starts = [a for a, _ in enc["offset_mapping"]]
        for _, end in spans:
            i = bisect.bisect_left(starts, end)  # the first token after the answer
            if i < len(input_ids) and input_ids[i] in end_of_turn:
                loss_mask[i] = 1
    truncated = len(input_ids) > max_seq_len
    input_ids, loss_mask = input_ids[:max_seq_len], loss_mask[:max_seq_len]
    if not any(loss_mask):
        return Dropped("no_supervised_tokens")
    return input_ids, loss_mask, truncated


def assistant_spans(tokenizer, messages: list[dict], text: str) -> list[tuple[int, int]] | Dropped:
    """Character spans of the assistant texts inside the rendered conversation."""
    spans = []
    cursor = 0
    for j, message in enumerate(messages):
        if message["role"] == "assistant":
            # The answer begins where generation would: after the conversation so far plus the
            # generation prompt. Templates that rewrite earlier turns later fall back to the cursor.
            prefix = tokenizer.apply_chat_template(messages[:j], tokenize=False, add_generation_prompt=True) if j else ""
            if text.startswith(prefix):
                cursor = max(cursor, len(prefix))
        content = message["content"]
        idx = text.find(content, cursor)
        if idx < 0:  # templates commonly trim
            content = content.strip()
            idx = text.find(content, cursor)
        if idx < 0:
            if message["role"] == "assistant":
                return Dropped("template_alters_assistant_text", f"turn {j} not found verbatim in the rendering")
            continue  # a system/user text the template rewrites does not matter for the mask
        if message["role"] == "assistant":
            spans.append((idx, idx + len(content)))
        cursor = idx + len(content)
    return spans


def sources_fingerprint(sources: list[str]) -> str:
    h = hashlib.sha256()
    for path in (f for source in sources for f in source_files(source)):
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for f in files:
            h.update(str(f.name).encode() + b"\0")
            with f.open("rb") as fh:
                for block in iter(lambda: fh.read(1 << 22), b""):
                    h.update(block)
    return h.hexdigest()


def prepare_fingerprint(verifier_path: str, sources: list[str], max_rows: int | None, max_seq_len: int,
                        regenerate: dict | None = None, supervise_end_of_turn: bool = False) -> str:
    parts = {
        "format": PREPARE_FORMAT,
        "supervise_end_of_turn": supervise_end_of_turn,
        "tokenizer": tokenizer_fingerprint(verifier_path),
        "sources": sources_fingerprint(sources),
        "max_rows": max_rows,
        "max_seq_len": max_seq_len,
        "regenerate": regenerate,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def prepare(verifier_path: str, sources: list[str], output_dir: str | Path, *, max_seq_len: int,
            max_rows: int | None = None, supervise_end_of_turn: bool = False) -> PreparedData:
    """Tokenize and mask the chat data; reuses an existing result made from the same inputs."""
    t0 = time.monotonic()
    tokenizer = load_tokenizer(verifier_path)
    end_of_turn = end_of_turn_ids(verifier_path, tokenizer) if supervise_end_of_turn else frozenset()
    fingerprint = prepare_fingerprint(verifier_path, sources, max_rows, max_seq_len,
                                      supervise_end_of_turn=supervise_end_of_turn)
    final = Path(output_dir) / "prepared" / fingerprint[:16]
    if (final / "report.json").is_file():
        log.info("prepared data with fingerprint %s already exists at %s", fingerprint[:16], final)
        return _result(final)

    report = PrepareReport(fingerprint=fingerprint, max_seq_len=max_seq_len)
    columns: dict[str, list] = {"sample_id": [], "input_ids": [], "loss_mask": [], "seq_len": []}
    for row in read_rows(sources, max_rows):
        report.rows_read += 1
        messages = row.data if isinstance(row.data, Dropped) else normalize(row.data)
        tokenized = (messages if isinstance(messages, Dropped)
                     else tokenize_conversation(tokenizer, messages, max_seq_len, end_of_turn))
        if isinstance(tokenized, Dropped):
            report.drop(row.row_id, tokenized.reason)
            continue
        input_ids, loss_mask, truncated = tokenized
        columns["sample_id"].append(row.row_id)
        columns["input_ids"].append(input_ids)
        columns["loss_mask"].append(loss_mask)
        columns["seq_len"].append(len(input_ids))
        report.rows_kept += 1
        report.truncated_rows += truncated
        report.tokens += len(input_ids)
        report.supervised_tokens += sum(loss_mask)
        if report.rows_read % 2000 == 0:
            log.info("prepare: %d rows read, %d kept", report.rows_read, report.rows_kept)
    if not report.rows_kept:
        raise PrepareError(f"no usable rows in {sources}: dropped {report.dropped}")

    report.wall_s = round(time.monotonic() - t0, 2)
    _write_atomically(final, columns, report)
    log.info(
        "prepare: kept %d of %d rows (%d tokens, %d supervised); dropped %s -> %s",
        report.rows_kept, report.rows_read, report.tokens, report.supervised_tokens, report.dropped or "none", final,
    )
    return _result(final)


def _write_atomically(final: Path, columns: dict[str, list], report: PrepareReport) -> None:
    from datasets import Dataset, Features, Sequence, Value
    from datasets.utils.logging import disable_progress_bar

    disable_progress_bar()

    features = Features({
        "sample_id": Value("string"),
        "input_ids": Sequence(Value("int32")),
        "loss_mask": Sequence(Value("int8")),
        "seq_len": Value("int32"),
    })
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        Dataset.from_dict(columns, features=features).save_to_disk(str(tmp / "data"))
        (tmp / "report.json").write_text(json.dumps(asdict(report), indent=1))
        os.rename(tmp, final)  # report.json inside marks the folder complete
    except OSError:
        if not (final / "report.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _result(folder: Path) -> PreparedData:
    report = json.loads((folder / "report.json").read_text())
    return PreparedData(
        path=str(folder),
        fingerprint=report["fingerprint"],
        rows=report["rows_kept"],
        tokens=report["tokens"],
        supervised_tokens=report["supervised_tokens"],
    )


def load_prepared(path: str | Path):
    """The prepared `datasets.Dataset` (columns: sample_id, input_ids, loss_mask, seq_len)."""
    from datasets import load_from_disk

    return load_from_disk(str(Path(path) / "data"))


def read_report(path: str | Path) -> dict:
    return json.loads((Path(path) / "report.json").read_text())
