"""Log-n query scaling ("logn attention"): queries at positions past the training length are
multiplied by ``log(p + 1) / log(train_length)``, which keeps the softmax's entropy from growing
as the context outgrows what the model was trained on (Qwen v1's ``use_logn_attn``).

The factor depends only on the query's own position, so it is exact under paged attention,
chunked prefill and decode alike; and since rotary is linear per position, scaling before or
after the rotation is the same.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def logn_factors(positions: torch.Tensor, train_length: int) -> torch.Tensor:
    """``[T]`` positions (0-based) -> ``[T]`` float32 factors: 1 up to ``train_length`` tokens,
    ``log_{train_length}(p + 1)`` past it."""
    count = positions.to(torch.float32) + 1
    return torch.where(count > train_length, torch.log(count) / math.log(train_length), torch.ones_like(count))


class LogNScale(nn.Module):
    """Scales ``[T, H, D]`` queries by their positions' log-n factors; holds no weights."""

    def __init__(self, train_length: int) -> None:
        super().__init__()
        if train_length < 2:
            raise ValueError(f"log-n scaling needs a training length of at least 2, got {train_length}")
        self.train_length = train_length

    def forward(self, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The factor is cast to the query's dtype before the product, as Qwen's code does."""
        return q * logn_factors(positions, self.train_length).to(q.dtype)[:, None, None]
