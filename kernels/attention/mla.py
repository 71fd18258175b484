"""Multi-head latent attention (MLA: DeepSeek-V2/V3) over its cache of latent rows, in Triton.

The cache holds per token one row ``[c_kv (L = kv_lora_rank), k_pe (R = qk_rope_head_dim)]`` as
a single kv head, and the values are a view of its first L columns (``KVCacheSpec.shares_v``).
The layer attends in the absorbed form (``engine/layers/mla.py``): query ``[q_lat (L), q_pe
(R)]`` of every head against every row, ``score = q_lat . c_kv + q_pe . k_pe``, output ``p @
c_kv`` (L wide). The dense kernels (``decode.py``, ``prefill.py``) refuse these inputs (values
narrower than keys, 576-wide keys); the kernels here load each key tile once, as ``c_kv`` [N, L]
and ``k_pe`` [N, R], and use ``c_kv`` twice: as the keys of the first score dot and as the
values (no second read of the cache, no value tile of its own).

* **decode** (every sequence brings one query): grid ``(head_block, sequence, partition)``. All
  query heads share the one kv head, so a program scores one key tile against ``BLOCK_H`` heads
  at once (two ``tl.dot``: ``q_lat [BLOCK_H, L] @ c_kv^T`` and ``q_pe [BLOCK_H, R] @ k_pe^T``) and
  folds ``p @ c_kv`` into its ``[BLOCK_H, L]`` accumulator. A long sequence is split over the
  partitions exactly as the dense decode kernel splits it (``tiles._decode_slice``: the grid
  sized on the host from ``max_seqlen_k``, each sequence cutting its own length into that many
  whole-tile slices), and split sequences are merged by the dense decode's merge kernel
  (``decode._decode_reduce_kernel``, head dim L: its partial-result layout fits as it is). No
  host sync when the caller passes ``max_seqlen_k``: a CUDA graph captures the step.
* **prefill** (any ``q_len``, with or without a cached prefix): the (token, head) pairs of a
  sequence are packed into rows, ``row = token * H + head``, all heads of a token sharing its
  keys; grid ``(row_tile, sequence)`` over ``cdiv(max_seqlen_q * H, BLOCK_M)`` tiles. Each key
  tile is read once for ``BLOCK_M`` rows; a row sees the keys up to its token's position (causal
  with the prefix's offset). Tiles wholly before the tile's first token are unmasked, as in
  ``prefill.py``; those after its last token are never read.

Tiles (Hopper: 228 KB of shared memory and 64K registers an SM). The launcher's defaults below
(``AttentionTuning`` overrides them) are not yet timed on a GPU; the register and shared-memory
figures are ptxas's for sm_90 (Triton 3.9, bf16, L 512, R 64, compiled without a device):

* decode: ``BLOCK_H`` 16 (the query heads padded to 16 rows for ``tl.dot``), 4 warps; 32 heads in
  8 warps when there are more than 16. The fp32 accumulator is ``BLOCK_H * L * 4`` bytes in
  registers: 32 KB at 16 heads (64 registers a thread over 4 warps); 64 heads, 128 KB, spill
  even over 8 warps (255 registers and 208 bytes of spills, against 243 registers and none at
  32), hence the cap (more heads: more head blocks, each re-reading the keys, mostly from L2).
  ``BLOCK_N`` 32: a key tile is 32 x 576 bf16 = 36 KB; the kernel takes 58 KB of shared memory
  and 255 registers without spills, two programs an SM; 64-key tiles (72 KB a tile) spill 1.3 KB.
  ``num_stages`` 2 is asked for, but Triton does not multi-buffer this gather through the block
  table in 16 bits (the same 58 KB at 1, 2 or 3 stages): two programs an SM keep the loads in
  flight instead.
* prefill: ``BLOCK_M`` 64 rows (four tokens of DeepSeek-V2-Lite's 16 heads), ``BLOCK_N`` 32, 8
  warps, 1 stage: warpgroup MMAs (``wgmma``; 32-row tiles fall back to ``mma.sync``), 108 KB of
  shared memory (the query rows, 64 x 576, stay there next to the key tile), 255 registers and
  248 bytes of spills (the accumulator, 64 x 512 fp32, is 128 registers a thread); 4 warps
  spill 4.8 KB.
* fp32 (exact products, the tests' mode): 16-key tiles, and 16-row prefill tiles in 4 warps; the
  16-bit tiles would spill kilobytes (prefill 64 x 32: 78 KB of spills in 216 KB of shared memory).

L and R must be powers of two (512 and 64 in every DeepSeek release); L at least 16 (a dot's
smallest side); an R below 16 (the tiny test models' 8) is padded to 16 inside the kernels, the
columns past R loaded as 0. A quantized cache, sliding windows, soft-capping and ALiBi are
refused (``_check_mla_inputs``); ``paged_attention`` then runs its torch paths.
"""

