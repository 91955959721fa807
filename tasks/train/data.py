"""Training data: samples from our shards in the layout speculators' EAGLE-3 model expects.

Each sample is what speculators' own datasets produce (`hidden_states` [T, 3H] from the auxiliary
layers, `verifier_last_hidden_states` [T, H], `input_ids`, `loss_mask`, `lengths`,
`position_ids`), so speculators' `shift_batch` (aligns token t+1 with hidden state t) and
`CollateFn` (packs samples up to `total_seq_len` with document ids) are used as they are.
Packing is speculators' `MultipackDistributedBatchSamplerV2`.

A step consumes one packed micro-batch per "slot"; there are world_size x grad_accum_steps
slots, and rank r takes slots r*grad_accum_steps ... . A single process with grad_accum_steps=2
therefore sees exactly the batches two DDP ranks would, which makes runs comparable across
world sizes and lets a killed run resume at the exact step.

Before any of it, `check_inputs` makes sure the shards, the vocabulary and the verifier belong
together (and a warm start's draft: tasks/train/warm_start.py); a warm start trains on the samples
its parent did not, and a replay share of those it did (`warm_start_samples`).
"""

from __future__ import annotations

import copy
import logging
import random
import time
from pathlib import Path

import torch
import torch.distributed as dist
import xxhash
from torch.utils.data import DataLoader, Dataset

from tasks.common.content import sample_key
from tasks.common.errors import PermanentError
from tasks.common.verifier import inspect_verifier, verifier_fingerprint
from tasks.extract.shards import ShardReader
from tasks.prepare.dataset import load_prepared, token_rows
from tasks.train.job import TrainJob
from tasks.train.warm_start import check_warm_start, draft_vocab, parent_sample_keys, replay_choice
from tasks.vocab import load_vocab

log = logging.getLogger(__name__)

MODEL_INPUTS = ("hidden_states", "input_ids", "document_ids", "loss_mask", "position_ids",
                "verifier_last_hidden_states")  # the batch's tensors the draft's forward takes


class TrainDataError(PermanentError, ValueError):
    """The shards, prepared data or split cannot be trained on; the message says why."""


class ShardDataset(Dataset):
    """Samples of an extraction manifest, with loss masks from the prepared data. Shards are
    checked against the manifest before their first use (ShardReader)."""

    def __init__(self, manifest_path: str | Path, prepared_path: str | Path, indices: list[int] | None = None,
                 **reader_options):
        self.reader = ShardReader(manifest_path, **reader_options)
        self.prepared = load_prepared(prepared_path)
        self.rows = [row for shard in self.reader.manifest["shards"] for row in shard["rows"]]
        self.indices = list(range(len(self.reader))) if indices is None else indices

    def subset(self, indices: list[int]) -> ShardDataset:
        """The samples at `indices`, sharing this dataset's reader (its shards verified once)."""
        subset = copy.copy(self)
        subset.indices = indices
        return subset

    def __len__(self) -> int:
        return len(self.indices)

    def lengths(self) -> list[int]:
        return [self.reader.lengths[i] for i in self.indices]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        j = self.indices[i]
        input_ids, states = self.reader[j]
        loss_mask = torch.tensor(self.prepared[self.rows[j]]["loss_mask"], dtype=torch.bool)
        if loss_mask.numel() != input_ids.numel():
            raise TrainDataError(f"sample {self.reader.sample_ids[j]}: {input_ids.numel()} tokens in the shard, "
                                 f"{loss_mask.numel()} in the prepared loss mask")
        n = input_ids.numel()
        return {
            "hidden_states": states[:, :-1].flatten(1),  # the 3 auxiliary layers: [T, 3H]
            "verifier_last_hidden_states": states[:, -1],  # the last layer, pre-norm: [T, H]
            "input_ids": input_ids,
            "loss_mask": loss_mask,
            "lengths": torch.tensor([n]),
            "position_ids": torch.arange(n),
        }


def split_indices(sample_ids: list[str], val_fraction: float) -> tuple[list[int], list[int]]:
    """Train/validation split by a hash of each sample's id: stable when data is appended."""
    if val_fraction <= 0:
        return list(range(len(sample_ids))), []
    cut = int(val_fraction * 2**32)
    val = [i for i, s in enumerate(sample_ids) if xxhash.xxh32_intdigest(s.encode()) < cut]
    if not val and len(sample_ids) > 1:
        val = [len(sample_ids) - 1]
    val_set = set(val)
    return [i for i in range(len(sample_ids)) if i not in val_set], val


