"""Writing new keys and values into the paged KV cache (where KV quantization will live).

Two entry points: ``store_kv`` writes already-rotated keys; ``rotate_and_store_kv`` applies the
rotary embedding to q and k and writes k and v in the same kernel (one launch per layer fewer
than rotary then store: at batch 1 each launch is latency, and a long prefill is launched kernel
by kernel, so launches cost host time too). Its rotation is ``rotary.py``'s own.
"""

# No ``from __future__ import annotations``: Triton reads ``tl.constexpr`` annotations as objects.

import torch

from ._triton import FLOAT_DTYPES, next_pow2, tl, jit, triton_takes
from .rotary import apply_rotary_ref, load_cos_sin, rotary_launch, rotary_problem, rotate_heads


def store_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter k, v [T, Hkv, D] into caches [num_blocks, block_size, Hkv, D] at flat slots [T].

    A slot is ``block_id * block_size + offset``; a negative slot means "do not store" (padding).
    """
    assert k.shape == v.shape and k.shape[0] == slot_mapping.shape[0]
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    flat_k[slots] = k[keep].to(k_cache.dtype)
    flat_v[slots] = v[keep].to(v_cache.dtype)


@jit
def _cache_slot(slot_ptr, t, num_kv_heads, BLOCK_SIZE: tl.constexpr):
    """Token ``t``'s cache block, its offset in that block, and how many of its heads to store."""
    slot = tl.load(slot_ptr + t).to(tl.int64)
    # Padding tokens carry slot -1: they store no head at all (a masked no-op, not a branch).
    heads = tl.where(slot >= 0, num_kv_heads, 0)
    return slot // BLOCK_SIZE, slot % BLOCK_SIZE, heads


@jit
def _store_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kc_blk, stride_kc_slot, stride_kc_h,
    stride_vc_blk, stride_vc_slot, stride_vc_h,
    num_kv_heads,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # Grid: (T,); one program copies all kv heads of one token (a few KiB: enough per program).
    t = tl.program_id(0).to(tl.int64)
    blk, off, heads = _cache_slot(slot_ptr, t, num_kv_heads, BLOCK_SIZE)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < heads) & (d < HEAD_DIM)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask, other=0.0)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask, other=0.0)
    kc = kc_ptr + blk * stride_kc_blk + off * stride_kc_slot + h * stride_kc_h + d
    vc = vc_ptr + blk * stride_vc_blk + off * stride_vc_slot + h * stride_vc_h + d
    tl.store(kc, k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(vc_ptr.dtype.element_ty), mask=mask)


