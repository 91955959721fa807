"""Acceptance length of a draft, replayed from its teacher-forced predictions.

Two estimates come from the same per-position predictions (greedy, k draft tokens):

- *chained* (`simulated_acceptance_length`): 1 + sum_i prod_{j<=i} cond_acc_j,
  as if a draft started at every answer position. Training's metric, speculators' way.
- *replayed* (`replay_speculative_decoding`, logged as `replayed_acceptance_length`): greedy
  speculative decoding replayed over each answer. A draft starts after the last verified token,
  its leading correct tokens are accepted, the verifier adds one token, and the next draft starts
  there. Easy stretches are crossed in few verification steps and hard ones in many, so where
  difficulty clusters, replaying gives less than chaining, and it is what vLLM measures: on the
  SmolLM2 preset's draft, over vLLM's own 80 MT-Bench answers, chained 2.569, replayed 2.328,
  vLLM 2.321 (per position 0.624/0.409/0.295 against vLLM's 0.621/0.407/0.294; docs/BENCHMARKS.md).
"""

from __future__ import annotations

import torch

REPLAYED = "replayed_acceptance"


def per_position_acceptance(metrics: dict[str, float], k: int) -> list[float]:
    """Share of drafts whose positions 0..i are all accepted, greedy: prod_{j<=i} cond_acc_j
    (what vLLM's per-position acceptance counts: accepted at position i / drafts)."""
    out, survive = [], 1.0
    for i in range(k):
        survive *= metrics.get(f"cond_acc_{i}", 0.0)
        out.append(survive)
    return out


def simulated_acceptance_length(metrics: dict[str, float], k: int) -> float:
    """Expected tokens per verification step with k chained draft tokens, greedy: the bonus
    token plus each position's acceptance (vLLM's "mean acceptance length" counts the same way)."""
    return 1.0 + sum(per_position_acceptance(metrics, k))


def correct_drafts(draft_tokens: list[torch.Tensor], targets: torch.Tensor, loss_mask: torch.Tensor,
                   document_ids: torch.Tensor) -> torch.Tensor:
    """[k, T] bool: the draft starting at p is right at step j (its token equals targets[p + j] within
    the same document's answer; speculators' TTT alignment). Arguments as `replay_speculative_decoding`'s."""
    answer, docs, target = loss_mask[0].bool(), document_ids[0], targets[0]
    n = target.numel()
    correct = torch.zeros(len(draft_tokens), n, dtype=torch.bool, device=target.device)
    for j, tokens in enumerate(draft_tokens[:n]):
        correct[j, : n - j] = (tokens[0, : n - j] == target[j:]) & answer[j:] & (docs[j:] == docs[: n - j])
    return correct


def replayed_drafts(correct: torch.Tensor, loss_mask: torch.Tensor) -> list[tuple[int, int]]:
    """Greedy speculative decoding replayed over a packed batch: (start, accepted) for each draft it
    makes. A draft starts after the last verified token, its leading correct tokens are accepted, the
    verifier adds one token, and the next draft starts there."""
    leading_correct = torch.cumprod(correct.long(), dim=0).sum(dim=0).tolist()
    starts = loss_mask[0].bool().tolist()
    drafts, p = [], 0
    while p < len(starts):
        if starts[p]:
            drafts.append((p, leading_correct[p]))
            p += leading_correct[p] + 1
        else:
            p += 1
    return drafts


def replay_speculative_decoding(draft_tokens: list[torch.Tensor], targets: torch.Tensor, loss_mask: torch.Tensor,
                                document_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Counts of greedy speculative decoding replayed over a packed batch, as `_sum`/`_total` pairs
    (summed over batches and ranks like speculators' metrics): tokens per verification step, and per
    draft position the share of drafts accepted up to it.

    draft_tokens: k tensors [1, T], the draft's argmax at each TTT step (speculators' forward);
    targets: [1, T], the verifier's greedy token at each position, in the draft vocabulary;
    loss_mask: [1, T], the answer positions (drafts start there); document_ids: [1, T]."""
    k = len(draft_tokens)
    drafts = replayed_drafts(correct_drafts(draft_tokens, targets, loss_mask, document_ids), loss_mask)
    steps, tokens = len(drafts), sum(a + 1 for _, a in drafts)
    counts = {f"{REPLAYED}_length_sum": tokens, f"{REPLAYED}_length_total": steps}
    for i in range(k):
        counts |= {f"{REPLAYED}_{i}_sum": sum(a > i for _, a in drafts), f"{REPLAYED}_{i}_total": steps}
    # on the batch's device: they are summed and all-reduced with speculators' metrics
    return {name: torch.tensor(float(v), device=targets.device) for name, v in counts.items()}


def replayed_per_position(metrics: dict[str, float], k: int) -> list[float]:
    """Per draft position, the share of replayed drafts accepted up to it (vLLM's per-position
    acceptance); empty when the metrics hold no replay."""
    return [metrics[f"{REPLAYED}_{i}"] for i in range(k)] if f"{REPLAYED}_0" in metrics else []
