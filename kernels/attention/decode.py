"""The decode kernels (every sequence brings one query; the package doc): flash-decoding over
partitions of each sequence's keys, and the kernel that merges a split sequence's partitions."""

# No ``from __future__ import annotations``: Triton reads ``tl.constexpr`` annotations as objects.

from .._triton import gdc_launch_dependents, jit, tl
from .decode_quant import _decode_quant
from .tiles import _decode_slice, _tile_step


@jit
def _decode_store(o, m_i, l_i, cols, out_ptr, part_out_ptr, part_lse_ptr, row, seq, part, heads, g_mask,
                  stride_ot, stride_oh, stride_pob, stride_poh, stride_pop, stride_plb, stride_plh,
                  SPLIT: tl.constexpr, part_len, span, WITH_LSE: tl.constexpr, c_mask=0, PADDED: tl.constexpr = False):
    """Write normalized output columns ``cols`` of this program's heads: to the output, or, when
    the sequence's ``span`` of keys (``_decode_slice``) is split over several partitions, to the
    partial results with (WITH_LSE) the log2-sum-exp the merge kernel weighs them by. (A sequence
    that one partition covers is final here: the merge kernel skips it.) PADDED: only the
    columns where ``c_mask`` (the others pad the head dim to a power of two)."""
    if PADDED:
        mask = g_mask[:, None] & c_mask[None, :]
    else:
        mask = g_mask[:, None]
    if SPLIT and part_len < span:
        po = part_out_ptr + seq * stride_pob + heads[:, None] * stride_poh + part * stride_pop + cols[None, :]
        tl.store(po, o, mask=mask)
        if WITH_LSE:
            pl = part_lse_ptr + seq * stride_plb + heads * stride_plh + part
            tl.store(pl, m_i + tl.log2(l_i), mask=g_mask)
    else:
        dst = out_ptr + row * stride_ot + heads[:, None] * stride_oh + cols[None, :]
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=mask)


@jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, cu_q_ptr, seqlens_k_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_sb, stride_ss, stride_sh,
    stride_bt, stride_ot, stride_oh,
    stride_pob, stride_poh, stride_pop,
    stride_plb, stride_plh,
    qm_ptr, c_ptr, cs_ptr, stride_qmt, stride_qmh, stride_c_row, stride_c_h, last_row, stride_cs, max_pos,
    qk_scale, min_part, alibi_ptr, window, softcap,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, BITS: tl.constexpr, FAST: tl.constexpr, TUNE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, CENTRED: tl.constexpr, GROUP_C: tl.constexpr,
    WINDOW: tl.constexpr, ALIBI: tl.constexpr, SOFTCAP: tl.constexpr,
):
    # WINDOW: only keys >= seqlen - window are read and seen; ALIBI: the heads' slopes at
    # ``alibi_ptr``; SOFTCAP: ``softcap`` is the cap times log2(e) (tiles._score_mods).
    # HEAD_PAD: HEAD_DIM rounded up to a power of two (tl.arange's); the dims past it load as 0.
    PADDED: tl.constexpr = HEAD_PAD != HEAD_DIM
    kv_head = tl.program_id(0)
    seq = tl.program_id(1)
    part = tl.program_id(2)
    num_parts = tl.num_programs(2)
    seqlen = tl.load(seqlens_k_ptr + seq)
    # This sequence's own slice of keys (the module docstring); the reduce kernel repeats it.
    lo, part_len = _decode_slice(seqlen, window, num_parts, min_part, BLOCK_N, WINDOW)
    start = lo + part * part_len
    # Past the end of a short sequence (slices are whole key tiles): nothing to do.
    if start >= seqlen:
        return
    end = tl.minimum(start + part_len, seqlen)
    row = tl.load(cu_q_ptr + seq).to(tl.int64)
    win_first = seqlen - window  # the first key the query sees (WINDOW); qpos: the query's position
    qpos = seqlen - 1

    g = tl.arange(0, GROUP_PAD)
    g_mask = g < GROUP
    heads = kv_head * GROUP + g
    if ALIBI:
        slope = (tl.load(alibi_ptr + heads, mask=g_mask, other=0.0) * 1.4426950408889634)[:, None]
    else:
        slope = 0.0
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    if BITS:
        m_i, l_i, acc_lo, acc_hi, z_acc = _decode_quant(
            q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, row, heads, g_mask, kv_head, start, end,
            stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            stride_sb, stride_ss, stride_sh, qk_scale,
            qm_ptr, c_ptr, cs_ptr, stride_qmt, stride_qmh, stride_c_row, stride_c_h, last_row, stride_cs, max_pos,
            win_first, qpos, slope, softcap,
            GROUP_PAD, HEAD_DIM, HEAD_PAD, BLOCK_SIZE, BLOCK_N, BITS, FAST, TUNE, DOT_PRECISION, CENTRED, GROUP_C,
            WINDOW, ALIBI, SOFTCAP)
        j = tl.arange(0, HEAD_PAD // 2)
        j_mask = j < HEAD_DIM // 2
        _decode_store((acc_lo + z_acc[:, None]) / l_i[:, None], m_i, l_i, j, out_ptr, part_out_ptr, part_lse_ptr,
                      row, seq, part, heads, g_mask, stride_ot, stride_oh, stride_pob, stride_poh, stride_pop,
                      stride_plb, stride_plh, SPLIT, part_len, seqlen - lo, True, j_mask, PADDED)
        _decode_store((acc_hi + z_acc[:, None]) / l_i[:, None], m_i, l_i, HEAD_DIM // 2 + j, out_ptr, part_out_ptr,
                      part_lse_ptr, row, seq, part, heads, g_mask, stride_ot, stride_oh, stride_pob, stride_poh,
                      stride_pop, stride_plb, stride_plh, SPLIT, part_len, seqlen - lo, False, j_mask, PADDED)
    else:
        d = tl.arange(0, HEAD_PAD)
        d_mask = d < HEAD_DIM
        q_mask = g_mask[:, None]
        if PADDED:
            q_mask = q_mask & d_mask[None, :]
        # Padding rows (g >= GROUP) load zeros: their scores are finite and their results never stored.
        q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
        qsum = tl.sum(q.to(tl.float32), 1)  # unused by the 16-bit cache's _tile_step
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_PAD], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_mask = n < end
            if WINDOW:
                visible = n_mask & (n >= win_first)
            else:
                visible = n_mask
            # The first tile always holds a visible key (start < seqlen, and with a window the
            # first partition's first tile holds win_first), so m_i is finite from then on.
            m_i, l_i, acc = _tile_step(q, qsum, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, n, n_mask, visible[None, :],
                                       kv_head, d, m_i, l_i, acc, qk_scale, stride_kb, stride_ks, stride_kh,
                                       stride_vb, stride_vs, stride_vh, stride_sb, stride_ss, stride_sh,
                                       BLOCK_SIZE, HEAD_DIM, True, BITS, DOT_PRECISION, 0.0, False,
                                       qpos, slope, softcap, ALIBI, SOFTCAP, False, PADDED)
        _decode_store(acc / l_i[:, None], m_i, l_i, d, out_ptr, part_out_ptr, part_lse_ptr, row, seq, part, heads,
                      g_mask, stride_ot, stride_oh, stride_pob, stride_poh, stride_pop, stride_plb, stride_plh,
                      SPLIT, part_len, seqlen - lo, True, d_mask, PADDED)


