"""Rotary position embedding for q and k (rotate-half / NeoX layout, as HF Llama); returns new tensors."""

# No ``from __future__ import annotations``: Triton reads ``tl.constexpr`` annotations as objects.

import torch

from conveyor.kernels._triton import FLOAT_DTYPES, forced_triton, next_pow2, tl, jit, use_triton


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


@jit
def _rotary_kernel(
    q_ptr, k_ptr, pos_ptr, cs_ptr, q_out_ptr, k_out_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh, stride_cs,
    num_q_heads, num_kv_heads,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
):
    # Grid: (T,); one program rotates every q and k head of one token, so cos/sin are read once.
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    d_mask = d < HALF
    cos = tl.load(cs_ptr + pos * stride_cs + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]

    # out1 = x1*cos - x2*sin, out2 = x2*cos + x1*sin: the reference's x*cos + rotate_half(x)*sin.
    hq = tl.arange(0, BLOCK_HQ)
    mask = (hq[:, None] < num_q_heads) & d_mask[None, :]
    src = q_ptr + t * stride_qt + hq[:, None] * stride_qh + d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = q_out_ptr + t * stride_qot + hq[:, None] * stride_qoh + d[None, :]
    tl.store(dst, (x1 * cos - x2 * sin).to(q_out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(q_out_ptr.dtype.element_ty), mask=mask)

    hk = tl.arange(0, BLOCK_HK)
    mask = (hk[:, None] < num_kv_heads) & d_mask[None, :]
    src = k_ptr + t * stride_kt + hk[:, None] * stride_kh + d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = k_out_ptr + t * stride_kot + hk[:, None] * stride_koh + d[None, :]
    tl.store(dst, (x1 * cos - x2 * sin).to(k_out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(k_out_ptr.dtype.element_ty), mask=mask)


def apply_rotary_triton(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher for :func:`apply_rotary_ref`; q/k may be strided views (e.g. of a fused qkv)."""
    assert q.dim() == 3 and k.dim() == 3 and q.shape[0] == k.shape[0] == positions.shape[0], "q [T,H,D], k [T,Hkv,D]"
    head_dim = q.shape[-1]
    assert k.shape[-1] == head_dim and head_dim % 2 == 0, "q and k share an even head_dim"
    assert cos_sin_cache.dim() == 2 and cos_sin_cache.shape[-1] == head_dim, "cos_sin_cache must be [max_pos, D]"
    assert q.dtype in FLOAT_DTYPES and k.dtype in FLOAT_DTYPES, f"unsupported dtypes {q.dtype}, {k.dtype}"
    assert not positions.dtype.is_floating_point, "positions must be integers"
    assert q.device == k.device == positions.device == cos_sin_cache.device, "tensors on different devices"
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    cs = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    num_tokens = q.shape[0]
    if num_tokens:
        half = head_dim // 2
        block_half = next_pow2(half)
        block_hq, block_hk = next_pow2(q.shape[1]), next_pow2(k.shape[1])
        num_warps = 4 if block_hq * block_half <= 4096 else 8
        _rotary_kernel[(num_tokens,)](
            q, k, positions, cs, q_out, k_out,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cs.stride(0),
            q.shape[1], k.shape[1],
            HALF=half, BLOCK_HALF=block_half, BLOCK_HQ=block_hq, BLOCK_HK=block_hk, num_warps=num_warps,
        )
    return q_out, k_out


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, H, D] and k [T, Hkv, D] by ``positions`` [T]: Triton on CUDA, else the reference.

    Returns new (q, k) tensors in the inputs' dtypes; the inputs are left untouched.
    """
    if use_triton(q, k):
        supported = (
            q.dim() == 3 and k.dim() == 3 and q.dtype in FLOAT_DTYPES and k.dtype in FLOAT_DTYPES
            and q.shape[-1] == k.shape[-1] == cos_sin_cache.shape[-1] and q.shape[-1] % 2 == 0
        )
        if supported:
            return apply_rotary_triton(q, k, positions, cos_sin_cache)
        if forced_triton():
            raise ValueError(f"apply_rotary Triton kernel does not support q {tuple(q.shape)} {q.dtype}")
    return apply_rotary_ref(q, k, positions, cos_sin_cache)
