"""Content keys: what identifies a piece of work by its bytes, not by where it sits in the data.

A sample's key is the xxh3-128 of its token ids (int32): the same conversation, tokenized the
same way, has the same key wherever it falls in source order and in whatever file it came, so
work done for it once (its hidden states, its membership of a draft's training data) is found
again by content.
"""

from __future__ import annotations

import numpy as np
import xxhash


def sample_key(input_ids) -> str:
    """The content key of one sample's token ids (a sequence of ints, or an integer array)."""
    return xxhash.xxh3_128_hexdigest(np.asarray(input_ids, dtype=np.int32).tobytes())
