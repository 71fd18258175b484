"""Rotary position embedding applied in place of q and k (rotate-half / NeoX layout, as HF Llama)."""

from __future__ import annotations

import torch


def apply_rotary_ref(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, H, D], k: [T, Hkv, D], positions: [T], cos_sin_cache: [max_pos, D] = cat(cos, sin) halves.

    Returns rotated (q, k) in the input dtype; the rotation itself is computed in float32.
    """
    half = cos_sin_cache.shape[-1] // 2
    cs = cos_sin_cache[positions.long()]
    cos = torch.cat([cs[:, :half], cs[:, :half]], dim=-1)[:, None, :]
    sin = torch.cat([cs[:, half:], cs[:, half:]], dim=-1)[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.float32)
        x1, x2 = xf[..., : xf.shape[-1] // 2], xf[..., xf.shape[-1] // 2 :]
        rotated = torch.cat([-x2, x1], dim=-1)
        return (xf * cos + rotated * sin).to(x.dtype)

    return rotate(q), rotate(k)


def apply_rotary(q, k, positions, cos_sin_cache):
    """Rotary embedding; the torch reference until the Triton path lands."""
    return apply_rotary_ref(q, k, positions, cos_sin_cache)
