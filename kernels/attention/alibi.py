"""ALiBi's per-head slopes (Press et al., "Train Short, Test Long"): the attention kernels add
``slope_h * (k - p)`` to head h's score of key k from the query at position p (``paged_attention``'s
``alibi_slopes``)."""

import math

import torch


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """The slopes of ``num_heads`` heads, fp32 [num_heads] on the CPU, as BLOOM, Baichuan-13B and
    Falcon-RW compute them: for the largest power of two ``p <= num_heads``, the geometric series
    ``2^(-8 i / p)``, i = 1..p; past it (num_heads not a power of two), the series of ``2p`` heads
    taken at its odd terms, ``2^(-4 k / p)`` for k = 1, 3, 5, ..., which interleave with the first.
    A tensor-parallel model passes each rank the slice of its own heads."""
    if num_heads < 1:
        raise ValueError(f"num_heads {num_heads} must be >= 1")
    p = 1 << (num_heads.bit_length() - 1)
    slopes = [2.0 ** (-8.0 * i / p) for i in range(1, p + 1)]
    slopes += [2.0 ** (-4.0 * k / p) for k in range(1, 2 * (num_heads - p), 2)]
    assert len(slopes) == num_heads and math.isfinite(slopes[-1])
    return torch.tensor(slopes, dtype=torch.float32)
