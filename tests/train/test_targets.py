"""The training targets against the verifier's own final norm and head (tasks/train/targets.py), on
tiny random verifiers of the families the matrix builds (tests/verifiers/families.py)."""

from __future__ import annotations

import pytest
import torch
from verifiers.families import BY_NAME, build

from tasks.common.verifier import inspect_verifier
from tasks.train.job import TrainJob
from tasks.train.model import build_draft
from tasks.train.targets import TargetMismatch, check_targets


def draft_and_states(verifier, draft_vocab: int = 512, seed: int = 0):
    """speculators' draft for `verifier` over a random draft vocabulary, and last-layer states to
    check it on (random, at a norm's typical scale)."""
    info = inspect_verifier(verifier)
    generator = torch.Generator().manual_seed(seed)
    t2d = torch.zeros(info.vocab_size, dtype=torch.bool)
    t2d[torch.randperm(info.vocab_size, generator=generator)[:draft_vocab]] = True
    d2t = torch.nonzero(t2d).flatten() - torch.arange(draft_vocab)
    job = TrainJob("-", "-", "-", str(verifier), "-", [1, 2, 3], settings={"num_layers": 1, "total_seq_len": 256})
    model = build_draft(job, d2t, t2d, draft_vocab, torch.device("cpu"))
    return info, model, 3 * torch.randn(256, info.hidden_size, generator=generator)


@pytest.fixture(scope="module")
def gemma3(smollm2, tmp_path_factory):
    return build(BY_NAME["gemma3"], smollm2, tmp_path_factory.mktemp("gemma3"))


def test_a_one_plus_weight_norm_is_made_to_agree_with_the_verifiers_own_logits(gemma3):
    info, model, states = draft_and_states(gemma3)
    check = check_targets(model, info, states)
    assert check.before["top1_agreement"] < 0.5  # speculators' weight * x against Gemma's (1 + weight) * x
    assert check.top1_agreement >= 0.999 and check.kl_nats <= 1e-3
    assert check.adapted == ["verifier_norm: the weight equivalent to Gemma3RMSNorm"]
    again = check_targets(model, info, states)  # the draft keeps the agreeing weights: nothing more to adapt
    assert again.adapted == [] and again.top1_agreement >= 0.999


def test_a_llama_verifiers_targets_are_left_as_speculators_builds_them(smollm2):
    info, model, states = draft_and_states(smollm2)
    before = {n: p.clone() for n, p in model.named_parameters()}
    check = check_targets(model, info, states)
    assert check.adapted == [] and check.top1_agreement == 1.0 and check.kl_nats < 1e-6
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_logits_the_targets_cannot_express_are_refused_naming_the_architecture(gemma3, tmp_path):
    """Gemma-2-style final logit soft-capping squeezes the verifier's distribution; speculators'
    targets are the plain head's logits, and no weight makes a tanh linear."""
    import json
    import shutil

    capped = tmp_path / "capped"
    shutil.copytree(gemma3, capped)
    config = json.loads((capped / "config.json").read_text())
    (capped / "config.json").write_text(json.dumps({**config, "final_logit_softcapping": 0.5}))
    info, model, states = draft_and_states(capped)
    kept = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(TargetMismatch, match="Gemma3ForCausalLM") as refused:
        check_targets(model, info, states)
    assert "KL" in str(refused.value)
    assert all(torch.equal(p, kept[n]) for n, p in model.named_parameters())  # left as speculators built it
