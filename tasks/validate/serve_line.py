"""The one line that serves a draft: `vllm serve VERIFIER --speculative-config '{...}'` and its Python
form, with num_speculative_tokens (k) chosen from the acceptance vLLM measured.

What vLLM measures (tasks/validate/vllm_live.py): per draft position i, the share of drafts whose
first i tokens were all accepted (vLLM counts a draft's accepted tokens as a prefix). The chance
that token i is accepted once every token before it was is the ratio of successive shares; beyond
the positions measured, it is taken to stay at the last measured one. Then, for k draft tokens:

    expected tokens per verifier step E(k) = 1 + sum over i <= k of the product of those chances up to i

(the verifier's own token included; for the k measured this is 1 + the sum of the shares, vLLM's
mean acceptance length).

The cost model: a decoding step reads the weights once, whatever the handful of tokens it checks,
so verifying k draft tokens costs about one verifier step; each draft token costs one forward of
the draft, c verifier steps, with c the bytes of weights a draft step reads over a verifier step's
(the draft's token embedding left out: a lookup of a few rows). cost(k) = 1 + k c, and k in 1..5
maximizes E(k) / cost(k), the tokens per unit of verifier time. Where the verifier's weights are
not a local folder (a Hub id), c is taken as 0.05 (a 1-layer draft of a 32-layer model with its
fc and draft-vocabulary head: Llama-3.1-8B's is ~0.05).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

from tasks.common.hub import hub_snapshot

K_RANGE = range(1, 6)
DEFAULT_DRAFT_COST = 0.05
DEFAULT_K = 3  # without a measurement: validation's own num_speculative_tokens default
SKIPPED_DRAFT_WEIGHTS = ("embed_tokens",)


@dataclass(frozen=True)
class ServeLine:
    command: str  # the shell line: vllm serve VERIFIER --speculative-config '{...}'
    python: str  # the same as vLLM's Python API: LLM(model=..., speculative_config={...})
    k: int
    why: str  # one line: the k chosen and the figures for k = 1..5


def conditional_acceptance(per_position: list[float]) -> list[float]:
    """vLLM's per-position shares (first i tokens all accepted) as the chance that token i is
    accepted given every token before it was."""
    rates, before = [], 1.0
    for share in per_position:
        rates.append(min(1.0, share / before) if before > 0 else 0.0)
        before = share
    return rates


def expected_tokens(per_position: list[float], k: int) -> float:
    """Tokens a verifier step yields with k draft tokens (module docstring)."""
    rates = conditional_acceptance(per_position)
    total, all_accepted = 1.0, 1.0
    for i in range(k):
        all_accepted *= rates[min(i, len(rates) - 1)]
        total += all_accepted
    return total


def weight_bytes(folder: str | Path, skip: tuple[str, ...] = ()) -> int | None:
    """Bytes of the tensors in a folder's safetensors files (names containing any of `skip` left out),
    read from the files' headers; None where the folder holds none."""
    files = sorted(Path(folder).glob("*.safetensors")) if Path(folder).is_dir() else []
    if not files:
        return None
    total = 0
    for path in files:
        with path.open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        total += sum(t["data_offsets"][1] - t["data_offsets"][0] for name, t in header.items()
                     if name != "__metadata__" and not any(s in name for s in skip))
    return total


def draft_step_cost(verifier: str, draft: str) -> tuple[float, str]:
    """c, a draft token's cost in verifier steps, and how it was found."""
    verifier_bytes, draft_bytes = weight_bytes(verifier), weight_bytes(draft, SKIPPED_DRAFT_WEIGHTS)
    if not verifier_bytes or draft_bytes is None:
        return DEFAULT_DRAFT_COST, (f"each draft token {DEFAULT_DRAFT_COST} of a verifier step, assumed: the "
                                    "verifier's weights are not in a local folder")
    cost = draft_bytes / verifier_bytes
    return cost, (f"each draft token {cost:.3f} of a verifier step: {draft_bytes / 1e6:,.1f} MB of draft weights "
                  f"read against {verifier_bytes / 1e6:,.1f} MB")


def choose_k(verifier: str, draft: str, per_position: list[float]) -> tuple[int, str]:
    if not per_position:
        return DEFAULT_K, f"k={DEFAULT_K}: no per-position acceptance measured by vLLM, so validation's default"
    cost, how = draft_step_cost(verifier, draft)
    expected = {k: expected_tokens(per_position, k) for k in K_RANGE}
    per_cost = {k: expected[k] / (1 + k * cost) for k in K_RANGE}
    best = max(K_RANGE, key=lambda k: (per_cost[k], -k))  # a tie goes to the smaller k: less drafting work
    beyond = (f"; positions past the {len(per_position)} measured assume the last conditional acceptance, "
              f"{conditional_acceptance(per_position)[-1]:.3f}" if len(per_position) < max(K_RANGE) else "")
    why = (f"k={best}: expected tokens per verifier step {', '.join(f'{expected[k]:.2f}' for k in K_RANGE)} for "
           f"k=1..{max(K_RANGE)}; per unit of cost ({how}; verifying k tokens about one step) "
           f"{', '.join(f'{per_cost[k]:.2f}' for k in K_RANGE)}, highest at k={best}{beyond}")
    return best, why


def engine_arguments(model: str, draft: str | None, k: int, *, revision: str | None = None,
                     trust_remote_code: bool = False) -> dict:
    """vLLM's engine arguments serving `draft` with `model` (the verifier alone where `draft` is None): what
    the serve line's command and `LLM(...)` form say, and what validation's engines start with
    (tasks/validate/vllm_live.py), so that what validation measures is what the serve line serves."""
    arguments: dict = {"model": model}
    if revision:
        arguments["revision"] = revision
    if draft:
        # the explicit form: without "method", vLLM guesses it from the path
        arguments["speculative_config"] = {"model": draft, "num_speculative_tokens": k, "method": "eagle3"}
    if trust_remote_code:
        arguments["trust_remote_code"] = True
    return arguments


def serve_lines(verifier: str, draft: str, per_position: list[float], *, trust_remote_code: bool = False) -> ServeLine:
    """The `vllm serve` line and `LLM(...)` form serving `draft` (a speculators EAGLE-3 folder) with
    `verifier` (a folder or Hub id), k chosen from vLLM's per-position acceptance (may be empty)."""
    k, why = choose_k(verifier, draft, per_position)
    snapshot = hub_snapshot(verifier)  # a Hub id's snapshot folder: served by its id, pinned to that commit
    arguments = engine_arguments(snapshot.repo_id if snapshot else verifier, draft, k,
                                 revision=snapshot.commit if snapshot else None, trust_remote_code=trust_remote_code)
    # `vllm serve MODEL --name value ...`: vLLM's flag for each engine argument is its name with dashes
    args = ["vllm", "serve", arguments["model"]]
    for name, value in list(arguments.items())[1:]:
        flag = "--" + name.replace("_", "-")
        args += [flag] if value is True else [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    keywords = ", ".join(f"{name}={value!r}" for name, value in arguments.items())
    return ServeLine(command=shlex.join(args), python=f"LLM({keywords})", k=k, why=why)
