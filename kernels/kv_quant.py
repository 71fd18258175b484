"""Quantizing KV head vectors for the cache and reading them back (``kv_cache.py``'s module doc
says the scheme: per token and head, asymmetric, fp16 (scale, zero), int4 codes in two halves):
the torch reference and the Triton helpers the store kernels use."""

# No ``from __future__ import annotations``: Triton reads ``tl.constexpr`` annotations as objects.

import torch

from ._triton import jit, tl
from .kv_layout import SCALE_DTYPE

_FP16_MAX = 65504.0


def cache_bits(cache: torch.Tensor, head_dim: int) -> int:
    """The bits of a cache's codes for heads of ``head_dim``: 0 (a float cache), 8 or 4."""
    if cache.dtype != torch.uint8:
        return 0
    if cache.shape[-1] == head_dim:
        return 8
    if cache.shape[-1] * 2 == head_dim:
        return 4
    raise ValueError(f"uint8 cache with last dimension {cache.shape[-1]} for head_dim {head_dim}")


def quantize_kv_ref(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-vector asymmetric quantization of x [..., D] (the module doc): codes uint8 [..., D]
    (int8) or [..., D // 2] (int4, halves in the low and high nibbles) and (scale, zero) fp16 [..., 2]."""
    assert bits in (4, 8) and x.shape[-1] % 2 == 0
    xf = x.to(torch.float32)
    lo = xf.amin(-1).clamp(-_FP16_MAX, _FP16_MAX)
    hi = xf.amax(-1).clamp(-_FP16_MAX, _FP16_MAX)
    qmax = (1 << bits) - 1
    scale = ((hi - lo) / qmax).to(SCALE_DTYPE).to(torch.float32)
    zero = lo.to(SCALE_DTYPE).to(torch.float32)
    div = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.floor((xf - zero[..., None]) / div[..., None] + 0.5).clamp(0, qmax).to(torch.uint8)
    if bits == 4:
        half = x.shape[-1] // 2
        codes = codes[..., :half] | (codes[..., half:] << 4)
    return codes, torch.stack([scale, zero], dim=-1).to(SCALE_DTYPE)


def dequantize_kv_ref(codes: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    """float32 [..., D] from ``quantize_kv_ref``'s codes and scales."""
    if bits == 4:
        codes = torch.cat([codes & 0xF, codes >> 4], dim=-1)
    s = scales.to(torch.float32)
    return codes.to(torch.float32) * s[..., 0:1] + s[..., 1:2]


@jit
def _quantize(x1, x2, mask, BITS: tl.constexpr):
    """``quantize_kv_ref`` of heads given as halves x1, x2 [rows, BLOCK_HALF] (valid where
    ``mask``): the codes of each half (float32), (scale, zero) per row (fp16) and the rows with
    any valid dim."""
    h_mask = tl.max(mask.to(tl.int32), 1) > 0
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    lo = tl.minimum(tl.min(tl.where(mask, a, float("inf")), 1), tl.min(tl.where(mask, b, float("inf")), 1))
    hi = tl.maximum(tl.max(tl.where(mask, a, float("-inf")), 1), tl.max(tl.where(mask, b, float("-inf")), 1))
    lo = tl.where(h_mask, tl.minimum(tl.maximum(lo, -65504.0), 65504.0), 0.0)
    hi = tl.where(h_mask, tl.minimum(tl.maximum(hi, -65504.0), 65504.0), 0.0)
    QMAX: tl.constexpr = (1 << BITS) - 1
    scale = ((hi - lo) / QMAX).to(tl.float16)
    zero = lo.to(tl.float16)
    s = scale.to(tl.float32)
    z = zero.to(tl.float32)
    div = tl.where(s > 0, s, 1.0)
    q1 = tl.minimum(tl.maximum(tl.floor((a - z[:, None]) / div[:, None] + 0.5), 0.0), QMAX)
    q2 = tl.minimum(tl.maximum(tl.floor((b - z[:, None]) / div[:, None] + 0.5), 0.0), QMAX)
    return q1, q2, scale, zero, h_mask


@jit
def _quantize_store(x1, x2, mask, dst_ptr, sz_ptr, stride_dst_h, stride_sz_h, d,
                    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BITS: tl.constexpr):
    """Quantize heads given as halves x1, x2 [BLOCK_H, BLOCK_HALF] (dims ``d`` and ``HALF + d``,
    valid where ``mask``) as ``quantize_kv_ref`` does, and store codes at ``dst_ptr`` and (scale,
    zero) at ``sz_ptr`` (the token's first head; heads ``stride_*_h`` apart)."""
    h = tl.arange(0, BLOCK_H)
    q1, q2, scale, zero, h_mask = _quantize(x1, x2, mask, BITS)
    q1 = q1.to(tl.uint8)
    q2 = q2.to(tl.uint8)
    dst = dst_ptr + h[:, None] * stride_dst_h + d[None, :]
    if BITS == 8:
        tl.store(dst, q1, mask=mask)
        tl.store(dst + HALF, q2, mask=mask)
    else:
        tl.store(dst, q1 | (q2 << 4), mask=mask)
    sz = sz_ptr + h * stride_sz_h
    tl.store(sz, scale, mask=h_mask)
    tl.store(sz + 1, zero, mask=h_mask)
