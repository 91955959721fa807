"""How hidden states are stored in shards (`extract.storage_dtype`): bf16 as computed, or fp8 e4m3
with a scale per token and layer, which halves the disk bill of offline training.

fp8_e4m3: each token's state at each stored layer is divided by its own scale, amax over the
hidden dimension / 448 (e4m3's largest finite value), and rounded to float8_e4m3fn; the scales go
next to it in the shard as `hidden_states_scale` [T, layers]. A per-token scale keeps every token,
whatever its norm (the first token's states are often 100x the others'), in e4m3's normal range:
the error is e4m3's 3-bit mantissa, at most 1/16 of a value, a few % of a token's norm.

The scales are float32: 16 bytes a token against 4 x hidden bytes of fp8 (0.1% more at hidden 4096,
0.7% at 576), and the dequantized value is then the e4m3 value times the exact scale; a bf16 scale
would save 8 bytes a token and add up to 0.4% of error of its own, the same for a whole token.

Readers get bf16 samples from either kind of shard (tasks/extract/shards.py `ShardReader`), the dtype bf16
shards hold, so training has one input format.
"""

from __future__ import annotations

import torch

STORAGE_DTYPES = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}
E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
SCALE_TENSOR = "hidden_states_scale"
SCALE_DTYPE = torch.float32


def bytes_per_token(storage_dtype: str, layers: int, hidden_size: int) -> int:
    """Bytes of hidden states (and their scales) one token takes in a shard."""
    if storage_dtype == "fp8_e4m3":
        return layers * hidden_size + layers * SCALE_DTYPE.itemsize
    return layers * hidden_size * STORAGE_DTYPES[storage_dtype].itemsize


def encode(states: torch.Tensor, storage_dtype: str) -> dict[str, torch.Tensor]:
    """The shard tensors for captured `states` [T, layers, H] (on their device): bf16 is the states
    themselves (cast when copied into the shard's buffer), fp8 the quantized states and scales."""
    if storage_dtype != "fp8_e4m3":
        return {"hidden_states": states}
    quantized, scales = quantize(states)
    return {"hidden_states": quantized, SCALE_TENSOR: scales}


def quantize(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn [..., H], float32 scales [...]): states ~= quantized * scales[..., None]."""
    amax = states.abs().amax(-1, keepdim=True).float()
    scales = torch.where(amax > 0, amax / E4M3_MAX, 1.0)  # an all-zero state stays zero, not 0/0
    # the clamp makes the largest value's rounding (x / scale can land a hair above 448) saturate
    # the same way on every device
    quantized = (states / scales).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return quantized, scales.squeeze(-1)


def dequantize(quantized: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return (quantized.float() * scales.unsqueeze(-1)).to(dtype)


def all_finite(tensors: dict[str, torch.Tensor]) -> bool:
    """No NaN or inf in a shard's states (and scales). e4m3fn has no inf and one NaN pattern per sign
    (exponent and mantissa all ones); checked on the bytes, without a float copy of the shard."""
    states = tensors["hidden_states"]
    if states.dtype == torch.float8_e4m3fn:
        nan = ((states.view(torch.uint8) & 0x7F) == 0x7F).any()
        return not bool(nan) and bool(torch.isfinite(tensors[SCALE_TENSOR]).all())
    return bool(torch.isfinite(states).all())
