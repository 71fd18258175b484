"""Writing new keys and values into the paged KV cache (where KV quantization will live).

Two entry points: ``store_kv`` writes already-rotated keys; ``rotate_and_store_kv`` applies the
rotary embedding to q and k and writes k and v in the same kernel (one launch per layer fewer
than rotary then store: at batch 1 each launch is latency, and a long prefill is launched kernel
by kernel, so launches cost host time too).
"""

# No ``from __future__ import annotations``: Triton reads ``tl.constexpr`` annotations as objects.

import torch

from conveyor.kernels._triton import FLOAT_DTYPES, forced_triton, next_pow2, tl, jit, use_triton


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
    slot = tl.load(slot_ptr + t).to(tl.int64)
    # Padding tokens carry slot -1: they store no head at all (a masked no-op, not a branch).
    heads = tl.where(slot >= 0, num_kv_heads, 0)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < heads) & (d < HEAD_DIM)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask, other=0.0)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask, other=0.0)
    kc = kc_ptr + blk * stride_kc_blk + off * stride_kc_slot + h * stride_kc_h + d
    vc = vc_ptr + blk * stride_vc_blk + off * stride_vc_slot + h * stride_vc_h + d
    tl.store(kc, k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(vc_ptr.dtype.element_ty), mask=mask)


