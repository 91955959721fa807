"""On-policy refinement (`train.on_policy_steps`): the last steps of a run train the draft on the
states its own drafting reaches, not on every position of the verifier's answers.

Supervised TTT trains a draft at every answer position and every draft step alike. Serving reaches
far fewer of those states: a draft starts only after the last verified token, and its step j counts
only where steps 0..j-1 were accepted. Draft-OPD (arXiv 2605.29343) calls this the offline-to-inference
mismatch behind the plateau of supervised training, and trains on the states speculative decoding
itself visits: target-assisted rollouts, with drafting replayed from the positions verification
exposes as errors.

For greedy verification over answers the verifier wrote greedily (what `data.regenerate` makes),
those states are known without running the verifier again: the target-assisted rollout of a prompt
is the verifier's own answer, and its verdict on any draft token is the stored target there. So each
micro-batch is first drafted by the current draft (no gradients) and replayed as speculative decoding
over the answer (tasks/train/acceptance.py), and the loss then keeps, for each draft that decoding
starts, its steps up to and including the first one the verifier rejects; every other (start, step)
pair weighs nothing. That is the gradient of the acceptance length itself: a step's tokens matter
only where the steps before it were accepted.

What it does not cover: sampled verification (temperature > 0), where accepted draft tokens can
differ from the verifier's greedy ones and the verifier's states on those paths are not stored; and
data whose answers the verifier did not write, where its greedy path is not the stored one.

Measured (2026-12-05, docs/BENCHMARKS.md, seventh measurement): the last 2,000 of 5,693 steps
on-policy gave the supervised draft's acceptance (vLLM 2.498 against 2.497), at 1.5x the step time.
In this exact form the rollout is the supervised data itself, so the refinement only re-weighs
positions supervised training already trains; what Draft-OPD adds (the verifier's verdicts on the
draft's own divergent continuations) needs a verifier pass this form leaves out. Off by default.
"""

from __future__ import annotations

import torch

from tasks.train.acceptance import correct_drafts, replayed_drafts

DRAFTED_STATES = "drafted_states"


class DraftedStatesLoss:
    """A per-position loss of speculators' (`fn(logits, targets) -> [1, n]`) weighted by the (start,
    step) pairs that replayed decoding reaches (`weights`, [k, T], set before each forward).

    speculators calls it once per TTT step with the step's aligned logits, which at step j cover the
    starts 0..T-j-1: the step is read from that length."""

    def __init__(self, loss_fn):
        self.loss_fn = loss_fn
        self.weights: torch.Tensor | None = None

    # Outside torch.compile's graph (a graph break per TTT step, in the refinement steps only): the
    # step index comes from a shape and the weights change with every batch.
    @torch.compiler.disable
    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        n = logits.shape[1]
        step = self.weights.shape[1] - n
        loss = self.loss_fn(logits, targets)
        return loss * self.weights[step, :n].to(loss.dtype)


def drafted_states(draft_tokens: list[torch.Tensor], targets: torch.Tensor, loss_mask: torch.Tensor,
                   document_ids: torch.Tensor) -> torch.Tensor:
    """[k, T] float: 1 where the draft that replayed greedy decoding starts at p runs step j (steps
    0..j-1 accepted; step j accepted or the first rejected), else 0. Arguments as
    `acceptance.replay_speculative_decoding`'s."""
    k, n = len(draft_tokens), targets.shape[1]
    weights = torch.zeros(k, n, device=targets.device)
    for start, accepted in replayed_drafts(correct_drafts(draft_tokens, targets, loss_mask, document_ids), loss_mask):
        weights[: min(accepted + 1, k), start] = 1.0
    return weights


def on_policy_loss_config(loss_config: dict) -> dict:
    """speculators' loss config with each term wrapped in a `DraftedStatesLoss`."""
    return {name: (DraftedStatesLoss(fn), weight) for name, (fn, weight) in loss_config.items()}


@torch.no_grad()
def weigh_drafted_states(model, inputs: dict[str, torch.Tensor], ttt_steps: int, loss_config: dict) -> dict:
    """Draft the batch with the model as it is (no gradients), replay greedy decoding over it, and set
    the weights of `loss_config`'s terms for the forward that follows. Returns the share of (answer
    position, step) pairs kept, as counted metrics (`drafted_states_sum` / `_total`)."""
    last = inputs["verifier_last_hidden_states"]
    draft_inputs = {k: v for k, v in inputs.items() if k != "verifier_last_hidden_states"}
    draft_tokens = model(**draft_inputs, ttt_steps=ttt_steps)  # without the verifier's states: tokens only
    targets = model.verifier_lm_head(model.verifier_norm(last)).argmax(-1)
    weights = drafted_states(draft_tokens, targets, inputs["loss_mask"], inputs["document_ids"])
    for fn, _ in loss_config.values():
        fn.weights = weights
    answer = inputs["loss_mask"][0].bool().sum().float() * ttt_steps
    return {f"{DRAFTED_STATES}_sum": weights.sum(), f"{DRAFTED_STATES}_total": answer}
