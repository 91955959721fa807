"""The draft to train and its optimizers, built with speculators' own factories.

The draft is speculators' Eagle3DraftModel, configured from the verifier (full attention in
every layer, as vLLM's EAGLE-3 serves it); the optimizers are speculators' (AdamW or Muon), each
with a cosine schedule after a linear warmup. Saving, resuming and exporting it: tasks/train/checkpoints.py.
"""

from __future__ import annotations

import argparse

import torch

from tasks.train.job import TrainJob


def build_draft(job: TrainJob, d2t, t2d, draft_vocab_size: int, device: torch.device):
    """speculators' Eagle3DraftModel from its own factories (full attention in every layer, as
    vLLM's EAGLE-3 serves it)."""
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config

    s = job.train_settings
    layer_config = create_transformer_layer_config(
        verifier_name_or_path=job.verifier_path, num_layers=s.num_layers, draft_arch="llama", hidden_act=None,
        sliding_window=s.total_seq_len, full_attention_indices=list(range(s.num_layers)),
        trust_remote_code=job.trust_remote_code,
    )
    attn = "simple_flex_attention" if device.type == "cuda" else "sdpa"  # flex has no CPU backward
    model = Eagle3DraftModel.from_training_args(
        verifier_config=layer_config, t2d=t2d, d2t=d2t, verifier_name_or_path=job.verifier_path,
        draft_vocab_size=draft_vocab_size, norm_before_residual=s.norm_before_residual, ttt_steps=s.ttt_steps,
        target_layer_ids=job.aux_layers, norm_before_fc=s.norm_before_fc, norm_output=s.norm_output,
        draft_attn_impl=attn, trust_remote_code=job.trust_remote_code,
    )
    return model.to(device)


def build_optimizers(model, s, total_steps: int):
    from speculators.train.optimizers import build_optimizers as speculators_optimizers
    from transformers import get_cosine_schedule_with_warmup

    settings = argparse.Namespace(optimizer=s.optimizer, lr=s.lr, weight_decay=s.weight_decay, muon_lr=s.lr,
                                  muon_momentum=0.95, muon_weight_decay=s.weight_decay, muon_ns_steps=5,
                                  muon_adjust_lr_fn="match_rms_adamw")
    optimizers = speculators_optimizers(model, settings)
    schedulers = [get_cosine_schedule_with_warmup(o, s.warmup_steps, max(total_steps, 1)) for o in optimizers]
    return optimizers, schedulers
