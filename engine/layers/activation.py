"""Activation layers."""

from __future__ import annotations

import torch
from torch import nn

from ...kernels import silu_and_mul
from ...kernels.w8a8 import silu_mul_quant
from .w8a8_linear import Int8Rows


class SiluAndMul(nn.Module):
    """SwiGLU gate over a fused projection: ``[..., 2*I] = cat(gate, up) -> silu(gate) * up``.

    With ``quantize_output`` (its reader is a W8A8 down projection) the gated rows come out
    quantized per token as ``Int8Rows``, in the same pass (``kernels/w8a8.silu_mul_quant``).
    """

    def __init__(self, quantize_output: bool = False) -> None:
        super().__init__()
        self.quantize_output = quantize_output

    def forward(self, x: torch.Tensor) -> torch.Tensor | Int8Rows:
        """Apply the gate."""
        if self.quantize_output:
            q, scale = silu_mul_quant(x)
            return Int8Rows(q, scale, x.dtype)
        return silu_and_mul(x)
