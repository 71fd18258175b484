"""The plain-torch reference of paged attention (the package doc): used on CPU, and what every
Triton kernel of this package is tested against.

Also ``paged_decode_torch``, decode in plain torch with no host sync (checked against the
reference): what the dispatcher runs on the GPU for decode inputs no kernel takes (a latent cache
whose widths ``mla.py`` refuses), so that a CUDA graph still captures the step.
"""

import torch
import torch.nn.functional as F

from ..kv_centres import KeyCentres, key_shifts_ref
from ..kv_quant import cache_bits, dequantize_kv_ref


def gather_kv_ref(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """Read the first ``length`` token slots of one sequence: [length, Hkv, D]."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]  # [nb, bs, Hkv, D]
    return blocks.reshape(-1, *cache.shape[2:])[:length]


def paged_attention_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, seqlens_k: torch.Tensor, scale: float,
    k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None,
    key_centres: KeyCentres | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-torch reference: gather each sequence's keys, then causal SDPA with GQA.

    q: [T, H, D]; caches: [num_blocks, block_size, Hkv, D]; block_tables: [B, max_blocks];
    cu_seqlens_q: [B+1]; seqlens_k: [B]. Returns [T, H, Dv]: the values may be narrower than the
    keys (``v_cache`` [num_blocks, block_size, Hkv, Dv], e.g. multi-head latent attention's view
    of the key cache's first columns); Dv = D otherwise. A quantized cache (uint8 codes,
    ``kv_cache.KVCacheLayout``) comes with its ``k_scales`` / ``v_scales`` and is read back
    through ``dequantize_kv_ref``; with ``key_centres`` its keys were stored centred, and each
    gets its centre back (``kv_cache.key_shifts_ref``, the row of the sequence's first block).

    ``sliding_window`` W: the query at position p sees only the keys p - W < k <= p (W keys,
    itself included; transformers' ``sliding_window_overlay``). ``softcap`` c: each score s (after
    ``scale``) becomes c * tanh(s / c) before the softmax (Gemma 2's attention soft-capping).
    ``alibi_slopes`` [H] (fp32, ``alibi.alibi_slopes``): head h's score of key k from the query at
    p gets ``slope_h * (k - p)`` (ALiBi). Order: scale, then ALiBi, then the cap.
    """
    assert sliding_window is None or sliding_window >= 1, "a sliding window holds at least one key"
    assert softcap is None or softcap > 0, "softcap must be positive"
    assert alibi_slopes is None or alibi_slopes.shape == (q.shape[1],), "one ALiBi slope a query head"
    assert q.dim() == 3 and k_cache.dim() == 4 and v_cache.dim() == 4 and k_cache.shape[:3] == v_cache.shape[:3]
    bits = cache_bits(k_cache, q.shape[-1])
    assert (k_scales is not None) == (v_scales is not None) == bool(bits), "codes and scales go together"
    assert key_centres is None or bits, "key centres belong to a quantized cache: pass them with its scales"
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of kv heads"
    group = num_heads // num_kv_heads
    dv = q.shape[-1] if bits else v_cache.shape[-1]  # quantized values are codes of head_dim values
    out = q.new_empty(*q.shape[:2], dv)
    starts, lens_k = cu_seqlens_q.tolist(), seqlens_k.tolist()
    for b, len_k in enumerate(lens_k):
        qs, qe = starts[b], starts[b + 1]
        len_q = qe - qs
        if len_q == 0:
            continue
        k = gather_kv_ref(k_cache, block_tables[b], len_k)
        v = gather_kv_ref(v_cache, block_tables[b], len_k)
        if bits:
            k = dequantize_kv_ref(k, gather_kv_ref(k_scales, block_tables[b], len_k), bits)
            if key_centres is not None:
                table = key_centres.table
                rows = block_tables[b, :1].long().clamp(max=table.shape[0] - 1).expand(len_k)
                k = k + key_shifts_ref(table, rows, torch.arange(len_k), key_centres.cos_sin)
            v = dequantize_kv_ref(v, gather_kv_ref(v_scales, block_tables[b], len_k), bits)
        qb = q[qs:qe].transpose(0, 1)  # [H, Lq, D]
        kb = k.transpose(0, 1).repeat_interleave(group, dim=0)  # [H, Lk, D]
        vb = v.transpose(0, 1).repeat_interleave(group, dim=0)
        # Query i sits at absolute position len_k - len_q + i and sees keys 0..that position.
        q_pos = torch.arange(len_k - len_q, len_k, device=q.device)
        k_pos = torch.arange(len_k, device=q.device)[None, :]
        mask = k_pos <= q_pos[:, None]
        if sliding_window is not None:
            mask &= k_pos > q_pos[:, None] - sliding_window
        qf, kf, vf = qb.to(torch.float32), kb.to(torch.float32), vb.to(torch.float32)
        if softcap is None and alibi_slopes is None:
            ob = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, scale=scale)
        else:
            scores = qf @ kf.transpose(1, 2) * scale
            if alibi_slopes is not None:
                dist = (k_pos - q_pos[:, None]).to(torch.float32)  # [Lq, Lk]: k - p
                scores = scores + alibi_slopes.to(q.device, torch.float32)[:, None, None] * dist
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            ob = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ vf
        out[qs:qe] = ob.transpose(0, 1).to(q.dtype)
    return out


