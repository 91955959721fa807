"""Training's side of a streamed extraction (tasks/extract/stream.py, docs/STREAMING.md).

The trainer publishes the order in which its steps read blocks of shards (positions), waits at a step
whose block is not on disk yet (saying so in its progress line), checkpoints at every block's end and
then releases the blocks before it: after that checkpoint no resume can start earlier. The steps, their
batches and their order are those of an offline run with the same `train.shuffle_block_shards`, so the
draft is the same, tensor for tensor.
"""

from __future__ import annotations

import bisect
import time
from pathlib import Path

from tasks.common.progress import Progress
from tasks.extract.stream import POLL_S, ProducerFailed, StreamControl


class ShardWaiter:
    """What a ShardReader calls for a shard not on disk yet: waits until it is, or the producer failed.
    A plain object, so that DataLoader worker processes get it too."""

    def __init__(self, shard_dir: str | Path):
        self.control = StreamControl(shard_dir)

    def __call__(self, path: Path) -> None:
        while not path.is_file():
            if (failure := self.control.producer_failure()) is not None:
                raise ProducerFailed(f"the streamed extraction failed, {path.name} will not come: {failure}")
            time.sleep(POLL_S)


class TrainStream:
    """The positions (blocks in the order the schedule's steps read them), and where each begins."""

    def __init__(self, reader, schedule, train_set, blocks: list[list[int]], pinned_samples: list[int]):
        """`pinned_samples`: what training reads at any time (validation, the targets' check): their shards
        are kept all run."""
        self.reader, self.total_steps = reader, schedule.total_steps
        self.control = StreamControl(reader.folder)
        self.waiter = ShardWaiter(reader.folder)
        shards_of = [sorted({reader.index[train_set.indices[p]][0] for p in block}) for block in blocks]
        self.positions, self.first_steps, self.epochs = [], [], []
        step = 0
        for epoch, order in enumerate(schedule.block_steps):
            for block, steps in order:
                if step < self.total_steps:
                    self.positions.append(shards_of[block])
                    self.first_steps.append(step)
                    self.epochs.append(epoch)
                step += steps
        self.pinned = sorted({reader.index[i][0] for i in pinned_samples})

    def position(self, step: int) -> int:
        """The position a run at `step` (steps done) reads next; len(positions) once all are read."""
        return len(self.positions) if step >= self.total_steps else bisect.bisect_right(self.first_steps, step) - 1

    def block_ends(self, step: int) -> bool:
        """Whether `step` steps done end a block (a checkpoint there lets the producer move on)."""
        return step >= self.total_steps or self.first_steps[self.position(step)] == step

    def publish(self, resume_step: int) -> None:
        """At the start of training (rank 0): the sequence, and the release point of the step resumed from."""
        self.control.publish(self.positions, self.pinned, self.first_steps)
        self.release(resume_step)

    def release(self, step: int) -> None:
        """After a checkpoint at `step` (rank 0): no resume starts before its position."""
        self.control.release(self.position(step))

    def wait(self, step: int, progress: Progress) -> None:
        """Before `step`: its block's shards are all on disk, else wait, saying what for."""
        p = self.position(step)
        missing = [s for s in self.positions[p] if not self.reader.path(s).is_file()]
        if not missing:
            return
        t0, note = time.monotonic(), (
            f"waiting for block {p + 1} of {len(self.positions)} (epoch {self.epochs[p] + 1}): {len(missing)} of its "
            f"{len(self.positions[p])} shards not extracted yet")
        progress.update(0, note=note, force=True)
        for s in missing:
            self.waiter(self.reader.path(s))
        progress.exclude(time.monotonic() - t0)  # waiting is not training: the ETA counts it apart
