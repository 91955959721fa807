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


def load_prepared(path: str | Path):
    """The prepared `datasets.Dataset` (columns: sample_id, input_ids, loss_mask, seq_len)."""
    from datasets import load_from_disk

    return load_from_disk(str(Path(path) / "data"))


def read_report(path: str | Path) -> dict:
    return json.loads((Path(path) / "report.json").read_text())
