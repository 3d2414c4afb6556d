"""Exact 32-bit integer hashing on torch tensors, the same numbers on every device.

Counter-based randomness (the sampler's noise) and digests computed where the data is (a
CUDA KV cache's checksum) need a hash that a CPU and a GPU compute bit for bit alike:
plain int64 tensor ops on values in [0, 2^32), arranged so that no product overflows the
signed 64-bit range (overflow is where devices may differ).
"""

from __future__ import annotations

import torch

M32 = 0xFFFFFFFF


def mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2^32 for x in [0, 2^32) held in int64, without signed overflow: the
    constant's top bit is applied as a shift (x << 31 < 2^63), the rest (< 2^31) as a product."""
    product = (x * (constant & 0x7FFFFFFF)) & M32
    if constant >> 31:
        product = (product + ((x << 31) & M32)) & M32
    return product


def hash32(x: torch.Tensor) -> torch.Tensor:
    """Chris Wellons' lowbias32 (hash-prospector): a bijection of [0, 2^32), on int64 tensors."""
    x = x ^ (x >> 16)
    x = mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = mul32(x, 0x846CA68B)
    return x ^ (x >> 16)
