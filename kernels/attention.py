"""Attention over the paged KV cache for a flattened variable-length batch.

One entry point serves prefill, chunked prefill with a cached prefix, and decode: sequence ``b``
brings ``q_len = cu_seqlens_q[b+1] - cu_seqlens_q[b]`` new queries, which are the *last*
``q_len`` positions of its ``seqlens_k[b]`` keys (already written to the cache). Masking is
causal with that offset. The Triton kernels (GPU) are checked against ``paged_attention_ref``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gather_kv_ref(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """Read the first ``length`` token slots of one sequence: [length, Hkv, D]."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]  # [nb, bs, Hkv, D]
    return blocks.reshape(-1, *cache.shape[2:])[:length]


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Plain-torch reference: gather each sequence's keys, then causal SDPA with GQA.

    q: [T, H, D]; caches: [num_blocks, block_size, Hkv, D]; block_tables: [B, max_blocks];
    cu_seqlens_q: [B+1]; seqlens_k: [B]. Returns [T, H, D].
    """
    assert q.dim() == 3 and k_cache.dim() == 4 and k_cache.shape == v_cache.shape
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of kv heads"
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    starts, lens_k = cu_seqlens_q.tolist(), seqlens_k.tolist()
    for b, len_k in enumerate(lens_k):
        qs, qe = starts[b], starts[b + 1]
        len_q = qe - qs
        if len_q == 0:
            continue
        k = gather_kv_ref(k_cache, block_tables[b], len_k)
        v = gather_kv_ref(v_cache, block_tables[b], len_k)
        qb = q[qs:qe].transpose(0, 1)  # [H, Lq, D]
        kb = k.transpose(0, 1).repeat_interleave(group, dim=0)  # [H, Lk, D]
        vb = v.transpose(0, 1).repeat_interleave(group, dim=0)
        # Query i sits at absolute position len_k - len_q + i and sees keys 0..that position.
        q_pos = torch.arange(len_k - len_q, len_k, device=q.device)
        mask = torch.arange(len_k, device=q.device)[None, :] <= q_pos[:, None]
        ob = F.scaled_dot_product_attention(
            qb.to(torch.float32), kb.to(torch.float32), vb.to(torch.float32),
            attn_mask=mask, scale=scale,
        )
        out[qs:qe] = ob.transpose(0, 1).to(q.dtype)
    return out


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention over the paged cache; the torch reference until the Triton path lands."""
    return paged_attention_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, seqlens_k, scale)
