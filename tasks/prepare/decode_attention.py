"""An attention function for batched decoding with transformers: SDPA with grouped-query attention
folded into the query length, registered with transformers' attention interface.

Why: regeneration decodes left-padded rows, so every step carries a padding mask, and with a mask
transformers' SDPA path cannot use PyTorch's native GQA on CUDA: each layer copies its key/value
heads once per query head over the whole KV cache (`repeat_kv`) at every decoding step. For
SmolLM2 (3 KV heads, 9 query heads) that is three times the cache written and read again per step,
which measured ~68 ms per step where reading the cache once takes ~8 ms (docs/BENCHMARKS.md).

With one query token per row, the query heads that share a KV head can instead be stacked as
query positions: [rows, heads, 1, dim] becomes [rows, kv_heads, groups, dim], the mask is the same
for each of them, and the kernel reads each KV head once. The result is the same attention.
Prefill (several query tokens: causal within the prompt) and unmasked calls go to transformers'
own SDPA function unchanged.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "sdpa_folded_gqa"


def folded_gqa_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    rows, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    if attention_mask is None or q_len != 1 or heads == kv_heads:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    groups = heads // kv_heads
    # Query head h reads KV head h // groups (transformers' repeat_kv order), so a reshape groups them.
    folded = query.reshape(rows, kv_heads, groups, dim)
    mask = attention_mask.expand(attention_mask.shape[0], 1, groups, attention_mask.shape[-1])
    out = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=mask, dropout_p=dropout,
                                                           scale=scaling)
    return out.reshape(rows, heads, 1, dim).transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, folded_gqa_sdpa)
AttentionMaskInterface.register(NAME, sdpa_mask)
