"""vocab on real SmolLM2-tokenized ShareGPT samples: speculators' d2t/t2d layout, the most frequent
supervised tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tasks.prepare.dataset import load_prepared
from tasks.prepare.stage import prepare
from tasks.vocab import build_vocab, load_vocab, token_frequencies


@pytest.fixture(scope="module")
def data(smollm2, sharegpt, tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab-data")
    prepared = prepare(smollm2, [sharegpt], root, max_seq_len=128, max_rows=40)
    vocab = build_vocab(prepared.path, prepared.fingerprint, smollm2, root, draft_vocab_size=1024)
    return prepared, vocab


def test_vocab_mapping_round_trips(data, smollm2):
    prepared, vocab = data
    d2t, t2d = load_vocab(vocab.path, 49152)
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert d2t.numel() == int(t2d.sum()) == 1024
    targets = torch.arange(1024) + d2t  # target id = draft index + d2t[index]
    assert torch.equal(targets, torch.nonzero(t2d).flatten())
    counts = token_frequencies(load_prepared(prepared.path), 49152)
    most_frequent = np.argsort(-counts, kind="stable")[:200]
    assert t2d[torch.from_numpy(most_frequent)].all()  # the frequent assistant tokens are in
    assert vocab.coverage == pytest.approx(counts[t2d.numpy()].sum() / counts.sum(), abs=1e-6)


def test_vocab_is_capped_at_the_verifier_vocabulary(data, smollm2, tmp_path):
    prepared, _ = data
    result = build_vocab(prepared.path, prepared.fingerprint, smollm2, tmp_path, draft_vocab_size=10**6)
    assert result.draft_vocab_size == 49152 and result.coverage == 1.0
