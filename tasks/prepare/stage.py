"""Stage 1, prepare: chat data -> verifier-tokenized `input_ids` and assistant-only loss masks.

Rows are read and normalized by tasks/prepare/chat_data.py, rendered through the verifier's own chat
template and masked by tasks/prepare/chat_template.py (only the text the assistant wrote is supervised).
A row that cannot be used is dropped and counted by reason (an unknown role by its name); a
conversation with an empty turn keeps the exchanges before it, and the turns cut are counted.

Output: a `datasets` folder (`sample_id`, `input_ids`, `loss_mask`, `seq_len`) under
`<output_dir>/prepared/<fingerprint>/`, with `report.json`. The folder name is the fingerprint
of every input (data bytes, tokenizer and template, parameters, this code), so a result is
never overwritten by one made from other inputs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

from tasks.common.errors import PermanentError
from tasks.common.verifier import VerifierError, check_tokenizer_files, tokenizer_fingerprint
from tasks.prepare.chat_data import Dropped, Source, hash_source, read_rows
from tasks.prepare.dataset import PreparedData
from tasks.prepare.samples import Sample, default_workers, tokenized_rows

log = logging.getLogger(__name__)

# Bump when the output for the same inputs changes.
PREPARE_FORMAT = "prepare-v3"  # v2: tool use kept, empty turns cut, control-token strings tokenized as text;
# v3: JSON Lines split at "\n" alone (a U+2028 inside a string split a row in two)


class PrepareError(PermanentError, ValueError):
    """Prepare cannot start; nothing has been written."""


@dataclass
class PrepareReport:
    fingerprint: str
    rows_read: int = 0
    rows_kept: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    dropped_examples: dict[str, list[str]] = field(default_factory=dict)  # a few row ids per reason
    unknown_roles: dict[str, int] = field(default_factory=dict)  # the roles behind `unknown_role`, by name
    shortened_rows: int = 0  # conversations cut at an empty turn, the exchanges before it kept
    turns_cut: int = 0
    shortened_examples: list[str] = field(default_factory=list)
    truncated_rows: int = 0
    tokens: int = 0
    supervised_tokens: int = 0
    max_seq_len: int = 0
    wall_s: float = 0.0

    def drop(self, row_id: str, dropped: Dropped) -> None:
        self.dropped[dropped.reason] = self.dropped.get(dropped.reason, 0) + 1
        examples = self.dropped_examples.setdefault(dropped.reason, [])
        if len(examples) < 5:
            examples.append(row_id)
        if dropped.reason == "unknown_role":
            self.unknown_roles[dropped.detail] = self.unknown_roles.get(dropped.detail, 0) + 1

    def count(self, row_id: str, sample: Sample) -> None:
        """A kept sample."""
        self.rows_kept += 1
        self.truncated_rows += sample.truncated
        self.tokens += len(sample.input_ids)
        self.supervised_tokens += sum(sample.loss_mask)
        if sample.turns_cut:
            self.shortened_rows += 1
            self.turns_cut += sample.turns_cut
            if len(self.shortened_examples) < 5:
                self.shortened_examples.append(row_id)


def load_tokenizer(verifier_path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    if not Path(verifier_path).is_dir():
        raise PrepareError(f"verifier folder not found: {verifier_path}")
    try:
        check_tokenizer_files(verifier_path, trust_remote_code)
    except VerifierError as e:
        raise PrepareError(str(e)) from None
    tokenizer = AutoTokenizer.from_pretrained(verifier_path, trust_remote_code=trust_remote_code)
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


def sources_fingerprint(sources: list[Source]) -> str:
    h = hashlib.sha256()
    for source in sources:
        hash_source(h, source)
    return h.hexdigest()


def prepare_fingerprint(verifier_path: str, sources: list[Source], max_rows: int | None, max_seq_len: int,
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


def prepare(verifier_path: str, sources: list[Source], output_dir: str | Path, *, max_seq_len: int,
            max_rows: int | None = None, supervise_end_of_turn: bool = False,
            trust_remote_code: bool = False, workers: int = 0) -> PreparedData:
    """Tokenize and mask the chat data; reuses an existing result made from the same inputs.
    `workers`: tokenizing processes (0: one per CPU core, at most 16); the result is the same for any."""
    t0 = time.monotonic()
    tokenizer = load_tokenizer(verifier_path, trust_remote_code)
    end_of_turn = end_of_turn_ids(verifier_path, tokenizer) if supervise_end_of_turn else frozenset()
    fingerprint = prepare_fingerprint(verifier_path, sources, max_rows, max_seq_len,
                                      supervise_end_of_turn=supervise_end_of_turn)
    final = Path(output_dir) / "prepared" / fingerprint[:16]
    if (final / "report.json").is_file():
        log.info("prepared data with fingerprint %s already exists at %s", fingerprint[:16], final)
        return _result(final)

    report = PrepareReport(fingerprint=fingerprint, max_seq_len=max_seq_len)
    samples = tokenized_rows(read_rows(sources, max_rows), tokenizer, partial(load_tokenizer, verifier_path,
                             trust_remote_code), max_seq_len, end_of_turn, workers or default_workers())
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        with _rows_writer(tmp / "rows.arrow") as writer:  # sample by sample: memory stays flat at any size
            for row, sample in samples:
                report.rows_read += 1
                if isinstance(sample, Dropped):
                    report.drop(row.row_id, sample)
                else:
                    writer.write({"sample_id": row.row_id, "input_ids": sample.input_ids,
                                  "loss_mask": sample.loss_mask, "seq_len": len(sample.input_ids)})
                    report.count(row.row_id, sample)
                if report.rows_read % 20000 == 0:
                    log.info("prepare: %d rows read, %d kept, %.0f rows/s", report.rows_read, report.rows_kept,
                             report.rows_read / (time.monotonic() - t0))
            writer.finalize()
        if not report.rows_kept:
            raise PrepareError(f"no usable rows in {sources}: dropped {report.dropped}")
        report.wall_s = round(time.monotonic() - t0, 2)
        _save_atomically(tmp, final, report)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info(
        "prepare: kept %d of %d rows (%d tokens, %d supervised; %d cut short at an empty turn, %d turns left out); "
        "dropped %s%s in %.0f s -> %s", report.rows_kept, report.rows_read, report.tokens, report.supervised_tokens,
        report.shortened_rows, report.turns_cut, report.dropped or "none",
        f" (unknown roles {report.unknown_roles})" if report.unknown_roles else "", report.wall_s, final,
    )
    return _result(final)


def _rows_writer(path: Path):
    """`datasets`' Arrow writer of prepare's columns on a file (`finalize()` it once written)."""
    from datasets import Features, Sequence, Value
    from datasets.arrow_writer import ArrowWriter

    return ArrowWriter(features=Features({"sample_id": Value("string"), "input_ids": Sequence(Value("int32")),
                                          "loss_mask": Sequence(Value("int8")), "seq_len": Value("int32")}),
                       path=str(path))


def _save_atomically(tmp: Path, final: Path, report: PrepareReport) -> None:
    """The written rows as a `datasets` folder with its report, renamed into place complete."""
    from datasets import Dataset
    from datasets.utils.logging import disable_progress_bar

    disable_progress_bar()
    Dataset.from_file(str(tmp / "rows.arrow")).save_to_disk(str(tmp / "data"))
    (tmp / "rows.arrow").unlink()
    (tmp / "report.json").write_text(json.dumps(asdict(report), indent=1))
    try:
        os.rename(tmp, final)  # report.json inside marks the folder complete
    except OSError:
        if not (final / "report.json").is_file():
            raise


def _result(folder: Path) -> PreparedData:
    report = json.loads((folder / "report.json").read_text())
    return PreparedData(
        path=str(folder),
        fingerprint=report["fingerprint"],
        rows=report["rows_kept"],
        tokens=report["tokens"],
        supervised_tokens=report["supervised_tokens"],
    )
