"""Writing new keys and values into the paged KV cache (where KV quantization will live)."""

from __future__ import annotations

import torch


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


def store_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Store new keys/values; the torch reference until the Triton path lands."""
    store_kv_ref(k, v, k_cache, v_cache, slot_mapping)