def store_kv_triton(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Triton launcher for :func:`store_kv_ref`; k/v may be strided views (e.g. of a fused qkv)."""
    assert k.dim() == 3 and k.shape == v.shape and k.shape[0] == slot_mapping.shape[0], "k, v: [T, Hkv, D]"
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, "caches: [num_blocks, block_size, Hkv, D]"
    assert k_cache.shape[2:] == k.shape[1:], f"cache heads/dim {tuple(k_cache.shape[2:])} != k {tuple(k.shape[1:])}"
    assert k.dtype in FLOAT_DTYPES and v.dtype in FLOAT_DTYPES, f"unsupported dtypes {k.dtype}, {v.dtype}"
    assert k_cache.dtype in FLOAT_DTYPES and v_cache.dtype in FLOAT_DTYPES, "unsupported cache dtype"
    assert not slot_mapping.dtype.is_floating_point, "slot_mapping must be integers"
    devices = {t.device for t in (k, v, k_cache, v_cache, slot_mapping)}
    assert len(devices) == 1, f"tensors on several devices: {devices}"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "caches need a unit stride along head_dim"
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
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
    if use_triton(k, v, k_cache, v_cache):
        supported = (
            k.dim() == 3 and k_cache.dim() == 4 and all(t.dtype in FLOAT_DTYPES for t in (k, v, k_cache, v_cache))
            and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
        )
        if supported:
            store_kv_triton(k, v, k_cache, v_cache, slot_mapping)
            return
        if forced_triton():
            raise ValueError(f"store_kv Triton kernel does not support cache {tuple(k_cache.shape)} {k_cache.dtype}")
    store_kv_ref(k, v, k_cache, v_cache, slot_mapping)


def rotate_and_store_kv_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Rotate q [T, H, D] and k [T, Hkv, D] (``apply_rotary_ref``), store rotated k and v at
    ``slot_mapping`` (``store_kv_ref``); returns the rotated q. The inputs are left untouched."""
    from conveyor.kernels.rotary import apply_rotary_ref

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
    BLOCK_SIZE: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
):
    # Grid: (T,); one program handles every head of one token: cos/sin are read once, and the
    # rotated key goes straight to its cache slot. The rotation is _rotary_kernel's (rotary.py):
    # out1 = x1*cos - x2*sin, out2 = x2*cos + x1*sin, in float32.
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    d_mask = d < HALF
    cos = tl.load(cs_ptr + pos * stride_cs + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]

    hq = tl.arange(0, BLOCK_HQ)
    mask = (hq[:, None] < num_q_heads) & d_mask[None, :]
    src = q_ptr + t * stride_qt + hq[:, None] * stride_qh + d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = q_out_ptr + t * stride_qot + hq[:, None] * stride_qoh + d[None, :]
    tl.store(dst, (x1 * cos - x2 * sin).to(q_out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(q_out_ptr.dtype.element_ty), mask=mask)

    # Padding tokens carry slot -1: they store no head at all (a masked no-op, not a branch).
    slot = tl.load(slot_ptr + t).to(tl.int64)
    heads = tl.where(slot >= 0, num_kv_heads, 0)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    hk = tl.arange(0, BLOCK_HK)
    mask = (hk[:, None] < heads) & d_mask[None, :]
    src = k_ptr + t * stride_kt + hk[:, None] * stride_kh + d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    # Rounded to k's dtype first, as rotary then store would, so both paths write the same bits.
    k1 = (x1 * cos - x2 * sin).to(k_ptr.dtype.element_ty)
    k2 = (x2 * cos + x1 * sin).to(k_ptr.dtype.element_ty)
    kc = kc_ptr + blk * stride_kc_blk + off * stride_kc_slot + hk[:, None] * stride_kc_h + d[None, :]
    tl.store(kc, k1.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(kc + HALF, k2.to(kc_ptr.dtype.element_ty), mask=mask)
    vsrc = v_ptr + t * stride_vt + hk[:, None] * stride_vh + d[None, :]
    vc = vc_ptr + blk * stride_vc_blk + off * stride_vc_slot + hk[:, None] * stride_vc_h + d[None, :]
    tl.store(vc, tl.load(vsrc, mask=mask, other=0.0).to(vc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc + HALF, tl.load(vsrc + HALF, mask=mask, other=0.0).to(vc_ptr.dtype.element_ty), mask=mask)


def rotate_and_store_kv_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Triton launcher for :func:`rotate_and_store_kv_ref`; q/k/v may be strided views of a fused qkv."""
    assert q.dim() == 3 and k.dim() == 3 and k.shape == v.shape, "q [T,H,D], k and v [T,Hkv,D]"
    assert q.shape[0] == k.shape[0] == positions.shape[0] == slot_mapping.shape[0], "one row per token"
    head_dim = q.shape[-1]
    assert k.shape[-1] == head_dim and head_dim % 2 == 0, "q and k share an even head_dim"
    assert cos_sin_cache.dim() == 2 and cos_sin_cache.shape[-1] == head_dim, "cos_sin_cache must be [max_pos, D]"
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, "caches: [num_blocks, block_size, Hkv, D]"
    assert k_cache.shape[2:] == k.shape[1:], f"cache heads/dim {tuple(k_cache.shape[2:])} != k {tuple(k.shape[1:])}"
    assert all(t.dtype in FLOAT_DTYPES for t in (q, k, v, k_cache, v_cache)), "unsupported dtype"
    assert not positions.dtype.is_floating_point and not slot_mapping.dtype.is_floating_point, "integer indices"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "caches need a unit stride along head_dim"
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    cs = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_tokens = q.shape[0]
    if num_tokens:
        half = head_dim // 2
        block_half = next_pow2(half)
        block_hq, block_hk = next_pow2(q.shape[1]), next_pow2(k.shape[1])
        num_warps = 4 if block_hq * block_half <= 4096 else 8
        _rotate_and_store_kv_kernel[(num_tokens,)](
            q, k, v, positions, cs, slot_mapping, q_out, k_cache, v_cache,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            q_out.stride(0), q_out.stride(1), cs.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            q.shape[1], k.shape[1],
            BLOCK_SIZE=k_cache.shape[1], HALF=half, BLOCK_HALF=block_half,
            BLOCK_HQ=block_hq, BLOCK_HK=block_hk, num_warps=num_warps,
        )
    return q_out


def rotate_and_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Rotate q and k by ``positions``, write rotated k and v into the paged caches at
    ``slot_mapping`` (negative: skip); returns the rotated q. Triton on CUDA, else the reference."""
    if use_triton(q, k, v, k_cache, v_cache):
        supported = (
            q.dim() == 3 and k.dim() == 3 and k_cache.dim() == 4
            and all(t.dtype in FLOAT_DTYPES for t in (q, k, v, k_cache, v_cache))
            and q.shape[-1] == k.shape[-1] == cos_sin_cache.shape[-1] and q.shape[-1] % 2 == 0
            and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
        )
        if supported:
            return rotate_and_store_kv_triton(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)
        if forced_triton():
            raise ValueError(f"rotate_and_store_kv Triton kernel does not support q {tuple(q.shape)} {q.dtype}")
    return rotate_and_store_kv_ref(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)