def split_shards(reader: ShardReader, val_fraction: float) -> tuple[list[int], list[int]]:
    """Train/validation split by whole shards, each held out by a hash of its first sample id (the
    split of `train.shuffle_block_shards`): a stream keeps the validation shards for the whole run and
    releases the others block by block (tasks/extract/stream.py), which a split by sample would not allow."""
    shards = reader.manifest["shards"]
    if val_fraction <= 0:
        return list(range(len(reader))), []
    cut = int(val_fraction * 2**32)
    held = {s for s, shard in enumerate(shards) if xxhash.xxh32_intdigest(shard["sample_ids"][0].encode()) < cut}
    if not held and len(shards) > 1:
        held = {len(shards) - 1}
    return ([i for i, (s, _) in enumerate(reader.index) if s not in held],
            [i for i, (s, _) in enumerate(reader.index) if s in held])


def sample_keys(dataset: ShardDataset) -> list[str]:
    """Each sample's content key (tasks/common/content.py), in the reader's order: as the manifest lists
    them, else (a manifest from before content keys) from the prepared token ids, which extraction
    checked the shards hold."""
    if None not in dataset.reader.sample_keys:
        return dataset.reader.sample_keys
    by_row = [sample_key(ids) for ids in token_rows(dataset.prepared)]
    return [by_row[row] for row in dataset.rows]


def warm_start_samples(dataset: ShardDataset, train_indices: list[int], parent_manifest: str | None,
                       replay_fraction: float, seed: int) -> tuple[list[int], int, int]:
    """A warm start's training samples (tasks/train/warm_start.py): those of `train_indices` the
    parent did not train on, and a `replay_fraction` share of those it did; returns them with how
    many are new and how many replayed. Without the parent's manifest every sample counts as new."""
    if parent_manifest is None:
        return train_indices, len(train_indices), 0
    chosen = replay_choice(train_indices, sample_keys(dataset), parent_sample_keys(parent_manifest),
                           replay_fraction, seed)
    if not chosen[0]:
        raise TrainDataError(f"nothing to train on: the parent draft trained on all {len(train_indices)} training "
                             f"samples and train.replay_fraction {replay_fraction} replays none of them")
    return chosen


def shard_blocks(dataset: ShardDataset, shards_per_block: int) -> list[list[int]]:
    """The dataset's positions grouped by blocks of `shards_per_block` consecutive extraction shards
    (`train.shuffle_block_shards`), in shard order."""
    blocks: dict[int, list[int]] = {}
    for position, sample in enumerate(dataset.indices):
        blocks.setdefault(dataset.reader.index[sample][0] // shards_per_block, []).append(position)
    return [blocks[b] for b in sorted(blocks)]


class StepBatches(torch.utils.data.Sampler):
    """Index lists for this rank: per step, its grad_accum_steps micro-batches, from `start` on.

    Without `blocks`, one epoch packs a shuffle of every sample (speculators' Multipack sampler).
    With `blocks` (shard_blocks), each epoch takes the blocks in an order of its own (seeded by seed
    and epoch) and packs each block's samples on their own (seeded by seed, epoch and block), one
    block's steps after the other: training then reads a block of shards at a time, the order a
    stream of hidden states can follow with a bounded window (docs/STREAMING.md)."""

    def __init__(self, lengths: list[int], total_seq_len: int, world_size: int, rank: int, grad_accum_steps: int,
                 seed: int, epoch: int, start_step: int = 0, blocks: list[list[int]] | None = None):
        slots = range(rank * grad_accum_steps, (rank + 1) * grad_accum_steps)
        self.block_steps: list[tuple[int, int]] = []  # with blocks: (block, its steps), in this epoch's order
        if blocks is None:
            per_slot = [self._packed(lengths, total_seq_len, world_size * grad_accum_steps, slot, seed, epoch)
                        for slot in slots]
            self.steps = min(len(b) for b in per_slot)
        else:
            order = list(range(len(blocks)))
            random.Random(f"block order {seed} {epoch}").shuffle(order)
            per_slot, self.steps = [[] for _ in slots], 0
            for b in order:
                block = blocks[b]
                packed = [self._packed([lengths[i] for i in block], total_seq_len, world_size * grad_accum_steps,
                                       slot, seed + 1_000_003 * (b + 1), epoch) for slot in slots]
                steps = min(len(p) for p in packed)  # every slot takes the block's full steps only, as per epoch
                for mine, batches in zip(per_slot, packed, strict=True):
                    mine.extend([block[i] for i in batch] for batch in batches[:steps])
                self.steps += steps
                self.block_steps.append((b, steps))
        self.batches = [per_slot[a][s] for s in range(start_step, self.steps) for a in range(grad_accum_steps)]

    @staticmethod
    def _packed(lengths: list[int], total_seq_len: int, slots: int, slot: int, seed: int,
                epoch: int) -> list[list[int]]:
        # speculators is imported where it is used (as in tasks/vocab.py): seconds a process otherwise
        from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

        sampler = MultipackDistributedBatchSamplerV2(total_seq_len, lengths, num_replicas=slots, rank=slot, seed=seed)
        sampler.set_epoch(epoch)
        return [b.tolist() for b in sampler]

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class TrainSchedule:
    """How many optimizer steps each epoch has, the run's total, and where a step lies.

    Packing reshuffles every epoch, so epochs pack into different numbers of steps (a few
    fewer or more): the schedule counts each epoch's own packing. The learning-rate schedule,
    the progress total and the position a resumed run starts from all come from here.
    """

    def __init__(self, lengths: list[int], total_seq_len: int, world_size: int, grad_accum_steps: int, seed: int,
                 epochs: int, max_steps: int | None = None, blocks: list[list[int]] | None = None):
        self.per_epoch: list[int] = []
        self.block_steps: list[list[tuple[int, int]]] = []  # per epoch, with blocks: (block, steps) in order
        for epoch in range(epochs):  # every rank packs the same number of steps: rank 0's count is the count
            batches = StepBatches(lengths, total_seq_len, world_size, 0, grad_accum_steps, seed, epoch, blocks=blocks)
            self.per_epoch.append(batches.steps)
            self.block_steps.append(batches.block_steps)
            if max_steps and sum(self.per_epoch) >= max_steps:
                break
        self.total_steps = min(sum(self.per_epoch), max_steps or sum(self.per_epoch))

    def locate(self, step: int) -> tuple[int, int]:
        """(epoch, step within that epoch) of the run's `step`-th step (0-based)."""
        for epoch, steps in enumerate(self.per_epoch):
            if step < steps:
                return epoch, step
            step -= steps
        raise IndexError(f"step past the schedule's {sum(self.per_epoch)} steps")


def make_loader(dataset: ShardDataset, sampler: StepBatches, total_seq_len: int, hidden_size: int,
                dtype: torch.dtype, workers: int) -> DataLoader:
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn

    collate = CollateFn(total_seq_len, hidden_size, num_target_layers=3, dtype=dtype, preprocess=shift_batch)
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, num_workers=workers,
                      pin_memory=torch.cuda.is_available(), persistent_workers=False,
                      prefetch_factor=4 if workers else None)


