"""What prepare hands on: a `datasets` folder (columns sample_id, input_ids, loss_mask, seq_len)
with its report, and the small reference to it that the later stages are given.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PreparedData:
    """What later stages get: where the dataset is and what produced it."""

    path: str
    fingerprint: str
    rows: int
    tokens: int
    supervised_tokens: int
    # the folders under the outputs its rows were read from (regenerated answers, synthesized prompts): a
    # run that keeps this data keeps them (`eagle3-pipeline gc`)
    made_from: tuple[str, ...] = ()
    # the verifier's answers this run wrote, and those it found in the answer store (regeneration on)
    conversations_answered: int | None = None
    conversations_reused: int | None = None


def load_prepared(path: str | Path):
    """The prepared `datasets.Dataset` (columns: sample_id, input_ids, loss_mask, seq_len)."""
    from datasets import load_from_disk

    return load_from_disk(str(Path(path) / "data"))


def token_rows(prepared, column: str = "input_ids", batch_size: int = 4096):
    """Each row's `column` as a numpy array, in row order, read a batch of rows at a time as Arrow
    buffers: a row at a time through `datasets` costs ~70 us, 26 s for 64k rows (minutes per plan
    at 600k samples, and each worker plans again)."""
    for batch in prepared.with_format("arrow").iter(batch_size=batch_size):
        lists = batch.column(column).combine_chunks()
        offsets = lists.offsets.to_numpy()
        values = lists.values.to_numpy(zero_copy_only=False)  # the buffer the offsets point into
        for i in range(len(lists)):
            yield values[offsets[i]: offsets[i + 1]]


def token_ids(prepared, rows) -> dict:
    """`input_ids` of `rows` (a shard's: consecutive prepared rows) as numpy arrays, read in one slice."""
    first = min(rows)
    block = prepared.with_format("numpy")[first: max(rows) + 1]["input_ids"]
    return {r: block[r - first] for r in rows}


def read_report(path: str | Path) -> dict:
    return json.loads((Path(path) / "report.json").read_text())
