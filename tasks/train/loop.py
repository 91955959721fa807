"""The training loop: one process of a run (of `WORLD_SIZE`, under torchrun or Ray Train).

speculators' `Trainer` needs an accelerator (it moves the model to `local_rank` and synchronizes
the accelerator every step), so this is one lean loop that runs the same on CPU and GPU:

    for each step: for each micro-batch: forward (speculators' Eagle3DraftModel computes the
    TTT loss and per-position metrics) -> backward; clip; optimizer and schedule step;
    every eval_every steps: validate, checkpoint, keep the best by simulated acceptance length.

- CPU: sdpa attention, eager loss, float32. GPU: flex attention, bf16 autocast, the model's
  compiled forward. DDP under torchrun when several processes are launched (gloo on CPU).
- Every shard is checked against the extraction manifest before training reads it (fingerprint,
  checksum; once per shard, the ranks sharing the work): a damaged or foreign shard stops the run
  with a ShardError naming the file instead of training on it.
- The draft and its optimizers come from speculators' factories (tasks/train/model.py); validation
  and the counted metrics it shares with the loop are in tasks/train/evaluation.py.
- Checkpoints (tasks/train/checkpoints.py) hold the draft and the training state, the metrics window
  included; after a kill, training resumes from the last complete checkpoint and follows the
  uninterrupted run's trajectory, its metrics log included. With them, torch.compile's work is kept
  for a process on another machine (tasks/train/compile_cache.py).
- `train.on_policy_steps`: the run's last steps train on the states the draft's own drafting reaches
  (tasks/train/on_policy.py): each micro-batch is drafted first, without gradients, and the loss
  weighs only the (start, step) pairs replayed greedy decoding runs.
- `train.init_from`: a warm start (tasks/train/warm_start.py) begins at a trained draft's weights, with
  its vocabulary, and trains on the samples its parent did not see plus a replay share of those it did.
- The best checkpoint is chosen by the *simulated acceptance length* on held-out samples, not
  by loss (acceptance can peak while loss still falls), and exported in bf16 as `draft/`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from tasks.common.progress import Progress, ProgressCallback
from tasks.common.verifier import inspect_verifier
from tasks.common.workers import progress_file_callback, reporting_errors
from tasks.extract.shards import read_manifest
from tasks.train.acceptance import simulated_acceptance_length
from tasks.train.checkpoints import (
    export_draft,
    newest_checkpoint_step,
    remove_temporaries,
    resume_newest_intact,
    save_checkpoint,
)
from tasks.train.compile_cache import CompileCache
from tasks.train.data import (
    MODEL_INPUTS,
    ShardDataset,
    StepBatches,
    TrainDataError,
    TrainSchedule,
    check_inputs,
    make_loader,
    shard_blocks,
    split_indices,
    split_shards,
    verify_shards,
    warm_start_samples,
)
from tasks.train.evaluation import accumulate, evaluate, reduce_metrics, reduce_sums
from tasks.train.job import TrainJob, TrainResult
from tasks.train.model import build_draft, build_optimizers
from tasks.train.on_policy import on_policy_loss_config, weigh_drafted_states
from tasks.train.step_profile import StepProfiler
from tasks.train.stream import ShardWaiter, TrainStream
from tasks.train.targets import check_targets, last_states
from tasks.train.tracking import TrainingLog
from tasks.train.warm_start import load_parent_weights

log = logging.getLogger(__name__)


def setup_distributed() -> tuple[int, int, int]:
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return int(os.environ.get("RANK", 0)), world, int(os.environ.get("LOCAL_RANK", 0))


def pick_device(setting: str, local_rank: int) -> torch.device:
    if setting == "auto":
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    return torch.device(setting)


def train_worker(job: TrainJob, callback: ProgressCallback | None = None) -> TrainResult | None:
    """One training process (of `WORLD_SIZE`). Rank 0 checkpoints, exports and returns the result."""
    t0 = time.monotonic()
    s = job.train_settings
    rank, world, local_rank = setup_distributed()
    device = pick_device(s.device, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # speculators compiles the draft's forward; every TTT step (a growing KV cache) and the
        # no-grad validation pass add graph variants. Past dynamo's default limit of 8 it silently
        # falls back to eager flex attention: 6x slower (measured on an H200).
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    out_dir = Path(job.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)  # the stage makes it; a direct call (bench/train_speed.py) may not
    # beside the run folders of this output folder's training (output_dir/train/<fingerprint>)
    compile_cache = CompileCache(out_dir.parent / ".compile-cache", device)
    compile_cache.load()
    manifest = read_manifest(job.manifest)
    d2t, t2d, draft_vocab = check_inputs(job, manifest)

    from speculators.losses import resolve_loss_config

    streamed = "stream" in manifest  # the shards appear while training reads (tasks/train/stream.py)
    full = ShardDataset(job.manifest, job.prepared_path, **(
        {"wait_for": ShardWaiter(Path(job.manifest).parent), "max_open": 2 * s.shuffle_block_shards}
        if streamed else {}))
    if not streamed:  # a streamed shard is checked when it appears
        verify_shards(full.reader, rank, world)
    train_idx, val_idx = (split_shards(full.reader, s.val_fraction) if s.shuffle_block_shards
                          else split_indices(full.reader.sample_ids, s.val_fraction))
    if not train_idx:
        raise TrainDataError("no training samples after the validation split")
    new_samples, replayed_samples = len(train_idx), 0
    if job.init_from is not None:  # the samples the parent did not train on, and a replay share of those it did
        train_idx, new_samples, replayed_samples = warm_start_samples(full, train_idx, job.parent_manifest,
                                                                      s.replay_fraction, s.seed)
    train_set = full.subset(train_idx)
    val_set = full.subset(val_idx) if val_idx else None
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hidden = manifest["hidden_size"]
    blocks = shard_blocks(train_set, s.shuffle_block_shards) if s.shuffle_block_shards else None
    schedule = TrainSchedule(train_set.lengths(), s.total_seq_len, world, s.grad_accum_steps, s.seed, s.epochs,
                             s.max_steps, blocks)
    if schedule.per_epoch[0] == 0:
        raise TrainDataError(f"{len(train_idx)} training samples give no full step for {world} process(es) x "
                             f"{s.grad_accum_steps} micro-batches; lower train.total_seq_len or add data")
    total_steps = schedule.total_steps
    if job.init_from is not None and rank == 0:
        log.info("warm start from %s: %s; %d steps", job.init_from, (
            f"{new_samples} new samples, {replayed_samples} replayed (train.replay_fraction {s.replay_fraction} of "
            "those the parent trained on)" if job.parent_manifest is not None else
            f"{new_samples} samples, all counted as new (no parent manifest: which samples the parent trained on "
            "is unknown)"), total_steps)
    # the samples the targets are checked on: in block order, ones a stream keeps all run (its
    # validation shards, else the first block read)
    probe = train_set if not blocks else val_set or train_set.subset(
        [train_set.indices[p] for p in blocks[schedule.block_steps[0][0][0]]])
    stream = TrainStream(full.reader, schedule, train_set, blocks, probe.indices) if streamed else None

    torch.manual_seed(s.seed)
    model = build_draft(job, d2t, t2d, draft_vocab, device)
    # the targets the draft trains toward, against the verifier's own norm and head (made to agree, or refused)
    if stream is not None and rank == 0:  # the producer starts on it while the draft is built and resumed
        stream.publish(newest_checkpoint_step(out_dir))
    target_check = check_targets(model, inspect_verifier(job.verifier_path), last_states(probe),
                                 job.trust_remote_code)
    if rank == 0:
        log.info("%s", target_check.describe())
        (out_dir / "target_check.json").write_text(json.dumps(target_check.to_dict(), indent=1))
    optimizers, schedulers = build_optimizers(model, s, total_steps)
    # The fused (Triton) loss needs a GPU and crashes under torch 2.11's dynamo (research/speculators.md);
    # the eager one is the same loss, computed in plain torch.
    loss_config = resolve_loss_config(s.loss, "eager")
    call = {"ttt_steps": s.ttt_steps, "ttt_step_loss_decay": s.ttt_step_loss_decay, "loss_config": loss_config}
    # on-policy refinement: the run's last steps train on the states the draft's own drafts reach
    # (tasks/train/on_policy.py); validation keeps the supervised loss, so its loss stays comparable
    if s.on_policy_steps >= total_steps:
        raise TrainDataError(f"train.on_policy_steps={s.on_policy_steps} leaves no supervised step of the "
                             f"{total_steps} this run trains: refinement needs a draft that already drafts")
    on_policy_from = total_steps - s.on_policy_steps  # total_steps, none, when 0
    on_policy_call = {**call, "loss_config": on_policy_loss_config(loss_config)}

    step, best = 0, {"step": -1, "acceptance": -1.0, "metrics": {}}
    sums: dict[str, torch.Tensor] = {}  # the metrics of the steps since the last log record
    tokens = 0
    if rank == 0:
        remove_temporaries(out_dir)
    state, resumed_from = resume_newest_intact(out_dir, model, optimizers, schedulers)
    if state is not None:
        step, best = state["step"], state["best"]
        # the log window open at the checkpoint, summed over the ranks: rank 0 carries it on
        sums, tokens = (state["window"]["sums"] if rank == 0 else {}), state["window"]["tokens"]
        log.info("resumed from %s (step %d of %d)", resumed_from, step, total_steps)
    elif job.init_from is not None:  # a warm start begins at the draft's weights; a resume at its checkpoint's
        load_parent_weights(model, job.init_from)
    if stream is not None and rank == 0:
        stream.release(step)  # where this attempt starts (earlier than the last one's after a fall-back)
    metrics_log = TrainingLog(out_dir, step, s.tensorboard) if rank == 0 else None
    net = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model

    def validate() -> dict[str, float]:
        metrics = evaluate(net, val_set, s.total_seq_len, hidden, dtype, device, call, world, rank, s.seed)
        net.train()
        return metrics

    progress = Progress("train", total_steps, "step", callback, done=step)
    profiler = StepProfiler(out_dir, s.profile_steps if rank == 0 else 0, device)
    note = ""
    t_window = time.monotonic()
    trained_tokens, steady_tokens, steady_s, windows = 0, 0, 0.0, 0
    net.train()
    while step < total_steps:
        epoch, in_epoch = schedule.locate(step)
        sampler = StepBatches(train_set.lengths(), s.total_seq_len, world, rank, s.grad_accum_steps, s.seed, epoch,
                              start_step=in_epoch, blocks=blocks)
        batches = iter(make_loader(train_set, sampler, s.total_seq_len, hidden, dtype, s.loader_workers))
        for _ in range(in_epoch, schedule.per_epoch[epoch]):
            if step >= total_steps:
                break
            if stream is not None:
                stream.wait(step, progress)
            on_policy = step >= on_policy_from
            if on_policy and step == on_policy_from and rank == 0:
                log.info("on-policy refinement: steps %d-%d train on the states the draft's own drafts reach",
                         step + 1, total_steps)
            for o in optimizers:
                o.zero_grad(set_to_none=True)
            for micro in range(s.grad_accum_steps):
                with profiler.phase("data"):
                    batch = next(batches)
                with profiler.phase("to_device"):
                    inputs = {k: batch[k].to(device, non_blocking=True) for k in MODEL_INPUTS}
                sync = world == 1 or micro == s.grad_accum_steps - 1
                # DDP all-reduces gradients only on the last micro-batch of a step
                with net.no_sync() if not sync else nullcontext(), torch.autocast(
                        device.type, dtype, enabled=device.type == "cuda"):
                    with profiler.phase("forward"):
                        if on_policy:
                            accumulate(sums, weigh_drafted_states(model, inputs, s.ttt_steps,
                                                                  on_policy_call["loss_config"]))
                        _, loss, metrics = net(**inputs, **(on_policy_call if on_policy else call))
                    with profiler.phase("backward"):
                        (loss / s.grad_accum_steps).backward()
                accumulate(sums, metrics)
                tokens += int((batch["document_ids"] != -1).sum())
            with profiler.phase("optimizer"):
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                for o in optimizers:
                    o.step()
                for sc in schedulers:
                    sc.step()
            step += 1
            profiler.step()
            if step % s.log_every == 0 or step == total_steps:
                now = time.monotonic()
                trained_tokens += tokens * world
                if windows:  # the first window of a (re)start holds torch.compile's compilation
                    steady_tokens, steady_s = steady_tokens + tokens * world, steady_s + now - t_window
                windows += 1
                metrics = reduce_metrics(sums, world > 1)
                metrics.update(step=step, epoch=epoch, lr=schedulers[0].get_last_lr()[0],
                               tokens_per_s=round(tokens * world / (now - t_window), 1))
                metrics["simulated_acceptance_length"] = simulated_acceptance_length(metrics, s.ttt_steps)
                sums, tokens, t_window = {}, 0, now
                if rank == 0:
                    metrics_log.write({"split": "train", **metrics})
                note = (f"loss {metrics['loss']:.4f}, acc0 {metrics.get('full_acc_0', 0):.3f}, "
                        f"{metrics['tokens_per_s']:,.0f} tok/s")
            progress.update(1, note=note)
            evaluation = step % s.eval_every == 0 or step == total_steps
            if evaluation or (stream is not None and stream.block_ends(step)):  # a stream moves on at checkpoints
                t_eval = time.monotonic()
                val = validate() if val_set and evaluation else {}
                acceptance = simulated_acceptance_length(val, s.ttt_steps) if val else 0.0
                if evaluation and (acceptance > best["acceptance"] or not val):  # no validation set: the latest
                    best = {"step": step, "acceptance": acceptance, "metrics": val}
                if rank == 0 and val:
                    metrics_log.write({"split": "val", "step": step, **val, "simulated_acceptance_length": acceptance})
                    log.info("validation at step %d: simulated acceptance length %.3f (best %.3f at step %d), "
                             "replayed %.3f, loss %.4f", step, acceptance, best["acceptance"], best["step"],
                             val["replayed_acceptance_length"], val["loss"])
                elif rank == 0 and evaluation:
                    log.info("checkpoint at step %d (train.val_fraction=0: no validation, the latest checkpoint "
                             "is the one exported)", step)
                window = {"sums": reduce_sums(sums, world > 1), "tokens": tokens}
                if rank == 0:
                    save_checkpoint(out_dir, model, optimizers, schedulers,
                                    {"step": step, "best": best, "window": window}, s.keep_checkpoints, best["step"])
                    if val or not val_set:  # the training and validation graphs are compiled
                        compile_cache.save()
                if world > 1:
                    dist.barrier()
                if stream is not None and rank == 0:
                    stream.release(step)
                t_window = time.monotonic()  # validation time is not training time
                progress.exclude(t_window - t_eval)  # nor in the rate the ETA comes from
    progress.close()
    profiler.close()
    if world > 1:
        dist.barrier()
    if rank != 0:
        return None
    metrics_log.close()
    best_dir = out_dir / "checkpoints" / f"step-{best['step']:08d}"
    draft = export_draft(model, best_dir, out_dir)
    result = TrainResult(
        draft_path=str(draft), fingerprint="", steps=step, best_step=best["step"],
        simulated_acceptance_length=round(best["acceptance"], 4), val_metrics=best["metrics"],
        trained_tokens=trained_tokens,
        steady_tokens_per_s=round(steady_tokens / steady_s, 1) if steady_s else None,
        wall_s=round(time.monotonic() - t0, 2), target_check=target_check.to_dict(),
        init_from=job.init_from, new_samples=new_samples, replayed_samples=replayed_samples,
    )
    replayed = best["metrics"].get("replayed_acceptance_length")
    log.info("draft exported to %s: best step %d, simulated acceptance length %.3f (k=%d), replayed %s; %s "
             "tokens trained, steady state %s, %.0f s wall", draft, best["step"], best["acceptance"], s.ttt_steps,
             "not measured (no validation set)" if replayed is None
             else f"{replayed:.3f} (what vLLM should measure on answers like these)", f"{trained_tokens:,}",
             f"{result.steady_tokens_per_s:,.0f} tokens/s (compilation, validation and checkpoints excluded)"
             if result.steady_tokens_per_s else "not measured (one log window: it holds compilation)", result.wall_s)
    return result


def main(argv: list[str] | None = None) -> int:
    """A training process: `python -m tasks.train.loop --job JOB.json` (or under torchrun)."""
    p = argparse.ArgumentParser(prog="python -m tasks.train.loop", description=main.__doc__)
    p.add_argument("--job", required=True)
    p.add_argument("--result")
    p.add_argument("--progress-file")
    a = p.parse_args(argv)
    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s")
    job = TrainJob(**json.loads(Path(a.job).read_text()))
    callback = progress_file_callback(a.progress_file) if a.progress_file and rank == 0 else None
    with reporting_errors(a.progress_file):
        result = train_worker(job, callback)
    if result is not None and a.result:
        Path(a.result).write_text(json.dumps(asdict(result)))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