# No ``from __future__ import annotations``: Triton reads ``tl.constexpr`` annotations as objects.

import torch

from .._triton import FLOAT_DTYPES, cdiv, is_pow2, jit, next_pow2, tl
from .decode import _decode_reduce_kernel, _decode_store
from .policy import DEFAULT_TUNING, AttentionTuning, _decode_partition, _fill_target
from .reference import _values_are_key_columns
from .tiles import _decode_slice, _fold_tile

_LOG2E = 1.4426950408889634
# Launch defaults (the module doc says why): 16-bit inputs, and fp32's smaller tiles.
_DECODE_BLOCK_N = 32
_DECODE_BLOCK_N_FP32 = 16
_DECODE_STAGES = 2
_PREFILL_TILES = (64, 32, 8)  # BLOCK_M, BLOCK_N, warps
_PREFILL_TILES_FP32 = (16, 16, 4)
_PREFILL_STAGES = 1
_MAX_LORA = 512  # the accumulator's register budget (module doc)
_MAX_ROPE = 128


def is_mla_layout(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the caches look like a latent cache: values narrower than the keys (the kernels
    of this module are then the ones to ask, ``_check_mla_inputs``)."""
    return k_cache.dim() == v_cache.dim() == 4 and v_cache.shape[-1] < k_cache.shape[-1]


def _check_mla_inputs(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor, seqlens_k: torch.Tensor,
    k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None,
    sliding_window: int | None = None, softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None, key_centres=None,
) -> str | None:
    """Why the MLA kernels cannot take these inputs, or None when they can (``launch._check_inputs``'
    arguments)."""
    if k_scales is not None or v_scales is not None or key_centres is not None:
        return "a quantized latent cache is not in the MLA kernels"
    if sliding_window is not None or softcap is not None or alibi_slopes is not None:
        return "sliding windows, soft-capping and ALiBi are not in the MLA kernels"
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.dim() != 4 or k_cache.shape[:3] != v_cache.shape[:3]:
        return "q must be [T, H, L + R] and the caches [num_blocks, block_size, 1, L + R] and [..., L]"
    if k_cache.shape[2] != 1:
        return f"a latent cache holds one kv head, not {k_cache.shape[2]}"
    lora, width = v_cache.shape[-1], k_cache.shape[-1]
    rope = width - lora
    if not (is_pow2(lora) and 16 <= lora <= _MAX_LORA and is_pow2(rope) and rope <= _MAX_ROPE):
        return (f"kv_lora_rank {lora} and rope dim {rope} must be powers of two, the rank in [16, {_MAX_LORA}] "
                f"and the rope dim at most {_MAX_ROPE}")
    if q.shape[-1] != width:
        return f"queries {q.shape[-1]} wide against latent rows {width} wide"
    if q.dtype not in FLOAT_DTYPES or not q.dtype == k_cache.dtype == v_cache.dtype:
        return f"q/cache dtypes {q.dtype}/{k_cache.dtype}/{v_cache.dtype} must match and be fp16/bf16/fp32"
    if k_cache.stride(-1) != 1 or not _values_are_key_columns(k_cache, v_cache):
        return "the values must be a view of the latent rows' first columns, unit-strided"
    if block_tables.dim() != 2 or block_tables.dtype not in (torch.int32, torch.int64):
        return "block_tables must be a 2-D int32/int64 tensor"
    if cu_seqlens_q.shape[0] != seqlens_k.shape[0] + 1 or block_tables.shape[0] < seqlens_k.shape[0]:
        return "cu_seqlens_q must be [B+1], seqlens_k [B] and block_tables [>=B, max_blocks]"
    return None


@jit
def _mla_tile(
    q_lat, q_pe, kv_ptr, bt_row, n, n_mask, visible, c, r, m_i, l_i, acc, qk_scale, stride_kb, stride_ks,
    LORA: tl.constexpr, ROPE: tl.constexpr, ROPE_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One key tile of latent rows at positions ``n``: scores of the rows ``q_lat`` [M, L] /
    ``q_pe`` [M, ROPE_PAD] against ``c_kv`` and ``k_pe``, then the online-softmax fold over
    ``c_kv`` as the values. MASKED: keys where ``n_mask`` is false load as 0 (the cache past a
    sequence may hold anything) and the scores are kept only where ``visible``; without it every
    key lies inside the sequence and is seen by every row."""
    if MASKED:
        block = tl.load(bt_row + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    else:
        block = tl.load(bt_row + n // BLOCK_SIZE).to(tl.int64)
    rows = kv_ptr + block * stride_kb + (n % BLOCK_SIZE) * stride_ks
    if MASKED:
        c_kv = tl.load(rows[:, None] + c[None, :], mask=n_mask[:, None], other=0.0)  # [N, L]
    else:
        c_kv = tl.load(rows[:, None] + c[None, :])
    if ROPE_PAD != ROPE:
        pe_mask = (r < ROPE)[:, None]
        if MASKED:
            pe_mask = pe_mask & n_mask[None, :]
        k_pe = tl.load(rows[None, :] + LORA + r[:, None], mask=pe_mask, other=0.0)  # [R, N]
    elif MASKED:
        k_pe = tl.load(rows[None, :] + LORA + r[:, None], mask=n_mask[None, :], other=0.0)
    else:
        k_pe = tl.load(rows[None, :] + LORA + r[:, None])
    s = tl.dot(q_lat, tl.trans(c_kv), input_precision=DOT_PRECISION)
    s = tl.dot(q_pe, k_pe, acc=s, input_precision=DOT_PRECISION) * qk_scale
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
    return _fold_tile(s, c_kv, m_i, l_i, acc, DOT_PRECISION)


@jit
def _mla_queries(q_ptr, rows, heads, row_mask, c, r, stride_qt, stride_qh, LORA: tl.constexpr,
                 ROPE: tl.constexpr, ROPE_PAD: tl.constexpr):
    """The query rows (token ``rows``, head ``heads``) as ``q_lat`` [M, L] and ``q_pe`` [M,
    ROPE_PAD]; rows where ``row_mask`` is false (and the rope columns past ROPE) load as 0."""
    base = q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh
    q_lat = tl.load(base + c[None, :], mask=row_mask[:, None], other=0.0)
    pe_mask = row_mask[:, None]
    if ROPE_PAD != ROPE:
        pe_mask = pe_mask & (r < ROPE)[None, :]
    q_pe = tl.load(base + LORA + r[None, :], mask=pe_mask, other=0.0)
    return q_lat, q_pe


@jit
def _mla_decode_kernel(
    q_ptr, kv_ptr, bt_ptr, cu_q_ptr, seqlens_k_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_bt, stride_ot, stride_oh,
    stride_pob, stride_poh, stride_pop, stride_plb, stride_plh,
    qk_scale, min_part,
    NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, LORA: tl.constexpr, ROPE: tl.constexpr,
    ROPE_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    head_block = tl.program_id(0)
    seq = tl.program_id(1)
    part = tl.program_id(2)
    seqlen = tl.load(seqlens_k_ptr + seq)
    # This sequence's own slice of keys (the dense decode's, which the merge kernel repeats).
    lo, part_len = _decode_slice(seqlen, 0, tl.num_programs(2), min_part, BLOCK_N, False)
    start = lo + part * part_len
    if start >= seqlen:  # past the end of a short sequence: nothing to do
        return
    end = tl.minimum(start + part_len, seqlen)
    row = tl.load(cu_q_ptr + seq).to(tl.int64)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < NUM_HEADS  # padding rows load zeros: finite scores, never stored
    c = tl.arange(0, LORA)
    r = tl.arange(0, ROPE_PAD)
    q_lat, q_pe = _mla_queries(q_ptr, row + tl.zeros([BLOCK_H], tl.int64), heads, h_mask, c, r, stride_qt,
                               stride_qh, LORA, ROPE, ROPE_PAD)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, LORA], tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        # The first tile holds key ``start`` < seqlen, so m_i is finite from then on.
        m_i, l_i, acc = _mla_tile(q_lat, q_pe, kv_ptr, bt_row, n, n_mask, n_mask[None, :], c, r, m_i, l_i, acc,
                                  qk_scale, stride_kb, stride_ks, LORA, ROPE, ROPE_PAD, BLOCK_SIZE, True,
                                  DOT_PRECISION)
    _decode_store(acc / l_i[:, None], m_i, l_i, c, out_ptr, part_out_ptr, part_lse_ptr, row, seq, part, heads,
                  h_mask, stride_ot, stride_oh, stride_pob, stride_poh, stride_pop, stride_plb, stride_plh,
                  SPLIT, part_len, seqlen - lo, True)


@jit
def _mla_prefill_kernel(
    q_ptr, kv_ptr, bt_ptr, cu_q_ptr, seqlens_k_ptr, out_ptr,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_bt, stride_ot, stride_oh,
    qk_scale,
    NUM_HEADS: tl.constexpr, LORA: tl.constexpr, ROPE: tl.constexpr, ROPE_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # Later row tiles see more keys: hand them the lowest program ids so they start first.
    m_tile = tl.num_programs(0) - 1 - tl.program_id(0)
    seq = tl.program_id(1)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    num_rows = q_len * NUM_HEADS
    first = m_tile * BLOCK_M
    if first >= num_rows:
        return
    seqlen = tl.load(seqlens_k_ptr + seq)
    # Token i of this sequence sits at absolute position ctx + i and sees keys 0..ctx + i.
    ctx = seqlen - q_len

    m = first + tl.arange(0, BLOCK_M)  # rows: token * NUM_HEADS + head
    m_mask = m < num_rows
    token = m // NUM_HEADS
    pos = ctx + token
    rows = (q_start + token).to(tl.int64)
    heads = m % NUM_HEADS
    c = tl.arange(0, LORA)
    r = tl.arange(0, ROPE_PAD)
    q_lat, q_pe = _mla_queries(q_ptr, rows, heads, m_mask, c, r, stride_qt, stride_qh, LORA, ROPE, ROPE_PAD)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, LORA], tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    # Keys past the tile's last token are masked for every row: stop before them. Key tiles that
    # end at or before its first token are seen by every row and lie inside the sequence: no mask.
    last_token = (tl.minimum(first + BLOCK_M, num_rows) - 1) // NUM_HEADS
    kv_end = tl.minimum(seqlen, ctx + last_token + 1)
    full_end = tl.minimum((ctx + first // NUM_HEADS + 1) // BLOCK_N * BLOCK_N, kv_end)
    for n0 in range(0, full_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        m_i, l_i, acc = _mla_tile(q_lat, q_pe, kv_ptr, bt_row, n, n, n, c, r, m_i, l_i, acc, qk_scale,  # no mask
                                  stride_kb, stride_ks, LORA, ROPE, ROPE_PAD, BLOCK_SIZE, False, DOT_PRECISION)
    # The diagonal tiles: causal mask and the end of the sequence. Key 0 is visible to every row
    # (padding rows included: pos >= 0), so each row's max is finite after the first tile.
    for n0 in range(full_end, kv_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < kv_end
        visible = (n[None, :] <= pos[:, None]) & n_mask[None, :]
        m_i, l_i, acc = _mla_tile(q_lat, q_pe, kv_ptr, bt_row, n, n_mask, visible, c, r, m_i, l_i, acc, qk_scale,
                                  stride_kb, stride_ks, LORA, ROPE, ROPE_PAD, BLOCK_SIZE, True, DOT_PRECISION)
    o = acc / l_i[:, None]
    dst = out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + c[None, :]
    tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None])


def paged_mla_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, seqlens_k: torch.Tensor, scale: float,
    max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
    *, tuning: AttentionTuning | None = None,
) -> torch.Tensor:
    """``paged_attention_ref`` for a latent cache (the module doc): q [T, H, L + R], ``k_cache``
    [num_blocks, block_size, 1, L + R], ``v_cache`` its first L columns (a view). Returns [T, H, L].

    ``max_seqlen_q`` picks the kernel (1: decode) and sizes the prefill grid; ``max_seqlen_k``
    sizes the decode grid; either is read from the device (a sync) when not given, and a value
    given must be at least the true maximum. ``tuning``: ``decode_partition`` (keys a decode
    program walks), ``block_m`` (decode: heads a program; prefill: (token, head) rows a program),
    ``block_n`` (key tile), ``num_warps``, ``num_stages``, ``maxnreg``; None keeps this module's
    defaults.
    """
    problem = _check_mla_inputs(q, k_cache, v_cache, block_tables, cu_seqlens_q, seqlens_k)
    assert problem is None, problem
    devices = {t.device for t in (q, k_cache, block_tables, cu_seqlens_q, seqlens_k)}
    assert len(devices) == 1, f"tensors on several devices: {devices}"
    tuning = DEFAULT_TUNING if tuning is None else tuning
    num_tokens, num_heads, width = q.shape
    lora = v_cache.shape[-1]
    rope = width - lora
    block_size, num_seqs = k_cache.shape[1], seqlens_k.shape[0]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    out = torch.empty((num_tokens, num_heads, lora), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    qk_scale = float(scale) * _LOG2E
    # fp32 inputs would default to TF32 tensor-core products on the GPU: keep them exact.
    fp32 = q.dtype == torch.float32
    precision = "ieee" if fp32 else "tf32"
    strides = (q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
               out.stride(0), out.stride(1))
    shape = dict(NUM_HEADS=num_heads, LORA=lora, ROPE=rope, ROPE_PAD=max(16, rope), BLOCK_SIZE=block_size)
    # (The quantized cache's knobs, simt, fast_codes and the variant flags, have nothing to act on here.)
    extra = {"maxnreg": tuning.maxnreg} if tuning.maxnreg else {}

    if max_seqlen_q == 1 and num_tokens == num_seqs:
        if max_seqlen_k is None:
            max_seqlen_k = int(seqlens_k.max())
        bh = tuning.block_m or (16 if num_heads <= 16 else 32)
        head_blocks = cdiv(num_heads, bh)
        partition = tuning.decode_partition or _decode_partition(q.device, num_seqs, head_blocks, max_seqlen_k)
        bn = tuning.block_n or min(_DECODE_BLOCK_N_FP32 if fp32 else _DECODE_BLOCK_N, next_pow2(partition))
        assert partition % bn == 0, "the decode partition must be a multiple of its key tile"
        num_parts = max(cdiv(max_seqlen_k, partition), 1)
        split = num_parts > 1
        # Short sequences spread over the partitions (down to one key tile a program) unless the
        # batch fills the GPU by itself (as the dense decode does, launch.py).
        min_part = partition
        if tuning.decode_partition or (q.is_cuda and num_seqs * head_blocks < _fill_target(q.device)):
            min_part = bn
        if split:
            part_out = torch.empty(num_seqs, num_heads, num_parts, lora, dtype=torch.float32, device=q.device)
            part_lse = torch.empty(num_seqs, num_heads, num_parts, dtype=torch.float32, device=q.device)
            po_strides = (part_out.stride(0), part_out.stride(1), part_out.stride(2))
            pl_strides = (part_lse.stride(0), part_lse.stride(1))
        else:
            part_out = part_lse = out  # unused (SPLIT=False); any valid pointer will do
            po_strides, pl_strides = (0, 0, 0), (0, 0)
        _mla_decode_kernel[(head_blocks, num_seqs, num_parts)](
            q, k_cache, block_tables, cu_seqlens_q, seqlens_k, out, part_out, part_lse,
            *strides, *po_strides, *pl_strides, qk_scale, min_part,
            BLOCK_H=bh, BLOCK_N=bn, SPLIT=split, DOT_PRECISION=precision, **shape,
            num_warps=tuning.num_warps or (4 if bh <= 16 else 8), num_stages=tuning.num_stages or _DECODE_STAGES,
            **extra,
        )
        if split:
            _decode_reduce_kernel[(num_heads, num_seqs)](
                part_out, part_lse, cu_seqlens_q, seqlens_k, out,
                *po_strides, *pl_strides, out.stride(0), out.stride(1), num_parts, min_part, 0,
                HEAD_DIM=lora, BLOCK_N=bn, BLOCK_P=min(next_pow2(num_parts), 16), WINDOW=False, HEAD_PAD=lora,
                num_warps=4,
            )
        return out

    bm, bn, warps = _PREFILL_TILES_FP32 if fp32 else _PREFILL_TILES
    bm, bn = tuning.block_m or bm, tuning.block_n or bn
    _mla_prefill_kernel[(cdiv(max_seqlen_q * num_heads, bm), num_seqs)](
        q, k_cache, block_tables, cu_seqlens_q, seqlens_k, out, *strides, qk_scale,
        BLOCK_M=bm, BLOCK_N=bn, DOT_PRECISION=precision, **shape,
        num_warps=tuning.num_warps or warps, num_stages=tuning.num_stages or _PREFILL_STAGES, **extra,
    )
    return out