# Elements of one chunk's gathered keys (sequences x keys x kv heads x dims): bounds the transient
# memory of ``paged_decode_torch`` (256 MiB of fp32 scores' inputs at most).
_DECODE_CHUNK_ELEMENTS = 1 << 26


def _values_are_key_columns(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether ``v_cache`` is a view of ``k_cache``'s first columns (``KVCacheSpec.shares_v``)."""
    return v_cache.data_ptr() == k_cache.data_ptr() and v_cache.stride() == k_cache.stride()


def paged_decode_torch(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seqlens_k: torch.Tensor, scale: float, max_seqlen_k: int,
) -> torch.Tensor:
    """Decode (sequence b brings one query, ``q[b]`` [H, D]) over unquantized paged caches,
    ``paged_attention_ref``'s result for that case, with no host sync: the block tables' columns
    up to ``max_seqlen_k`` (a host bound, as a CUDA graph fixes it) are read in chunks of whole
    blocks, every sequence's at once, keys past a sequence's length masked, and the chunks merged
    by an online softmax (flash-decoding). Values may be narrower than keys; when they are a view
    of the keys' first columns they are not gathered twice. Returns [B, H, Dv]."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group, dv = num_heads // num_kv_heads, v_cache.shape[-1]
    shared = _values_are_key_columns(k_cache, v_cache)
    blocks = min(block_tables.shape[1], -(-max_seqlen_k // block_size))
    per_chunk = max(1, _DECODE_CHUNK_ELEMENTS // max(1, num_seqs * block_size * num_kv_heads * head_dim))
    qf = q.float().view(num_seqs, num_kv_heads, group, head_dim)
    lens = seqlens_k.long()[:, None]
    dev = q.device
    best = torch.full((num_seqs, num_kv_heads, group), float("-inf"), device=dev)
    total = torch.zeros((num_seqs, num_kv_heads, group), device=dev)
    acc = torch.zeros((num_seqs, num_kv_heads, group, dv), device=dev)
    for first in range(0, blocks, per_chunk):
        ids = block_tables[:num_seqs, first : min(first + per_chunk, blocks)].long()  # [B, n]
        keys = k_cache[ids].flatten(1, 2).float()  # [B, n * block_size, Hkv, D]
        values = keys[..., :dv] if shared else v_cache[ids].flatten(1, 2).float()
        scores = torch.einsum("bkgd,blkd->bkgl", qf, keys) * scale
        pos = first * block_size + torch.arange(keys.shape[1], device=dev)
        scores = scores.masked_fill((pos[None, :] >= lens)[:, None, None, :], float("-inf"))
        new_best = torch.maximum(best, scores.amax(dim=-1))
        # A chunk wholly past a sequence's end leaves its maximum at -inf: shift by 0 there.
        shift = torch.where(torch.isinf(new_best), torch.zeros_like(new_best), new_best)
        probs = torch.exp(scores - shift[..., None])
        keep = torch.exp(best - shift)
        total = total * keep + probs.sum(dim=-1)
        acc = acc * keep[..., None] + torch.einsum("bkgl,blkd->bkgd", probs, values)
        best = new_best
    return (acc / total[..., None]).view(num_seqs, num_heads, dv).to(q.dtype)
