"""A training run's metrics: `metrics.jsonl` (read by the flow's artifacts and the tests) and
TensorBoard event files (`tensorboard --logdir <train dir>/tensorboard`), written by rank 0.

Both stay true across a kill and resume: records the killed process wrote past its last
checkpoint are dropped from metrics.jsonl, and the resumed event file starts with TensorBoard's
purge marker (`purge_step`), so TensorBoard hides the killed run's events from that step on
instead of drawing them twice.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


class TrainingLog:
    """Appends a record (`split`, `step` and numbers) to both sinks; opened at the step training
    starts from (0, or the checkpoint it resumed)."""

    def __init__(self, out_dir: str | Path, start_step: int, tensorboard: bool = True):
        self.path = Path(out_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.is_file():  # a resume: drop what the killed process wrote past its checkpoint
            self.trim(start_step)
        self.board = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # every event at or after start_step + 1 in earlier files (a killed run's) is hidden
            self.board = SummaryWriter(str(Path(out_dir) / TENSORBOARD_DIR), purge_step=start_step + 1)

    def trim(self, step: int) -> None:
        """Keep the records up to `step` (and drop a last line a kill cut off); the file is
        replaced whole, so a kill here loses nothing."""
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line)
            except (json.JSONDecodeError, KeyError, TypeError):
                continue  # a record cut off by the kill
        tmp = self.path.with_name(f".tmp-{self.path.name}")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, self.path)

    def write(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.board is not None:
            for key, value in record.items():
                if key not in ("split", "step") and isinstance(value, int | float):
                    self.board.add_scalar(f"{record['split']}/{key}", value, record["step"])
            self.board.flush()  # what a checkpoint covers is on disk before the checkpoint is

    def close(self) -> None:
        if self.board is not None:
            self.board.close()


def read_metrics(out_dir: str | Path) -> list[dict]:
    path = Path(out_dir) / METRICS_FILE
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
