"""Rotary position embedding for q and k (rotate-half / NeoX layout, as HF Llama); returns new tensors.

The rotation (``load_cos_sin`` and ``rotate_heads``) and the launch shape (``rotary_launch``)
also serve the fused rotary + cache store of ``kv_cache.py``: one rotation, written once, is
what makes that kernel write the same bits as this one followed by the store.
"""

# No ``from __future__ import annotations``: Triton reads ``tl.constexpr`` annotations as objects.

import torch

from ._triton import FLOAT_DTYPES, next_pow2, tl, jit, triton_takes


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
def load_cos_sin(pos_ptr, cs_ptr, t, stride_cs, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Token ``t``'s half-dim offsets ``d`` [BLOCK_HALF] and their mask, and its cos and sin as
    float32 [1, BLOCK_HALF] rows of ``cos_sin_cache``."""
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    d_mask = d < HALF
    cos = tl.load(cs_ptr + pos * stride_cs + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    return d, d_mask, cos, sin


@jit
def rotated_halves(
    src_ptr, stride_src_h, num_heads, d, d_mask, cos, sin, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Heads ``[0, num_heads)`` of one token (from ``src_ptr``, its first head; heads
    ``stride_src_h`` apart) rotated with ``load_cos_sin``'s d, cos, sin: the two halves
    [BLOCK_H, BLOCK_HALF] (dims ``d`` and ``HALF + d``) in the source's dtype, and their mask."""
    h = tl.arange(0, BLOCK_H)
    mask = (h[:, None] < num_heads) & d_mask[None, :]
    src = src_ptr + h[:, None] * stride_src_h + d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    # out1 = x1*cos - x2*sin, out2 = x2*cos + x1*sin: the reference's x*cos + rotate_half(x)*sin,
    # rounded to the source's dtype as the reference's result is.
    ty = src_ptr.dtype.element_ty
    return (x1 * cos - x2 * sin).to(ty), (x2 * cos + x1 * sin).to(ty), mask


@jit
def rotate_heads(
    src_ptr, dst_ptr, stride_src_h, stride_dst_h, num_heads, d, d_mask, cos, sin,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Rotate heads ``[0, num_heads)`` of one token: from ``src_ptr`` (its first head; heads
    ``stride_src_h`` apart) into ``dst_ptr`` (likewise), with ``load_cos_sin``'s d, cos, sin."""
    r1, r2, mask = rotated_halves(src_ptr, stride_src_h, num_heads, d, d_mask, cos, sin, HALF, BLOCK_H)
    dst = dst_ptr + tl.arange(0, BLOCK_H)[:, None] * stride_dst_h + d[None, :]
    # Rounded to the source's dtype first, as rotary then a store into dst would (a no-op cast
    # when the two dtypes agree): a cache of another dtype still gets the two kernels' bits.
    out_ty = dst_ptr.dtype.element_ty
    tl.store(dst, r1.to(out_ty), mask=mask)
    tl.store(dst + HALF, r2.to(out_ty), mask=mask)


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
    d, d_mask, cos, sin = load_cos_sin(pos_ptr, cs_ptr, t, stride_cs, HALF, BLOCK_HALF)
    rotate_heads(q_ptr + t * stride_qt, q_out_ptr + t * stride_qot, stride_qh, stride_qoh, num_q_heads,
                 d, d_mask, cos, sin, HALF, BLOCK_HQ)
    rotate_heads(k_ptr + t * stride_kt, k_out_ptr + t * stride_kot, stride_kh, stride_koh, num_kv_heads,
                 d, d_mask, cos, sin, HALF, BLOCK_HK)


def rotary_problem(q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor) -> str | None:
    """Why the rotary kernels cannot take q and k, or None when they can."""
    supported = (
        q.dim() == 3 and k.dim() == 3 and q.dtype in FLOAT_DTYPES and k.dtype in FLOAT_DTYPES
        and q.shape[-1] == k.shape[-1] == cos_sin_cache.shape[-1] and q.shape[-1] % 2 == 0
    )
    return None if supported else f"q {tuple(q.shape)} {q.dtype}"


def rotary_launch(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, int, int, int], int]:
    """Checks and launch shape shared by the rotary kernels: q, k and cos_sin_cache with a unit
    stride along head_dim, the constexprs (HALF, BLOCK_HALF, BLOCK_HQ, BLOCK_HK) and num_warps.

    The constexprs go positionally, like the kernels' other arguments: no keyword dict to build
    at every launch (the host's launch cost is the latency at batch 1)."""
    assert q.dim() == 3 and k.dim() == 3 and q.shape[0] == k.shape[0] == positions.shape[0], "q [T,H,D], k [T,Hkv,D]"
    head_dim = q.shape[-1]
    assert k.shape[-1] == head_dim and head_dim % 2 == 0, "q and k share an even head_dim"
    assert cos_sin_cache.dim() == 2 and cos_sin_cache.shape[-1] == head_dim, "cos_sin_cache must be [max_pos, D]"
    assert q.dtype in FLOAT_DTYPES and k.dtype in FLOAT_DTYPES, f"unsupported dtypes {q.dtype}, {k.dtype}"
    assert not positions.dtype.is_floating_point, "positions must be integers"
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    cs = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    half = head_dim // 2
    block_half = next_pow2(half)
    block_hq = next_pow2(q.shape[1])
    num_warps = 4 if block_hq * block_half <= 4096 else 8
    return q, k, cs, (half, block_half, block_hq, next_pow2(k.shape[1])), num_warps


def apply_rotary_triton(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher for :func:`apply_rotary_ref`; q/k may be strided views (e.g. of a fused qkv)."""
    assert q.device == k.device == positions.device == cos_sin_cache.device, "tensors on different devices"
    q, k, cs, constexprs, num_warps = rotary_launch(q, k, positions, cos_sin_cache)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if q.shape[0]:
        _rotary_kernel[(q.shape[0],)](
            q, k, positions, cs, q_out, k_out,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cs.stride(0),
            q.shape[1], k.shape[1], *constexprs, num_warps=num_warps,
        )
    return q_out, k_out


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, H, D] and k [T, Hkv, D] by ``positions`` [T]: Triton on CUDA, else the reference.

    Returns new (q, k) tensors in the inputs' dtypes; the inputs are left untouched.
    """
    if triton_takes("apply_rotary", (q, k), rotary_problem, q, k, cos_sin_cache):
        return apply_rotary_triton(q, k, positions, cos_sin_cache)
    return apply_rotary_ref(q, k, positions, cos_sin_cache)
