"""The training targets, checked against the verifier's own final norm and head.

speculators trains the draft toward `verifier_lm_head(verifier_norm(h))`, where `h` is the verifier's
last hidden state (before its final norm), `verifier_norm` is a Llama RMSNorm (weight * x) and the
head is a plain linear layer, both filled with tensors speculators finds by name in the checkpoint.
That is right for Llama-like verifiers and silently wrong for others: Gemma's norm is (1 + weight)
* x, a multimodal wrapper's checkpoint holds several `*norm.weight` tensors, a head may scale its
logits. Training on wrong targets gives a draft that vLLM rejects token after token.

So before the first step, on a few extracted positions, the targets are compared with what the
verifier's own modules compute: its final norm and output head, built by transformers from its
config and filled with its checkpoint's tensors (found under the language model's prefix), and the
logit transformations its config declares. Where they differ, the draft's frozen copies are made to
agree without patching any library: a norm of the form scale * x / rms(x) (Gemma's (1 + weight)
included) becomes the equivalent weight, the head becomes the verifier's own rows, a logit scale is
folded into the head. What cannot be made to agree (another norm form, logit soft-capping that moves
the distribution) is refused, naming the architecture.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field

import torch

from tasks.common.errors import PermanentError
from tasks.common.verifier import (
    VerifierInfo,
    checkpoint_keys,
    read_config,
    read_tensors,
    text_config,
    transformers_text_config,
)

log = logging.getLogger(__name__)

MIN_TOP1_AGREEMENT = 0.999
MAX_KL_NATS = 1e-3


class TargetMismatch(PermanentError, ValueError):
    """The draft's training targets cannot be made to match the verifier's own logits."""


@dataclass
class TargetCheck:
    positions: int
    top1_agreement: float  # argmax over the draft vocabulary: speculators' targets vs the verifier's logits
    kl_nats: float  # mean KL(verifier || targets) over the draft vocabulary
    adapted: list[str] = field(default_factory=list)  # what was replaced to make them agree
    before: dict | None = None  # top1_agreement and kl_nats before adapting, when something was

    def describe(self) -> str:
        text = (f"training targets vs the verifier's own norm and head on {self.positions} positions: top-1 "
                f"agreement {100 * self.top1_agreement:.2f}%, KL {self.kl_nats:.2e} nats")
        if self.adapted:
            text += (f" (before adapting: {100 * self.before['top1_agreement']:.2f}%, KL {self.before['kl_nats']:.2e};"
                     f" adapted: {'; '.join(self.adapted)})")
        return text

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class VerifierHead:
    """The verifier's own final norm and output head (full vocabulary), and what its forward does to
    the logits after the head."""

    norm: torch.nn.Module
    weight: torch.Tensor  # [vocab, hidden]
    logit_scale: float = 1.0
    softcap: float | None = None

    def logits(self, hidden: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        weight = self.weight if rows is None else self.weight[rows]
        logits = self.norm(hidden.float()).float() @ weight.float().T * self.logit_scale
        if self.softcap:
            logits = self.softcap * torch.tanh(logits / self.softcap)
        return logits


def decoder_prefix(keys: list[str]) -> str:
    """Where the checkpoint keeps the language model's decoder ('model.', 'language_model.model.',
    'model.language_model.', ...): the prefix of its token embedding."""
    embeds = sorted((k for k in keys if k.endswith("embed_tokens.weight")), key=len)
    if not embeds:
        raise TargetMismatch("the verifier's checkpoint has no '*embed_tokens.weight' tensor")
    return embeds[0].removesuffix("embed_tokens.weight")


def load_verifier_head(verifier: VerifierInfo, trust_remote_code: bool) -> VerifierHead:
    """The final norm module transformers builds for the verifier's language model, with its
    checkpoint tensors; the head's weight (the embedding when tied); the logit transformations."""
    from transformers import AutoModelForCausalLM

    lm, _ = text_config(read_config(verifier.path))
    config = transformers_text_config(verifier.path, trust_remote_code)
    config.num_hidden_layers = 1  # only the norm and head are used: no need to build every layer
    for key in ("layer_types", "mlp_only_layers"):
        if isinstance(getattr(config, key, None), list):
            setattr(config, key, getattr(config, key)[:1])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    norm = model.get_decoder().norm.to_empty(device="cpu")
    keys = checkpoint_keys(verifier)
    prefix = decoder_prefix(keys)
    heads = sorted((k for k in keys if k.endswith("lm_head.weight")), key=len)
    names = {f"norm.{n}": f"{prefix}norm.{n}" for n, _ in norm.named_parameters()}
    names["head"] = heads[0] if heads else f"{prefix}embed_tokens.weight"  # no head of its own: tied
    tensors = read_tensors(verifier, names)
    norm.load_state_dict({n.removeprefix("norm."): t for n, t in tensors.items() if n != "head"})
    scale = float(lm.get("logit_scale") or 1.0) / float(lm.get("logits_scaling") or 1.0)
    return VerifierHead(norm.float().eval(), tensors["head"], scale, lm.get("final_logit_softcapping"))