@jit
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, cu_q_ptr, seqlens_k_ptr, out_ptr,
    stride_pob, stride_poh, stride_pop,
    stride_plb, stride_plh,
    stride_ot, stride_oh,
    grid_parts, min_part, window, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr,
    WINDOW: tl.constexpr, HEAD_PAD: tl.constexpr, PDL_TRIGGER: tl.constexpr = False,
):
    # Grid: (H, B). Merge a sequence's partitions: out = sum_p w_p o_p / sum_p w_p, w_p = 2^(lse_p - max).
    if PDL_TRIGGER:  # o_proj's GEMV may start fetching its weights (_triton.pdl_trigger)
        gdc_launch_dependents()
    head = tl.program_id(0)
    seq = tl.program_id(1)
    seqlen = tl.load(seqlens_k_ptr + seq)
    lo, part_len = _decode_slice(seqlen, window, grid_parts, min_part, BLOCK_N, WINDOW)  # as in _decode_kernel
    num_parts = tl.cdiv(seqlen - lo, part_len)
    if num_parts == 1:  # the decode kernel wrote this sequence's output itself
        return
    p = tl.arange(0, BLOCK_P)
    d = tl.arange(0, HEAD_PAD)  # HEAD_DIM rounded up to a power of two: the dims past it masked
    lse_row = part_lse_ptr + seq * stride_plb + head * stride_plh
    out_row = part_out_ptr + seq * stride_pob + head * stride_poh

    m = tl.full([BLOCK_P], float("-inf"), tl.float32)
    for p0 in range(0, num_parts, BLOCK_P):
        lse = tl.load(lse_row + p0 + p, mask=p0 + p < num_parts, other=float("-inf"))
        m = tl.maximum(m, lse)
    m_max = tl.max(m, 0)

    acc = tl.zeros([BLOCK_P, HEAD_PAD], tl.float32)
    w_sum = tl.zeros([BLOCK_P], tl.float32)
    for p0 in range(0, num_parts, BLOCK_P):
        p_mask = p0 + p < num_parts
        lse = tl.load(lse_row + p0 + p, mask=p_mask, other=float("-inf"))
        w = tl.where(p_mask, tl.exp2(lse - m_max), 0.0)
        if HEAD_PAD != HEAD_DIM:
            o = tl.load(out_row + (p0 + p)[:, None] * stride_pop + d[None, :],
                        mask=p_mask[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
        else:
            o = tl.load(out_row + (p0 + p)[:, None] * stride_pop + d[None, :], mask=p_mask[:, None], other=0.0)
        acc += w[:, None] * o
        w_sum += w
    o = tl.sum(acc, 0) / tl.sum(w_sum, 0)
    row = tl.load(cu_q_ptr + seq).to(tl.int64)
    if HEAD_PAD != HEAD_DIM:
        tl.store(out_ptr + row * stride_ot + head * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)
    else:
        tl.store(out_ptr + row * stride_ot + head * stride_oh + d, o.to(out_ptr.dtype.element_ty))
