"""RMSNorm layer, optionally fused with the residual add that precedes it.

A norm whose every reader is a W8A8 linear (``quantize_output``) returns its output quantized
per token as ``Int8Rows`` (``kernels/w8a8.rms_norm_quant``: one pass, no 16-bit normed row).
"""

from __future__ import annotations

import torch
from torch import nn

from ...kernels import add_rms_norm, rms_norm
from ...kernels.w8a8 import rms_norm_quant
from .w8a8_linear import Int8Rows


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale (Llama's ``LlamaRMSNorm``)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, quantize_output: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.quantize_output = quantize_output
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | Int8Rows | tuple[torch.Tensor | Int8Rows, torch.Tensor]:
        """``norm(x)``; with ``residual``, ``(norm(x + residual), x + residual)``."""
        if self.quantize_output:
            if residual is None:
                q, scale = rms_norm_quant(x, self.weight, self.eps)
                return Int8Rows(q, scale, x.dtype)
            q, scale, residual = rms_norm_quant(x, self.weight, self.eps, residual)
            return Int8Rows(q, scale, x.dtype), residual
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)
