"""How long training takes on the target GPUs, sized before any GPU is rented (tasks/plan.py): a rate
measured on the H100/H200 machines, scaled by the draft's arithmetic, never past the step rate a host
was measured to sustain. A small draft is bound by the host (its kernels are too short to fill the
GPU), a large one by its matmuls."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tasks.common.config import TrainSettings

# A Llama-3.1-8B-shaped draft (hidden 4096, draft vocabulary 32000, TTT 3, 8192-token micro-batches)
# trained at 53,250 tokens/s steady on one H200 (train_speed_vs_speculators of 2026-12-04, now in
# docs/benchmarks-history.jsonl; 48,993-53,064 on one H100, 2026-12-06): 7.20 GFLOP a token by count
# (draft_flops_per_token).
MEASURED_TRAIN_TOKENS_PER_S = 53_250
MEASURED_TRAIN_FLOPS_PER_TOKEN = 7.202e9
# SmolLM2's draft (hidden 576) ran 18.0-19.4 micro-batches/s (156,957 tokens/s steady) on one H100,
# a fifth of what its arithmetic allows at the rate above (docs/BENCHMARKS.md, tenth measurement):
# the host's ceiling, whatever the draft's size.
MEASURED_MAX_STEPS_PER_S = 19.2


def draft_flops_per_token(shape: dict, draft_vocab: int, ttt_steps: int = 3, aux_layers: int = 3) -> float:
    """Matmul FLOPs of one training token of a 1-layer EAGLE-3 draft, by count, for a verifier of
    `shape` (its config.json's text part). A weight costs 2 FLOPs per token forward and 4 backward
    (input and weight gradients); the fc's input needs no gradient, the targets' head (verifier norm
    + lm_head over the draft vocabulary) runs without one."""
    h, f = shape["hidden_size"], shape.get("intermediate_size", 4 * shape["hidden_size"])
    heads = shape.get("num_attention_heads", 1)
    kv = (shape.get("head_dim") or h // heads) * shape.get("num_key_value_heads", heads)
    layer = 2 * h * h + 2 * (2 * h * kv) + h * h + 3 * h * f  # q, k, v from [embedding, hidden]; o; MLP
    return 6 * ttt_steps * (layer + h * draft_vocab) + 4 * aux_layers * h * h + 2 * h * draft_vocab


@dataclass(frozen=True)
class TrainingSize:
    steps: int  # optimizer steps the run takes
    steps_per_epoch: int
    tokens_per_s: float  # all GPUs together, steady state
    bound: str  # "host" or "arithmetic"
    tokens_per_step: int
    gpus: int

    @property
    def seconds(self) -> float:
        """Steady state: start-up (the first shards, compilation) and validation come on top."""
        return self.steps * self.tokens_per_step / self.tokens_per_s

    @property
    def epochs(self) -> int:
        """Epochs begun: what a streamed run extracts, once each."""
        return math.ceil(self.steps / self.steps_per_epoch)

    def describe(self) -> str:
        limit = (f"the host's {MEASURED_MAX_STEPS_PER_S:g} micro-batches/s measured on an H100" if self.bound == "host"
                 else "the draft's matmuls at the rate measured for an 8B-shaped draft on an H200")
        return (f"{self.steps:,} steps ({self.epochs} epoch(s) of ~{self.steps_per_epoch:,}) at "
                f"~{self.tokens_per_s:,.0f} tokens/s, bound by {limit}")


def size_training(shape: dict, train: TrainSettings, draft_vocab: int, tokens: int, gpu_tflops: float,
                  reference_tflops: float) -> TrainingSize:
    """Training of `tokens` tokens of data (the validation share held out) with `train`'s settings on
    `train.nproc` GPUs of `gpu_tflops`, against the `reference_tflops` the measured rates ran on."""
    tokens_per_step = train.total_seq_len * train.grad_accum_steps * train.nproc
    steps_per_epoch = max(1, math.ceil(tokens * (1 - train.val_fraction) / tokens_per_step))
    steps = min(train.epochs * steps_per_epoch, train.max_steps or math.inf)
    flops = draft_flops_per_token(shape, draft_vocab, train.ttt_steps)
    by_arithmetic = MEASURED_TRAIN_TOKENS_PER_S * MEASURED_TRAIN_FLOPS_PER_TOKEN / flops * gpu_tflops / reference_tflops
    by_host = MEASURED_MAX_STEPS_PER_S * train.total_seq_len
    return TrainingSize(int(steps), steps_per_epoch, min(by_arithmetic, by_host) * train.nproc,
                        "host" if by_host < by_arithmetic else "arithmetic", tokens_per_step, train.nproc)
