"""Which samples the drift check measures: this run's samples the current draft never saw (by content),
and the validation samples the draft was measured on when it was trained."""

from __future__ import annotations

from pathlib import Path

from tasks.common.content import sample_key
from tasks.extract.shards import ShardReader
from tasks.prepare.dataset import token_rows
from tasks.train.data import ShardDataset, split_indices, split_shards


def manifest_sample_keys(manifest: str | Path) -> list[str]:
    """The content key of each sample of an extraction manifest: as the manifest lists it, or, for a
    manifest written before content keys, computed from the sample's tokens in its shard."""
    reader = ShardReader(manifest)
    return [key if key is not None else sample_key(reader[i][0]) for i, key in enumerate(reader.sample_keys)]


def new_sample_indices(manifest: str | Path, parent_manifest: str | Path) -> list[int]:
    """The samples of `manifest` (its positions) whose content the parent's manifest does not hold."""
    seen = set(manifest_sample_keys(parent_manifest))
    return [i for i, key in enumerate(manifest_sample_keys(manifest)) if key not in seen]


def validation_samples(manifest: str | Path, val_fraction: float, by_shard: bool = False) -> list[int]:
    """The samples training held out of `manifest` for validation: the split tasks/train/loop.py makes,
    by sample, or by whole shards with `train.shuffle_block_shards` (`by_shard`)."""
    reader = ShardReader(manifest)
    _, held_out = split_shards(reader, val_fraction) if by_shard else split_indices(reader.sample_ids, val_fraction)
    return held_out


def samples_on_disk(manifest: str | Path, prepared_path: str | Path, samples: list[int]) -> bool:
    """Whether the manifest, its prepared data and every shard holding one of `samples` still exist
    (a garbage collection may have removed an old run's)."""
    if not Path(manifest).is_file() or not Path(prepared_path).exists():
        return False
    reader = ShardReader(manifest)
    return all(reader.path(s).is_file() for s in {reader.index[i][0] for i in samples})


def answer_tokens(manifest: str | Path, prepared_path: str | Path, samples: list[int]) -> int:
    """The answer tokens of a manifest's `samples` (their loss masks' positions, where drafts start): what
    a simulated acceptance length over them averages."""
    dataset = ShardDataset(manifest, prepared_path)
    per_row = [int(mask.sum()) for mask in token_rows(dataset.prepared, "loss_mask")]
    return sum(per_row[dataset.rows[i]] for i in samples)