def _cache_problem(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> str | None:
    """Why the cache kernels cannot store k and v into these caches, or None when they can."""
    supported = (
        k.dim() == 3 and k_cache.dim() == 4 and all(t.dtype in FLOAT_DTYPES for t in (k, v, k_cache, v_cache))
        and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    )
    return None if supported else f"cache {tuple(k_cache.shape)} {k_cache.dtype}"


def _check_cache_store(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The launchers' checks on what is stored where; returns k and v with a unit stride along head_dim."""
    assert k.dim() == 3 and k.shape == v.shape and k.shape[0] == slot_mapping.shape[0], "k, v: [T, Hkv, D]"
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, "caches: [num_blocks, block_size, Hkv, D]"
    assert k_cache.shape[2:] == k.shape[1:], f"cache heads/dim {tuple(k_cache.shape[2:])} != k {tuple(k.shape[1:])}"
    assert k.dtype in FLOAT_DTYPES and v.dtype in FLOAT_DTYPES, f"unsupported dtypes {k.dtype}, {v.dtype}"
    assert k_cache.dtype in FLOAT_DTYPES and v_cache.dtype in FLOAT_DTYPES, "unsupported cache dtype"
    assert not slot_mapping.dtype.is_floating_point, "slot_mapping must be integers"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "caches need a unit stride along head_dim"
    return k if k.stride(-1) == 1 else k.contiguous(), v if v.stride(-1) == 1 else v.contiguous()


def store_kv_triton(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Triton launcher for :func:`store_kv_ref`; k/v may be strided views (e.g. of a fused qkv)."""
    devices = {t.device for t in (k, v, k_cache, v_cache, slot_mapping)}
    assert len(devices) == 1, f"tensors on several devices: {devices}"
    k, v = _check_cache_store(k, v, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        num_kv_heads,
        BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim,
        BLOCK_H=next_pow2(num_kv_heads), BLOCK_D=next_pow2(head_dim), num_warps=4,
    )


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter k, v [T, Hkv, D] into the paged caches at ``slot_mapping`` [T] (negative: skip).

    Triton on CUDA, else the reference.
    """
    if triton_takes("store_kv", (k, v, k_cache, v_cache), _cache_problem, k, v, k_cache, v_cache):
        store_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    else:
        store_kv_ref(k, v, k_cache, v_cache, slot_mapping)


def rotate_and_store_kv_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Rotate q [T, H, D] and k [T, Hkv, D] (``apply_rotary_ref``), store rotated k and v at
    ``slot_mapping`` (``store_kv_ref``); returns the rotated q. The inputs are left untouched."""
    q_rot, k_rot = apply_rotary_ref(q, k, positions, cos_sin_cache)
    store_kv_ref(k_rot, v, k_cache, v_cache, slot_mapping)
    return q_rot


@jit
def _rotate_and_store_kv_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cs_ptr, slot_ptr, q_out_ptr, kc_ptr, vc_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_qot, stride_qoh, stride_cs,
    stride_kc_blk, stride_kc_slot, stride_kc_h,
    stride_vc_blk, stride_vc_slot, stride_vc_h,
    num_q_heads, num_kv_heads,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    # Grid: (T,); one program handles every head of one token: cos/sin are read once, and the
    # rotated key goes straight to its cache slot (rotate_heads rounds it to k's dtype first).
    t = tl.program_id(0).to(tl.int64)
    d, d_mask, cos, sin = load_cos_sin(pos_ptr, cs_ptr, t, stride_cs, HALF, BLOCK_HALF)
    rotate_heads(q_ptr + t * stride_qt, q_out_ptr + t * stride_qot, stride_qh, stride_qoh, num_q_heads,
                 d, d_mask, cos, sin, HALF, BLOCK_HQ)

    blk, off, heads = _cache_slot(slot_ptr, t, num_kv_heads, BLOCK_SIZE)
    rotate_heads(k_ptr + t * stride_kt, kc_ptr + blk * stride_kc_blk + off * stride_kc_slot, stride_kh, stride_kc_h,
                 heads, d, d_mask, cos, sin, HALF, BLOCK_HK)
    hk = tl.arange(0, BLOCK_HK)
    mask = (hk[:, None] < heads) & d_mask[None, :]
    vsrc = v_ptr + t * stride_vt + hk[:, None] * stride_vh + d[None, :]
    vc = vc_ptr + blk * stride_vc_blk + off * stride_vc_slot + hk[:, None] * stride_vc_h + d[None, :]
    tl.store(vc, tl.load(vsrc, mask=mask, other=0.0).to(vc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc + HALF, tl.load(vsrc + HALF, mask=mask, other=0.0).to(vc_ptr.dtype.element_ty), mask=mask)


def rotate_and_store_kv_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Triton launcher for :func:`rotate_and_store_kv_ref`; q/k/v may be strided views of a fused qkv."""
    q, k, cs, constexprs, num_warps = rotary_launch(q, k, positions, cos_sin_cache)
    k, v = _check_cache_store(k, v, k_cache, v_cache, slot_mapping)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[0]:
        _rotate_and_store_kv_kernel[(q.shape[0],)](
            q, k, v, positions, cs, slot_mapping, q_out, k_cache, v_cache,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            q_out.stride(0), q_out.stride(1), cs.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            q.shape[1], k.shape[1], *constexprs, BLOCK_SIZE=k_cache.shape[1], num_warps=num_warps,
        )
    return q_out


def _rotate_and_store_problem(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor,
) -> str | None:
    return rotary_problem(q, k, cos_sin_cache) or _cache_problem(k, v, k_cache, v_cache)


def rotate_and_store_kv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Rotate q and k by ``positions``, write rotated k and v into the paged caches at
    ``slot_mapping`` (negative: skip); returns the rotated q. Triton on CUDA, else the reference."""
    args = (q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)
    if triton_takes("rotate_and_store_kv", (q, k, v, k_cache, v_cache), _rotate_and_store_problem,
                    q, k, v, cos_sin_cache, k_cache, v_cache):
        return rotate_and_store_kv_triton(*args)
    return rotate_and_store_kv_ref(*args)
