"""The draft to train and its optimizers, built with speculators' own factories.

The draft is speculators' Eagle3DraftModel, shaped like the verifier (hidden size, heads, vocabulary)
but built from what vLLM's EAGLE-3 draft serves, whatever the verifier uses: a Llama layer with full
attention, a SiLU MLP, RMSNorm, and a rope vLLM computes as transformers does. The optimizers are
speculators' AdamW (built as it builds it, with torch's fused kernel) or Muon with AdamW, each with a
cosine schedule after a linear warmup. Saving, resuming and exporting it: tasks/train/checkpoints.py.
"""

from __future__ import annotations

import argparse
import logging

import torch

from tasks.train.job import TrainJob

log = logging.getLogger(__name__)

# vLLM's EAGLE-3 draft (llama_eagle3.py) builds Llama MLPs, which refuse any activation but SiLU
# ("Unsupported activation: gelu_pytorch_tanh. Only silu is supported for now").
SERVED_ACTIVATION = "silu"
# Rope types that transformers (training) and vLLM's get_rope (serving) compute alike for a Llama
# layer. A verifier with another (YaRN and its variants, whose attention scaling the two libraries
# derive differently) gives the draft plain rope at its theta: the draft's positions are its own.
SERVED_ROPE_TYPES = ("default", "linear", "llama3")


def build_draft(job: TrainJob, d2t, t2d, draft_vocab_size: int, device: torch.device):
    """speculators' Eagle3DraftModel from its own factories (full attention in every layer, as
    vLLM's EAGLE-3 serves it)."""
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config

    s = job.train_settings
    layer_config = create_transformer_layer_config(
        verifier_name_or_path=job.verifier_path, num_layers=s.num_layers, draft_arch="llama",
        hidden_act=SERVED_ACTIVATION, sliding_window=s.total_seq_len, full_attention_indices=list(range(s.num_layers)),
        trust_remote_code=job.trust_remote_code,
    )
    rope = getattr(layer_config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") not in SERVED_ROPE_TYPES:
        layer_config.rope_parameters = {"rope_type": "default", "rope_theta": rope.get("rope_theta", 10000.0)}
        log.info("the verifier's %s rope is not computed alike by transformers and vLLM: the draft uses plain rope "
                 "with theta %g", rope.get("rope_type"), layer_config.rope_parameters["rope_theta"])
    attn = "simple_flex_attention" if device.type == "cuda" else "sdpa"  # flex has no CPU backward
    # speculators' loader warns "Tensor 'lm_head.weight' not found" for every verifier with tied
    # embeddings, whose head is its embedding; whatever tensors it takes for the head and the final
    # norm are checked against the verifier's own before training (tasks/train/targets.py)
    from loguru import logger

    logger.disable("speculators.utils.loading")
    model = Eagle3DraftModel.from_training_args(
        verifier_config=layer_config, t2d=t2d, d2t=d2t, verifier_name_or_path=job.verifier_path,
        draft_vocab_size=draft_vocab_size, norm_before_residual=s.norm_before_residual, ttt_steps=s.ttt_steps,
        target_layer_ids=job.aux_layers, norm_before_fc=s.norm_before_fc, fc_norm=s.fc_norm,
        norm_output=s.norm_output,
        draft_attn_impl=attn, trust_remote_code=job.trust_remote_code,
    )
    logger.enable("speculators.utils.loading")
    return model.to(device)


def build_optimizers(model, s, total_steps: int):
    from speculators.train.optimizers import build_optimizers as speculators_optimizers
    from transformers import get_cosine_schedule_with_warmup

    if s.optimizer == "adamw":
        # speculators' AdamW (the same constructor call), with torch's fused kernel: one pass over each
        # parameter, its gradient and moments, where the default (foreach) makes several. For an 8B-shaped
        # draft on one H100 it took 4.8 ms off a ~127-ms GPU step (AdamW's kernels 4.7 ms against foreach's
        # 7.9; 2026-12-06, docs/BENCHMARKS.md). The same update, on a GPU and on a CPU.
        optimizers = [torch.optim.AdamW(model.named_parameters(), lr=s.lr, weight_decay=s.weight_decay, fused=True)]
    else:
        optimizers = speculators_optimizers(model, argparse.Namespace(
            optimizer=s.optimizer, lr=s.lr, weight_decay=s.weight_decay, muon_lr=s.lr, muon_momentum=0.95,
            muon_weight_decay=s.weight_decay, muon_ns_steps=5, muon_adjust_lr_fn="match_rms_adamw"))
    schedulers = [get_cosine_schedule_with_warmup(o, s.warmup_steps, max(total_steps, 1)) for o in optimizers]
    return optimizers, schedulers
