"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / rms(x) * weight, computed in float32 like Hugging Face's LlamaRMSNorm."""
    dtype = x.dtype
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x; return (rms_norm(residual), residual)."""
    residual = x + residual
    return rms_norm_ref(residual, weight, eps), residual


def rms_norm(x, weight, eps):
    """RMSNorm; the torch reference until the Triton path lands."""
    return rms_norm_ref(x, weight, eps)


def add_rms_norm(x, residual, weight, eps):
    """Fused residual add + RMSNorm; the torch reference until the Triton path lands."""
    return add_rms_norm_ref(x, residual, weight, eps)
