"""LayerNorm (mean and variance, learned scale and optional bias), with the residual add the
decoder blocks fuse into their norms (the same ``(hidden, residual)`` convention as RMSNorm's).

StarCoder2 and Falcon normalise this way. It runs as torch's ``layer_norm`` on every device:
one pass per call, no kernel of its own; a W8A8 hand-over (int8 rows out of the norm) is not
offered, so the families built on it refuse W8A8 checkpoints.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LayerNorm(nn.Module):
    """``(x - mean) / sqrt(var + eps) * weight (+ bias)`` over the last dim, as ``nn.LayerNorm``."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size)) if bias else None

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``; with ``residual``, ``(norm(x + residual), x + residual)``."""
        if residual is not None:
            x = x + residual
            return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps), x
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)