def compare(targets: torch.Tensor, reference: torch.Tensor) -> dict:
    """Top-1 agreement and mean KL(reference || targets) of two [positions, vocab] logit tensors."""
    agreement = (targets.argmax(-1) == reference.argmax(-1)).float().mean().item()
    kl = torch.nn.functional.kl_div(targets.log_softmax(-1), reference.log_softmax(-1), log_target=True,
                                    reduction="batchmean").item()
    return {"top1_agreement": round(agreement, 6), "kl_nats": max(kl, 0.0)}


def rms_scale(norm: torch.nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, float] | None:
    """The per-channel weight w for which `norm(x) == w * x / rms(x)` on these states, with the
    norm's epsilon, or None when the norm is not of that form (e.g. it subtracts the mean)."""
    eps = getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", None) or 1e-6
    x = hidden.float()
    unit = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    y = norm(x).float()
    weight = (y * unit).sum(0) / unit.pow(2).sum(0).clamp_min(1e-12)  # least squares per channel
    residual = (y - weight * unit).abs().max() / y.abs().max().clamp_min(1e-12)
    return (weight, eps) if residual < 1e-3 else None


def last_states(dataset, positions: int = 256) -> torch.Tensor:
    """The verifier's last-layer states of the first `positions` tokens of `dataset` (ShardDataset)."""
    states, total, i = [], 0, 0
    while total < positions and i < len(dataset):
        states.append(dataset[i]["verifier_last_hidden_states"][: positions - total])
        total += len(states[-1])
        i += 1
    return torch.cat(states)


def targets_of(model, hidden: torch.Tensor) -> torch.Tensor:
    """What speculators trains toward, computed by the draft's own frozen modules (float32)."""
    device = model.verifier_lm_head.weight.device
    with torch.no_grad():
        return model.verifier_lm_head(model.verifier_norm(hidden.float().to(device))).float().cpu()


@torch.no_grad()
def check_targets(model, verifier: VerifierInfo, hidden: torch.Tensor, trust_remote_code: bool = False) -> TargetCheck:
    """Compare speculators' training targets on `hidden` ([positions, H], the verifier's last layer
    before its norm) with the verifier's own logits over the draft vocabulary; make the draft's
    frozen norm and head agree where they do not; raise TargetMismatch when they cannot."""
    head = load_verifier_head(verifier, trust_remote_code)
    rows = model.t2d.bool().cpu() if getattr(model, "t2d", None) is not None else None
    hidden = hidden.cpu()  # float32 throughout: the check compares the math, not the precision
    saved = {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith(("verifier_", "lm_head"))}
    reference = head.logits(hidden, rows)
    before = compare(targets_of(model, hidden), reference)
    adapted = [] if agrees(before) else adapt(model, head, hidden, rows, verifier)
    after = compare(targets_of(model, hidden), reference) if adapted else before
    result = TargetCheck(len(hidden), after["top1_agreement"], after["kl_nats"], adapted,
                         before if adapted else None)
    if not agrees(after):
        for n, p in model.named_parameters():  # leave the model as speculators built it
            if n in saved:
                p.copy_(saved[n])
        raise TargetMismatch(
            f"{verifier.architecture} ({verifier.path}): the draft would train on targets that are not the "
            f"verifier's: {result.describe()}; the verifier's final norm or logits are of a form speculators' "
            "EAGLE-3 targets cannot express")
    return result


def agrees(metrics: dict) -> bool:
    return metrics["top1_agreement"] >= MIN_TOP1_AGREEMENT and metrics["kl_nats"] <= MAX_KL_NATS


def adapt(model, head: VerifierHead, hidden: torch.Tensor, rows: torch.Tensor | None,
          verifier: VerifierInfo) -> list[str]:
    """Replace the draft's frozen verifier norm and heads by what makes them the verifier's own."""
    adapted = []
    fitted = rms_scale(head.norm, hidden)
    if fitted is not None:
        weight, eps = fitted
        if not torch.allclose(model.verifier_norm.weight.float().cpu(), weight, rtol=1e-3, atol=1e-5):
            model.verifier_norm.weight.copy_(weight.to(model.verifier_norm.weight))
            adapted.append(f"verifier_norm: the weight equivalent to {type(head.norm).__name__}")
        model.verifier_norm.variance_epsilon = eps
    own = (head.weight if rows is None else head.weight[rows]).float() * head.logit_scale
    for name in ("verifier_lm_head", "lm_head"):
        layer = getattr(model, name)
        if not torch.allclose(layer.weight.float().cpu(), own, rtol=1e-3, atol=1e-5):
            layer.weight.copy_(own.to(layer.weight))
            adapted.append(f"{name}: the verifier's own output head"
                           + (f" with its logit scale {head.logit_scale:g}" if head.logit_scale != 1 else ""))
    log.info("%s: adapted the draft's frozen copies of the verifier: %s", verifier.architecture,
             "; ".join(adapted) or "nothing")
    return adapted
