"""Writing new keys and values into the paged KV cache (where KV quantization will live)."""

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
