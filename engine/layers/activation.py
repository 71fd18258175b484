"""Activation layers."""

from __future__ import annotations

import torch
from torch import nn

from ...kernels import silu_and_mul


class SiluAndMul(nn.Module):
    """SwiGLU gate over a fused projection: ``[..., 2*I] = cat(gate, up) -> silu(gate) * up``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the gate."""
        return silu_and_mul(x)
