"""Evaluating a draft: loss, per-position metrics and replayed acceptance over held-out samples.

`evaluate` is training's validation pass (tasks/train/loop.py) and `evaluate_draft` scores a saved
draft the same way (the benchmarks). Metrics are counted (`*_sum`, `*_total`): summed over
batches and ranks, then normalized with speculators' `normalize_counted_metrics`, so they do not
depend on the batching; the training loop logs its own metrics with the same helpers.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from tasks.extract.shards import read_manifest
from tasks.train.acceptance import replay_speculative_decoding
from tasks.train.checkpoints import load_draft
from tasks.train.data import MODEL_INPUTS, ShardDataset, StepBatches, make_loader


def reduce_sums(sums: dict[str, torch.Tensor], distributed: bool) -> dict[str, torch.Tensor]:
    """Counted metrics summed over the ranks."""
    keys = sorted(sums)
    if not keys:
        return {}
    stacked = torch.stack([sums[k].float().reshape(()) for k in keys])
    if distributed:
        dist.all_reduce(stacked)
    return dict(zip(keys, stacked.unbind(), strict=True))


def reduce_metrics(sums: dict[str, torch.Tensor], distributed: bool) -> dict[str, float]:
    from speculators.train.utils import normalize_counted_metrics

    reduced = reduce_sums(sums, distributed)
    # one copy to the host for all of them: an .item() each was ~20 waits on the GPU per logged step
    values = torch.stack(list(reduced.values())).tolist() if reduced else []
    return normalize_counted_metrics(dict(zip(reduced, values, strict=True)))


def accumulate(sums: dict[str, torch.Tensor], metrics: dict[str, torch.Tensor]) -> None:
    for k, v in metrics.items():
        if k.endswith(("_sum", "_total")):
            v = v.detach().float()
            sums[k] = sums[k] + v if k in sums else v


def evaluate(net, dataset: ShardDataset | None, total_seq_len: int, hidden: int, dtype: torch.dtype,
             device: torch.device, call: dict, world: int = 1, rank: int = 0, seed: int = 0) -> dict[str, float]:
    """Loss and per-position metrics of a draft over a dataset (its packed batches split over the
    ranks; sums all-reduced), and greedy speculative decoding replayed over it (tasks/train/acceptance.py).
    Accuracies are token counts, so they do not depend on the batching."""
    net.eval()
    model = net.module if isinstance(net, torch.nn.parallel.DistributedDataParallel) else net
    sums: dict[str, torch.Tensor] = {}
    sampler = StepBatches(dataset.lengths(), total_seq_len, world, rank, 1, seed, 0) if dataset else []
    if dataset and len(sampler):
        with torch.no_grad(), torch.autocast(device.type, dtype, enabled=device.type == "cuda"):
            for batch in make_loader(dataset, sampler, total_seq_len, hidden, dtype, 0):
                inputs = {k: batch[k].to(device) for k in MODEL_INPUTS}
                draft_tokens, _, metrics = net(**inputs, **call)
                accumulate(sums, metrics)
                # the targets speculators' forward computes and does not return
                targets = model.verifier_lm_head(model.verifier_norm(inputs["verifier_last_hidden_states"]))
                accumulate(sums, replay_speculative_decoding(draft_tokens, targets.argmax(-1), inputs["loss_mask"],
                                                             inputs["document_ids"]))
    return reduce_metrics(sums, world > 1)


def draft_evaluator(draft: str | Path, ttt_steps: int = 3, total_seq_len: int = 8192,
                    verifier: str | Path | None = None) -> Callable[..., dict[str, float]]:
    """A saved draft, loaded once, as a function scoring it on extracted samples: `(manifest, prepared_path,
    samples=None)` -> per-position metrics (all samples, or the manifest's rows `samples`), with greedy
    speculative decoding replayed over them. Scoring many sample sets, load the draft once."""
    from speculators.losses import resolve_loss_config

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = load_draft(draft, device, verifier)
    call = {"ttt_steps": ttt_steps, "ttt_step_loss_decay": 1.0, "loss_config": resolve_loss_config("kl_div", "eager")}
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def score(manifest: str | Path, prepared_path: str | Path, samples: list[int] | None = None) -> dict[str, float]:
        dataset = ShardDataset(manifest, prepared_path, samples)
        return evaluate(model, dataset, total_seq_len, read_manifest(manifest)["hidden_size"], dtype, device, call)

    return score


def evaluate_draft(draft: str | Path, manifest: str | Path, prepared_path: str | Path, ttt_steps: int = 3,
                   total_seq_len: int = 8192, verifier: str | Path | None = None,
                   samples: list[int] | None = None) -> dict[str, float]:
    """Per-position metrics of a saved draft on extracted samples (all, or the manifest's rows
    `samples`), with greedy speculative decoding replayed over them."""
    return draft_evaluator(draft, ttt_steps, total_seq_len, verifier)(manifest, prepared_path, samples)
