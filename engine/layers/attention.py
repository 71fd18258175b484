"""Attention over the paged KV cache: (rotate and) store this step's keys/values, then attend."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..attention_metadata import AttentionMetadata, get_attention_metadata
from ...kernels import apply_rotary, paged_attention, store_kv
from ...kernels.kv_basis import to_key_basis
from ...kernels.kv_cache import rotate_and_store_kv
from ...kernels.kv_centres import KeyCentres, KeyCentring
from ...kernels.kv_quant import cache_bits
from ...kernels.kv_layout import turned_centres


@dataclass
class MixedBatchMetadata(AttentionMetadata):
    """A batch whose first ``num_decode_tokens`` rows are sequences bringing one query each, the
    rest prefill chunks: attention runs the decode kernel on the first part and the prefill
    kernel on the second (``decode`` / ``prefill`` hold each part's metadata, rows renumbered
    from 0). One kernel for both would send every decode row through the prefill kernel: a
    64-row query tile for one query, the keys read once per query head instead of once per kv
    head, and a grid sized by the longest prompt for every sequence. The fields inherited from
    ``AttentionMetadata`` describe the whole batch (the cache store uses its slot mapping)."""

    num_decode_tokens: int = 0
    decode: AttentionMetadata | None = None
    prefill: AttentionMetadata | None = None


def _rows(centres: KeyCentres | None, start: int, end: int) -> KeyCentres | None:
    """``centres`` for the query rows [start, end) of the step."""
    return None if centres is None else centres._replace(queries=centres.queries[start:end])


class Attention(nn.Module):
    """Paged attention for one layer; holds no weights.

    ``k_cache`` / ``v_cache`` (``[num_blocks, block_size, Hkv, D]``) are assigned by the model
    runner after it sizes the cache. Before that (e.g. a memory-profiling forward) they are
    ``None`` and a prefill-only forward attends over this step's own keys/values. A quantized
    cache (``quant_policy`` 8 or 4) holds uint8 codes there and its (scale, zero) pairs in
    ``k_scales`` / ``v_scales`` (``kernels/kv_cache.py``); they stay ``None`` otherwise.

    ``sliding_window`` (W: each query sees its last W keys, itself included) and ``softcap`` (scores
    become ``c * tanh(s / c)``) are this layer's, as ``paged_attention`` takes them; None: off.
    ``alibi_slopes``: ALiBi's slopes of this layer's (this rank's) query heads, fp32 [num_heads]
    (``kernels.attention.alibi_slopes``, sliced by the model), a buffer that follows the module's
    device; None: no ALiBi.

    ``v_head_dim`` set (below ``head_dim``): the values are each key's first ``v_head_dim``
    values, not a tensor of their own (multi-head latent attention: keys ``[c_kv, k_pe]``, values
    ``c_kv``). The layer then stores only the keys, ``v_cache`` is a view of ``k_cache``
    (``KVCacheSpec.shares_v``), ``forward`` takes ``v=None`` and returns ``[T, H * v_head_dim]``.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None,
                 sliding_window: int | None = None, softcap: float | None = None,
                 alibi_slopes: torch.Tensor | None = None, v_head_dim: int | None = None) -> None:
        super().__init__()
        if v_head_dim is not None and not 0 < v_head_dim <= head_dim:
            raise ValueError(f"values shared with the keys ({v_head_dim} wide) must fit in head_dim {head_dim}")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.shares_v = v_head_dim is not None
        self.v_head_dim = head_dim if v_head_dim is None else v_head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.sliding_window = sliding_window
        self.softcap = softcap
        if alibi_slopes is not None and alibi_slopes.shape != (num_heads,):
            raise ValueError(f"alibi_slopes {tuple(alibi_slopes.shape)}: one slope for each of the {num_heads} heads")
        self.alibi_slopes: torch.Tensor | None
        self.register_buffer("alibi_slopes", None if alibi_slopes is None else alibi_slopes.float().contiguous(),
                             persistent=False)
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.k_scales: torch.Tensor | None = None
        self.v_scales: torch.Tensor | None = None
        self.k_centres: torch.Tensor | None = None  # a quantized cache's key centres (kernels/kv_cache.py)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                positions: torch.Tensor | None = None, cos_sin_cache: torch.Tensor | None = None) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, Hkv, D] -> [T, H*D] (shared values: v None, -> [T, H*v_head_dim]).

        With ``positions`` and ``cos_sin_cache`` (``RotaryEmbedding.cos_sin_cache``), q and k are
        rotated here, in the same kernel that stores k and v; without them they arrive rotated."""
        meta = get_attention_metadata()
        rotate = positions is not None and cos_sin_cache is not None
        if self.shares_v:
            if v is not None or rotate:
                raise ValueError("shared values: pass v=None and keys rotated already (the values are their columns)")
            return self._forward_shared_v(q, k, meta)
        if self.k_cache is None or self.v_cache is None or self.k_cache.numel() == 0:
            if rotate:
                q, k = apply_rotary(q, k, positions, cos_sin_cache)
            out = self._attend_without_cache(q, k, v, meta)
        else:
            centres = None
            if rotate:
                centring = None
                # Centred keys lose each query's constant score q.centre, which the softmax ignores
                # but a soft-cap does not: a capped layer stores its keys uncentred.
                if self.k_centres is not None and self.softcap is None:
                    if meta.centre_index is None:  # keys stored uncentred would be read with centred ones
                        raise RuntimeError("a quantized KV cache needs AttentionMetadata.centre_index (each "
                                           "token's sequence's first block)")
                    centring = KeyCentring(self.k_centres, meta.centre_index, meta.new_centres)
                # int4's centres are turned to each key's position: attention adds their scores back
                # and needs the queries before the key basis for that (int8's, constant, need nothing).
                turned = centring is not None and turned_centres(cache_bits(self.k_cache, self.head_dim))
                q_model = torch.empty_like(q) if turned else None
                q = rotate_and_store_kv(q, k, v, positions, cos_sin_cache, self.k_cache, self.v_cache,
                                        meta.slot_mapping, self.k_scales, self.v_scales, centring, q_model)
                if turned:
                    centres = KeyCentres(self.k_centres, cos_sin_cache, q_model)
            else:
                # Keys that arrive rotated are stored uncentred: their centre needs their positions.
                store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping, self.k_scales, self.v_scales)
                if self.k_scales is not None:  # the cache holds keys in the key basis: queries alike
                    q = to_key_basis(q)
            out = self._attend_batch(q, meta, centres)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    def _forward_shared_v(self, q: torch.Tensor, k: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attention whose values are the keys' first ``v_head_dim`` columns: only the keys are
        stored (an unquantized cache, ``KVCacheSpec.layouts``), the values read through a view."""
        if self.k_cache is None or self.k_cache.numel() == 0:
            out = self._attend_without_cache(q, k, k[..., : self.v_head_dim], meta)
        else:
            # store_kv writes a key and a value tensor; here both are the keys, into the one cache
            # (the same row written twice: no value tensor of another width to store).
            store_kv(k, k, self.k_cache, self.k_cache, meta.slot_mapping)
            out = self._attend_batch(q, meta)
        return out.reshape(q.shape[0], self.num_heads * self.v_head_dim)

    def _attend_batch(self, q: torch.Tensor, meta: AttentionMetadata, centres: KeyCentres | None = None
                      ) -> torch.Tensor:
        """Attention of the step's queries over the cache: a mixed batch's decode rows and prefill
        rows each through their own kernel (``MixedBatchMetadata``)."""
        if isinstance(meta, MixedBatchMetadata) and meta.decode is not None and meta.prefill is not None:
            n = meta.num_decode_tokens
            return torch.cat([self._attend(q[:n], meta.decode, _rows(centres, 0, n)),
                              self._attend(q[n:], meta.prefill, _rows(centres, n, q.shape[0]))])
        return self._attend(q, meta, centres)

    def _attend(self, q: torch.Tensor, meta: AttentionMetadata, centres: KeyCentres | None = None) -> torch.Tensor:
        # The maxima come from the host-side metadata: the kernels then never read them from
        # the device (a sync per layer), and a CUDA-graph capture sees fixed upper bounds.
        return paged_attention(
            q, self.k_cache, self.v_cache, meta.block_tables, meta.cu_seqlens_q, meta.seqlens_k, self.scale,
            max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k,
            k_scales=self.k_scales, v_scales=self.v_scales, key_centres=centres,
            sliding_window=self.sliding_window, softcap=self.softcap, alibi_slopes=self.alibi_slopes,
        )

    def _attend_without_cache(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        # Treat k/v as a cache with one-token blocks so the same kernel serves this path.
        cu = meta.cu_seqlens_q.tolist()
        q_lens = [cu[b + 1] - cu[b] for b in range(len(cu) - 1)]
        if q_lens != meta.seqlens_k.tolist():
            raise RuntimeError("attention without a KV cache only works for prefill with no cached prefix")
        max_len = max(q_lens, default=0)
        # Row b of the one-token-block "cache" is token cu[b] + j: one broadcast, not a loop of copies.
        offsets = torch.arange(max_len, dtype=torch.int32, device=q.device)
        tables = meta.cu_seqlens_q[:-1, None].to(torch.int32) + offsets[None, :]
        return paged_attention(
            q, k.unsqueeze(1), v.unsqueeze(1), tables, meta.cu_seqlens_q, meta.seqlens_k, self.scale,
            max_seqlen_q=max_len, max_seqlen_k=max_len, sliding_window=self.sliding_window, softcap=self.softcap,
            alibi_slopes=self.alibi_slopes,
        )
