"""The prefill kernel (any number of queries a sequence, with or without a cached prefix; the
package doc): flash attention over query tiles, causal with the prefix's offset."""

# No ``from __future__ import annotations``: Triton reads ``tl.constexpr`` annotations as objects.

from .._triton import jit, tl
from .centres import _centre_row, _centre_scores_dot
from .tiles import _tile_step


@jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, cu_q_ptr, seqlens_k_ptr, out_ptr,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_sb, stride_ss, stride_sh,
    stride_bt, stride_ot, stride_oh,
    qm_ptr, c_ptr, cs_ptr, stride_qmt, stride_qmh, stride_c_row, stride_c_h, last_row, stride_cs, max_pos,
    qk_scale, alibi_ptr, window, softcap,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    CENTRED: tl.constexpr, GROUP_C: tl.constexpr,
    WINDOW: tl.constexpr, ALIBI: tl.constexpr, SOFTCAP: tl.constexpr,
):
    # WINDOW: the query at position p sees keys p - window < k <= p; ALIBI: the heads' slopes at
    # ``alibi_ptr``; SOFTCAP: ``softcap`` is the cap times log2(e) (tiles._score_mods).
    # HEAD_PAD: HEAD_DIM rounded up to a power of two (tl.arange's); the dims past it load as 0.
    PADDED: tl.constexpr = HEAD_PAD != HEAD_DIM
    # Later query tiles see more keys: hand them the lowest program ids so they start first.
    m_tile = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    if m_tile * BLOCK_M >= q_len:
        return
    seqlen = tl.load(seqlens_k_ptr + seq)
    # Query i of this sequence sits at absolute position ctx + i and sees keys 0..ctx + i.
    ctx = seqlen - q_len
    kv_head = head // GROUP

    m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = m < q_len
    pos = ctx + m
    rows = (q_start + m).to(tl.int64)
    d = tl.arange(0, HEAD_PAD)
    io_mask = m_mask[:, None]  # the rows (and dims) loaded and stored
    if PADDED:
        io_mask = io_mask & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + d[None, :], mask=io_mask, other=0.0)
    qsum = tl.sum(q.to(tl.float32), 1)  # for a quantized cache's zeros (_scores)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    if ALIBI:
        slope = tl.load(alibi_ptr + head) * 1.4426950408889634
    else:
        slope = 0.0
    if CENTRED:  # the queries before the key basis and the sequence's mean key (_centre_scores_dot)
        HALF: tl.constexpr = HEAD_DIM // 2
        jc = tl.arange(0, HEAD_PAD // 2)  # the dims past HALF (PADDED) load as 0: they add nothing
        jc_mask = jc < HALF
        qm_rows = qm_ptr + rows[:, None] * stride_qmt + head * stride_qmh
        qm_lo = tl.load(qm_rows + jc[None, :], mask=m_mask[:, None] & jc_mask[None, :], other=0.0)
        qm_hi = tl.load(qm_rows + HALF + jc[None, :], mask=m_mask[:, None] & jc_mask[None, :], other=0.0)
        m_row = _centre_row(bt_row, c_ptr, stride_c_row, last_row) + kv_head * stride_c_h
        cm1 = tl.load(m_row + jc, mask=jc_mask, other=0.0).to(tl.float32)
        cm2 = tl.load(m_row + HALF + jc, mask=jc_mask, other=0.0).to(tl.float32)
    # Keys past the tile's last query position are masked for every row: stop before them.
    kv_end = tl.minimum(seqlen, ctx + (m_tile + 1) * BLOCK_M)
    # Key tiles that end at or before the tile's first query position are visible to every row
    # and lie inside the sequence: they need no mask at all (most tiles of a long prompt).
    full_end = tl.minimum((ctx + m_tile * BLOCK_M + 1) // BLOCK_N * BLOCK_N, kv_end)
    full_begin = 0
    if WINDOW:
        # Keys before the first row's window are seen by no row: start at the tile holding its
        # first key. Whole tiles from the last real row's window start on are seen by every row
        # (up to full_end, as without a window); those before it, masked row by row.
        kv_begin = tl.maximum(ctx + m_tile * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N
        last_pos = ctx + tl.minimum((m_tile + 1) * BLOCK_M, q_len) - 1
        full_begin = tl.minimum(tl.cdiv(tl.maximum(last_pos - window + 1, 0), BLOCK_N) * BLOCK_N, full_end)
        for n0 in range(kv_begin, full_begin, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_mask = n < kv_end
            # A row may see none of this tile's keys (nor any before): SAFE keeps its sums at 0.
            visible = (n[None, :] > pos[:, None] - window) & n_mask[None, :]
            if CENTRED:
                centre = _centre_scores_dot(qm_lo, qm_hi, cm1, cm2, cs_ptr, stride_cs, n, max_pos, jc, HALF,
                                            GROUP_C, DOT_PRECISION)
            else:
                centre = 0.0  # (set in the loop: a loop-carried value keeps one type)
            m_i, l_i, acc = _tile_step(q, qsum, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, n, n_mask, visible,
                                       kv_head, d, m_i, l_i, acc, qk_scale, stride_kb, stride_ks, stride_kh,
                                       stride_vb, stride_vs, stride_vh, stride_sb, stride_ss, stride_sh,
                                       BLOCK_SIZE, HEAD_DIM, True, BITS, DOT_PRECISION, centre, CENTRED,
                                       pos[:, None], slope, softcap, ALIBI, SOFTCAP, True, PADDED)
    for n0 in range(full_begin, full_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        if CENTRED:
            centre = _centre_scores_dot(qm_lo, qm_hi, cm1, cm2, cs_ptr, stride_cs, n, max_pos, jc, HALF, GROUP_C,
                                        DOT_PRECISION)
        else:
            centre = 0.0  # (set in the loop: a loop-carried value keeps one type)
        m_i, l_i, acc = _tile_step(q, qsum, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, n, n, n,  # no mask
                                   kv_head, d, m_i, l_i, acc, qk_scale, stride_kb, stride_ks, stride_kh,
                                   stride_vb, stride_vs, stride_vh, stride_sb, stride_ss, stride_sh,
                                   BLOCK_SIZE, HEAD_DIM, False, BITS, DOT_PRECISION, centre, CENTRED,
                                   pos[:, None], slope, softcap, ALIBI, SOFTCAP, False, PADDED)
    # The diagonal tiles: causal mask and the end of the sequence.
    for n0 in range(full_end, kv_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < kv_end
        # Key 0 is visible to every row (pos >= 0), so each row's max is finite after the first tile
        # and fully masked later tiles contribute exp2(-inf) = 0, never NaN. Not so with a window
        # (its rows' first keys are later): SAFE.
        visible = (n[None, :] <= pos[:, None]) & n_mask[None, :]
        if WINDOW:
            visible = visible & (n[None, :] > pos[:, None] - window)
        if CENTRED:
            centre = _centre_scores_dot(qm_lo, qm_hi, cm1, cm2, cs_ptr, stride_cs, n, max_pos, jc, HALF, GROUP_C,
                                        DOT_PRECISION)
        else:
            centre = 0.0  # (set in the loop: a loop-carried value keeps one type)
        m_i, l_i, acc = _tile_step(q, qsum, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, n, n_mask, visible,
                                   kv_head, d, m_i, l_i, acc, qk_scale, stride_kb, stride_ks, stride_kh,
                                   stride_vb, stride_vs, stride_vh, stride_sb, stride_ss, stride_sh,
                                   BLOCK_SIZE, HEAD_DIM, True, BITS, DOT_PRECISION, centre, CENTRED,
                                   pos[:, None], slope, softcap, ALIBI, SOFTCAP, WINDOW, PADDED)

    o = acc / l_i[:, None]
    dst = out_ptr + rows[:, None] * stride_ot + head * stride_oh + d[None, :]
    tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=io_mask)
