"""Attention over the paged KV cache: store this step's keys/values, then attend."""

from __future__ import annotations

import torch
from torch import nn

from conveyor.engine.attention_metadata import AttentionMetadata, get_attention_metadata
from conveyor.kernels import paged_attention, store_kv


class Attention(nn.Module):
    """Paged attention for one layer; holds no weights.

    ``k_cache`` / ``v_cache`` (``[num_blocks, block_size, Hkv, D]``) are assigned by the model
    runner after it sizes the cache. Before that (e.g. a memory-profiling forward) they are
    ``None`` and a prefill-only forward attends over this step's own keys/values.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, Hkv, D] (already rotated) -> [T, H*D]."""
        meta = get_attention_metadata()
        if self.k_cache is None or self.v_cache is None or self.k_cache.numel() == 0:
            out = self._attend_without_cache(q, k, v, meta)
        else:
            store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
            out = paged_attention(
                q, self.k_cache, self.v_cache, meta.block_tables, meta.cu_seqlens_q, meta.seqlens_k, self.scale
            )
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    def _attend_without_cache(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        # Treat k/v as a cache with one-token blocks so the same kernel serves this path.
        cu = meta.cu_seqlens_q.tolist()
        q_lens = [cu[b + 1] - cu[b] for b in range(len(cu) - 1)]
        if q_lens != meta.seqlens_k.tolist():
            raise RuntimeError("attention without a KV cache only works for prefill with no cached prefix")
        max_len = max(q_lens, default=0)
        tables = torch.zeros(len(q_lens), max_len, dtype=torch.int32, device=q.device)
        for b, n in enumerate(q_lens):
            tables[b, :n] = torch.arange(cu[b], cu[b] + n, dtype=torch.int32, device=q.device)
        return paged_attention(
            q, k.unsqueeze(1), v.unsqueeze(1), tables, meta.cu_seqlens_q, meta.seqlens_k, self.scale
        )
