"""SiLU-and-multiply: the gate of a SwiGLU MLP over a fused [gate | up] projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2*I] = cat(gate, up) -> silu(gate) * up: [..., I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x):
    """SiLU-and-multiply; the torch reference until the Triton path lands."""
    return silu_and_mul_ref(x)