def verify_shards(reader: ShardReader, rank: int, world: int) -> None:
    """Every shard checked against the manifest before training reads it: each rank checks a share
    and trusts the others' (a rank that finds a bad shard fails, and torchrun stops the others)."""
    t0 = time.monotonic()
    mine = range(rank, len(reader.manifest["shards"]), world)
    reader.verify(mine)
    if world > 1:
        checked: list[dict | None] = [None] * world
        dist.all_gather_object(checked, {s: reader.verified[s] for s in mine})
        for part in checked:
            reader.verified.update(part)
    log.info("%d shards checked against %s in %.1f s (fingerprints, checksums)", len(reader.manifest["shards"]),
             reader.manifest_path.name, time.monotonic() - t0)


def check_inputs(job: TrainJob, manifest: dict) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
    """Shards, vocabulary and verifier belong together, and so does a warm start's draft; returns
    (d2t, t2d, draft vocab size): the vocab stage's, or the warm start's draft's own."""
    verifier = inspect_verifier(job.verifier_path)
    if manifest.get("verifier_fingerprint") != verifier_fingerprint(job.verifier_path):
        raise TrainDataError(f"the shards in {Path(job.manifest).parent} were extracted from another verifier "
                             f"({manifest.get('verifier')}), not {job.verifier_path}")
    if manifest["layers"] != job.aux_layers + [verifier.num_layers]:
        raise TrainDataError(f"the shards hold layers {manifest['layers']}, the draft needs "
                             f"{job.aux_layers + [verifier.num_layers]}")
    if manifest["hidden_size"] != verifier.hidden_size:
        raise TrainDataError(f"shard hidden size {manifest['hidden_size']} != verifier's {verifier.hidden_size}")
    if manifest["samples"] == 0:
        raise TrainDataError("the extraction holds no samples")
    if job.init_from is not None:  # a warm start keeps the draft's vocabulary: its lm_head rows mean those tokens
        check_warm_start(job.init_from, job.verifier_path, job.aux_layers, verifier.hidden_size, verifier.vocab_size,
                         job.train_settings, job.parent_manifest)
        return draft_vocab(job.init_from, verifier.vocab_size)
    d2t, t2d = load_vocab(job.vocab_path, verifier.vocab_size)
    if d2t.numel() == verifier.vocab_size:
        return None, None, verifier.vocab_size  # full vocabulary: no mapping (speculators' convention)
    return d2t, t2d, d2t.numel()
