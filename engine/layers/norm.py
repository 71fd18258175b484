"""RMSNorm layer, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
from torch import nn

from ...kernels import add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale (Llama's ``LlamaRMSNorm``)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``; with ``residual``, ``(norm(x + residual), x + residual)``."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)
