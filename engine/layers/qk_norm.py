"""RMSNorm of the queries and keys before rotary (Qwen3, OLMo 2, and other families that add it).

Two shapes exist in Hugging Face's models:

- ``per_head`` (Qwen3, Gemma 3): one ``[head_dim]`` scale shared by every head, each head's
  vector normed on its own. Under tensor parallel every rank holds the whole scale.
- ``full`` (OLMo 2): one scale over the whole projection, ``[num_heads * head_dim]``, the
  mean taken across all heads. A rank holding some heads cannot compute that mean alone, so
  this shape runs only at tp=1 (the model refuses tp>1 before weights load).

The parameters are named ``q_norm.weight`` / ``k_norm.weight`` inside the attention module, as
in the checkpoints.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from ...kernels import rms_norm
from .norm import load_offset_scale

QK_NORM_SHAPES = ("per_head", "full")


class QKNorm(nn.Module):
    """RMSNorm of a ``[T, heads, head_dim]`` q or k, over each head or over all of them."""

    def __init__(self, shape: str, num_heads: int, head_dim: int, eps: float, weight_offset: float = 0.0) -> None:
        super().__init__()
        if shape not in QK_NORM_SHAPES:
            raise ValueError(f"q/k norm shape {shape!r}: use one of {QK_NORM_SHAPES}")
        self.shape, self.eps = shape, eps
        self.num_heads, self.head_dim = num_heads, head_dim
        width = head_dim if shape == "per_head" else num_heads * head_dim
        self.weight = nn.Parameter(torch.ones(width))
        if weight_offset:  # Gemma 3 stores ``scale - 1``: added back once, at load (as RMSNorm does)
            self.weight.weight_loader = partial(load_offset_scale, offset=weight_offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, heads, head_dim]`` -> the same shape, normed."""
        width = self.weight.shape[0]
        return rms_norm(x.reshape(-1, width), self.weight, self.eps).view(x.shape)
