"""Decode attention over a quantized KV cache (int8 / int4 codes with per-token (scale, zero)):
the tensor-core walk ``_decode_quant`` the decode kernel runs for a group of query heads, and
the CUDA-core kernel ``_decode_simt_kernel`` for one query a kv head (MHA). No dequantized key
or value is ever made: codes enter the dots as they are and the scales and zeros come after."""

# No ``from __future__ import annotations``: Triton reads ``tl.constexpr`` annotations as objects.

from .._triton import jit, tl
from .centres import _centre_coeffs, _centre_row, _centre_scores
from .codes import _code_halves, _scale_zero_rows, _u4_f32, _u8_f32
from .tiles import _decode_slice, _kv_offsets, _score_mods


# Bits of the quantized decode kernel's TUNE: the variants it can be compiled in, each a named
# flag of ``policy.AttentionTuning`` (which says what each changes and holds the chosen set);
# ``_decode_quant`` reads the bits by value.
TUNE_K_HOIST = 1
TUNE_V_HOIST = 2
TUNE_FOLD = 4
TUNE_SCALE_AHEAD = 8
TUNE_PAIR = 16
TUNE_LAZY = 32


@jit
def _decode_quant_tile(
    q_lo, q_hi, qsum, k_lo, k_hi, v_lo, v_hi, ksc, kz, vsc, vz, n_mask, m_i, l_i, acc_lo, acc_hi, z_acc, centre,
    n, qpos, slope, softcap,
    BIASED: tl.constexpr, LAZY: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
    CENTRED: tl.constexpr, ALIBI: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """One key tile of a quantized cache (codes as loaded by ``_code_halves``, scales and zeros
    [N]) folded into the running softmax. The codes enter the dots as they are (small integers,
    exact in fp16/bf16), split in two halves of the head dim (an int4 byte holds one dim of each),
    and the per-key scale and zero come after: ``q . (c s + z) = s (q . c) + z sum(q)`` and
    ``p @ (c s + z) = (p s) @ c + sum(p z)``, so no dequantized key or value is ever made.
    ``z_acc`` gathers the values' zero terms, added to every dim at the end. LAZY: ``l_i`` and
    ``z_acc`` are [M, N] (one partial sum per key column, summed over the columns once, after
    the last tile: two cross-warp reductions a tile fewer); else [M].
    ``ksc`` comes times the log2 softmax scale, and ``qsum`` is sum(q) times it too; BIASED (codes
    read as 1024 + c) it is the pair (that, -1024 sum(q)): ``s q.(c + 1024) - 1024 s sum(q)``.
    CENTRED: ``centre`` [M, N] holds the keys' centres' scores (``_centre_scores``). MASKED: keys
    are seen only where ``n_mask``; ALIBI / SOFTCAP: ``tiles._score_mods`` of the keys at ``n``."""
    dt: tl.constexpr = q_lo.dtype
    s = tl.dot(q_lo, k_lo, input_precision=DOT_PRECISION)
    s = tl.dot(q_hi, k_hi, s, input_precision=DOT_PRECISION)
    if BIASED:
        qs, qb = qsum
        s = (s + qb[:, None]) * ksc[None, :] + qs[:, None] * kz[None, :]
    else:
        s = s * ksc[None, :] + qsum[:, None] * kz[None, :]
    if CENTRED:
        s += centre
    s = _score_mods(s, n[None, :], qpos, slope, softcap, ALIBI, SOFTCAP)
    if MASKED:
        s = tl.where(n_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    ps = (p * vsc[None, :]).to(dt)
    z = p * vz[None, :]
    if BIASED:  # p @ (c + 1024) carries 1024 sum(p s) on every dim: taken back with the zeros
        z = z - 1024.0 * ps.to(tl.float32)
    if LAZY:
        l_i = l_i * alpha[:, None] + p
        z_acc = z_acc * alpha[:, None] + z
    else:
        l_i = l_i * alpha + tl.sum(p, 1)
        z_acc = z_acc * alpha + tl.sum(z, 1)
    acc_lo = tl.dot(ps, v_lo, acc_lo * alpha[:, None], input_precision=DOT_PRECISION)
    acc_hi = tl.dot(ps, v_hi, acc_hi * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc_lo, acc_hi, z_acc


@jit
def _decode_quant_rows(k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, n0, tok, n_mask, kv_head,
                       stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                       stride_sb, stride_ss, stride_sh,
                       BLOCK_SIZE: tl.constexpr, IN_BLOCK: tl.constexpr, MASKED: tl.constexpr):
    """Pointers to the rows of key positions ``n0 + tok`` (codes of k and v, their scales) for one
    kv head. IN_BLOCK: the tile lies inside one cache block, whose number is read once (a scalar)
    and the rows sit at fixed offsets from its start; else each position reads its own block."""
    if IN_BLOCK:
        block = tl.load(bt_row + n0 // BLOCK_SIZE).to(tl.int64)
        slot = n0 % BLOCK_SIZE
        k_rows = (k_ptr + (block * stride_kb + slot * stride_ks + kv_head * stride_kh)) + tok * stride_ks
        v_rows = (v_ptr + (block * stride_vb + slot * stride_vs + kv_head * stride_vh)) + tok * stride_vs
        s_off = block * stride_sb + slot * stride_ss + kv_head * stride_sh
        return k_rows, v_rows, (ks_ptr + s_off) + tok * stride_ss, (vs_ptr + s_off) + tok * stride_ss
    else:
        k_off, v_off, s_off = _kv_offsets(bt_row, n0 + tok, n_mask, kv_head, stride_kb, stride_ks, stride_kh,
                                          stride_vb, stride_vs, stride_vh, stride_sb, stride_ss, stride_sh,
                                          BLOCK_SIZE, MASKED)
        return k_ptr + k_off, v_ptr + v_off, ks_ptr + s_off, vs_ptr + s_off


@jit
def _decode_quant(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, row, heads, g_mask, kv_head, start, end,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_sb, stride_ss, stride_sh, qk_scale,
    qm_ptr, c_ptr, cs_ptr, stride_qmt, stride_qmh, stride_c_row, stride_c_h, last_row, stride_cs, max_pos,
    win_first, qpos, slope, softcap,
    GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, BITS: tl.constexpr, FAST: tl.constexpr, TUNE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    CENTRED: tl.constexpr, GROUP_C: tl.constexpr, WINDOW: tl.constexpr, ALIBI: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """The decode kernel's walk over keys ``[start, end)`` of a quantized cache: returns (m, l,
    acc of the low half of the dims, acc of the high half, the values' zero terms). Whole tiles
    go unmasked and the last, partial one masked; a tile inside one cache block (block size a
    multiple of BLOCK_N) reads the block table once. WINDOW: keys before ``win_first`` are
    masked in every tile (only the first tile of the first partition has any); ALIBI / SOFTCAP
    (``_decode_quant_tile``) with the query at ``qpos`` and the heads' ``slope`` [M, 1].
    HEAD_PAD: HEAD_DIM rounded up to a power of two; each half's dims past HALF (PADDED) load as 0
    codes and queries, so they add nothing to the scores, and the caller does not store them."""
    HALF: tl.constexpr = HEAD_DIM // 2
    PADDED: tl.constexpr = HEAD_PAD != HEAD_DIM
    IN_BLOCK: tl.constexpr = BLOCK_SIZE % BLOCK_N == 0
    K_PURE: tl.constexpr = (TUNE & 1) != 0
    V_PURE: tl.constexpr = (TUNE & 2) != 0
    BIASED: tl.constexpr = (TUNE & 4) != 0
    AHEAD: tl.constexpr = (TUNE & 8) != 0 and IN_BLOCK
    PAIR: tl.constexpr = (TUNE & 16) != 0
    LAZY: tl.constexpr = (TUNE & 32) != 0
    j = tl.arange(0, HEAD_PAD // 2)
    j_mask = j < HALF
    tok = tl.arange(0, BLOCK_N)
    q_rows = q_ptr + row * stride_qt + heads[:, None] * stride_qh
    q_mask = g_mask[:, None]
    if PADDED:
        q_mask = q_mask & j_mask[None, :]
    # Padding rows (g >= GROUP) load zeros: their scores are finite and their results never stored.
    q_lo = tl.load(q_rows + j[None, :], mask=q_mask, other=0.0)
    q_hi = tl.load(q_rows + HALF + j[None, :], mask=q_mask, other=0.0)
    dt: tl.constexpr = q_lo.dtype
    q_total = tl.sum(q_lo.to(tl.float32), 1) + tl.sum(q_hi.to(tl.float32), 1)
    if BIASED:
        qsum = (q_total * qk_scale, -1024.0 * q_total)
    else:
        qsum = q_total * qk_scale  # for the keys' zeros

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    if LAZY:
        l_i = tl.zeros([GROUP_PAD, BLOCK_N], tl.float32)
        z_acc = tl.zeros([GROUP_PAD, BLOCK_N], tl.float32)
    else:
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        z_acc = tl.zeros([GROUP_PAD], tl.float32)
    acc_lo = tl.zeros([GROUP_PAD, HEAD_PAD // 2], tl.float32)
    acc_hi = tl.zeros([GROUP_PAD, HEAD_PAD // 2], tl.float32)
    if CENTRED:
        ca, cb = _centre_coeffs(qm_ptr + row * stride_qmt + heads[:, None] * stride_qmh, q_mask,
                                _centre_row(bt_row, c_ptr, stride_c_row, last_row) + kv_head * stride_c_h, j,
                                qk_scale, HALF, PADDED)
    full_end = start + (end - start) // BLOCK_N * BLOCK_N
    if AHEAD:
        _, _, ks_rows, vs_rows = _decode_quant_rows(
            k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, start, tok, tok, kv_head, stride_kb, stride_ks, stride_kh,
            stride_vb, stride_vs, stride_vh, stride_sb, stride_ss, stride_sh, BLOCK_SIZE, IN_BLOCK, False)
        ksc, kz = _scale_zero_rows(ks_rows, tok, False, PAIR)
        vsc, vz = _scale_zero_rows(vs_rows, tok, False, PAIR)
    for n0 in range(start, full_end, BLOCK_N):
        k_rows, v_rows, ks_rows, vs_rows = _decode_quant_rows(
            k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, n0, tok, tok, kv_head, stride_kb, stride_ks, stride_kh,
            stride_vb, stride_vs, stride_vh, stride_sb, stride_ss, stride_sh, BLOCK_SIZE, IN_BLOCK, False)
        # (PADDED: whole tiles load masked by dim)
        k_lo, k_hi = _code_halves(k_rows[None, :] + j[:, None], j_mask[:, None], HALF, BITS, dt, PADDED, FAST, K_PURE,
                                  BIASED)
        v_lo, v_hi = _code_halves(v_rows[:, None] + j[None, :], j_mask[None, :], HALF, BITS, dt, PADDED, FAST, V_PURE,
                                  BIASED)
        if AHEAD:
            # The next whole tile's scales (the last tile's again at the end: no mask needed).
            _, _, ks_next, vs_next = _decode_quant_rows(
                k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, tl.minimum(n0 + BLOCK_N, full_end - BLOCK_N), tok, tok,
                kv_head, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_sb, stride_ss,
                stride_sh, BLOCK_SIZE, IN_BLOCK, False)
            ksc_n, kz_n = _scale_zero_rows(ks_next, tok, False, PAIR)
            vsc_n, vz_n = _scale_zero_rows(vs_next, tok, False, PAIR)
        else:
            ksc, kz = _scale_zero_rows(ks_rows, tok, False, PAIR)
            vsc, vz = _scale_zero_rows(vs_rows, tok, False, PAIR)
        if CENTRED:
            centre = _centre_scores(ca, cb, cs_ptr, stride_cs, n0, max_pos, j, HALF, BLOCK_N, GROUP_C, PADDED)
        else:
            centre = 0.0  # (set in the loop: a loop-carried value keeps one type)
        m_i, l_i, acc_lo, acc_hi, z_acc = _decode_quant_tile(
            q_lo, q_hi, qsum, k_lo, k_hi, v_lo, v_hi, ksc * qk_scale, kz, vsc, vz, n0 + tok >= win_first, m_i, l_i,
            acc_lo, acc_hi, z_acc, centre, n0 + tok, qpos, slope, softcap, BIASED, LAZY, WINDOW, DOT_PRECISION,
            CENTRED, ALIBI, SOFTCAP)
        if AHEAD:
            ksc, kz, vsc, vz = ksc_n, kz_n, vsc_n, vz_n
    if full_end < end:
        # The first key of a partition is inside the sequence, so m_i is finite after any tile.
        n_mask = full_end + tok < end
        k_rows, v_rows, ks_rows, vs_rows = _decode_quant_rows(
            k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, full_end, tok, n_mask, kv_head, stride_kb, stride_ks, stride_kh,
            stride_vb, stride_vs, stride_vh, stride_sb, stride_ss, stride_sh, BLOCK_SIZE, IN_BLOCK, True)
        k_mask = n_mask[None, :]
        v_mask = n_mask[:, None]
        if PADDED:
            k_mask = k_mask & j_mask[:, None]
            v_mask = v_mask & j_mask[None, :]
        k_lo, k_hi = _code_halves(k_rows[None, :] + j[:, None], k_mask, HALF, BITS, dt, True, FAST, K_PURE, BIASED)
        v_lo, v_hi = _code_halves(v_rows[:, None] + j[None, :], v_mask, HALF, BITS, dt, True, FAST, V_PURE, BIASED)
        ksc, kz = _scale_zero_rows(ks_rows, n_mask, True, PAIR)
        vsc, vz = _scale_zero_rows(vs_rows, n_mask, True, PAIR)
        if CENTRED:
            centre = _centre_scores(ca, cb, cs_ptr, stride_cs, full_end, max_pos, j, HALF, BLOCK_N, GROUP_C, PADDED)
        else:
            centre = 0.0
        visible = n_mask
        if WINDOW:
            visible = n_mask & (full_end + tok >= win_first)
        m_i, l_i, acc_lo, acc_hi, z_acc = _decode_quant_tile(
            q_lo, q_hi, qsum, k_lo, k_hi, v_lo, v_hi, ksc * qk_scale, kz, vsc, vz, visible, m_i, l_i, acc_lo,
            acc_hi, z_acc, centre, full_end + tok, qpos, slope, softcap, BIASED, LAZY, True, DOT_PRECISION, CENTRED,
            ALIBI, SOFTCAP)
    if LAZY:
        l_i = tl.sum(l_i, 1)
        z_acc = tl.sum(z_acc, 1)
    return m_i, l_i, acc_lo, acc_hi, z_acc


@jit
def _store_cols(ptrs, values, mask, PADDED: tl.constexpr):
    """Store a row's columns: all of them, or (PADDED: the row padded to a power of two) where ``mask``."""
    if PADDED:
        tl.store(ptrs, values, mask=mask)
    else:
        tl.store(ptrs, values)


@jit
def _decode_simt_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, cu_q_ptr, seqlens_k_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    qm_ptr, c_ptr, cs_ptr,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_sb, stride_ss, stride_sh,
    stride_bt, stride_ot, stride_oh, stride_pob, stride_poh, stride_pop, stride_plb, stride_plh,
    stride_qmt, stride_qmh, stride_c_row, stride_c_h, last_row, stride_cs, max_pos,
    qk_scale, min_part, alibi_ptr, window, softcap,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, BITS: tl.constexpr, FAST: tl.constexpr, PAIR: tl.constexpr, CENTRED: tl.constexpr,
    GROUP_C: tl.constexpr, WINDOW: tl.constexpr, ALIBI: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """Decode attention over a quantized cache on the CUDA cores, for one query a kv head (MHA):
    the decode kernel's partitions and results (``_decode_kernel``), one warp a program, grid
    ``(head, sequence, partition)``. The codes become fp32 in registers (``_U8_TO_F32``) and the
    dots are elementwise products summed inside the warp: no shared memory, no barrier, no query
    padded to 16 rows as the tensor-core walk (``_decode_quant``) needs. The per-key scale and
    zero come after the products: ``q . (c s + z) = s (q . c) + z sum(q)`` and ``p @ (c s + z)
    = (p s) @ c + sum(p z)``. int8 reads whole rows; int4 a row of bytes, whose low and high
    nibbles are the two halves of the dims (``kv_cache.py``'s layout). Keys and values share
    strides (the launcher checks). Mind the code layouts Triton picks: with the codes loaded
    inside the converting function, every lane held every key's score (32 exp2 a lane instead of
    one) and the kernel ran 1.5x slower (SASS checked offline: ``MUFU.EX2`` count). WINDOW,
    ALIBI, SOFTCAP, HEAD_PAD: as the decode kernel's (the columns past a row's width masked)."""
    head = tl.program_id(0)
    seq = tl.program_id(1)
    part = tl.program_id(2)
    seqlen = tl.load(seqlens_k_ptr + seq)
    lo, part_len = _decode_slice(seqlen, window, tl.num_programs(2), min_part, BLOCK_N, WINDOW)
    start = lo + part * part_len
    if start >= seqlen:
        return
    end = tl.minimum(start + part_len, seqlen)
    row = tl.load(cu_q_ptr + seq).to(tl.int64)
    if ALIBI:
        slope = tl.load(alibi_ptr + head) * 1.4426950408889634
    else:
        slope = 0.0
    IN_BLOCK: tl.constexpr = BLOCK_SIZE % BLOCK_N == 0
    COLS: tl.constexpr = HEAD_DIM // 2 if BITS == 4 else HEAD_DIM
    PADDED: tl.constexpr = HEAD_PAD != HEAD_DIM
    COLS_PAD: tl.constexpr = HEAD_PAD // 2 if BITS == 4 else HEAD_PAD
    c = tl.arange(0, COLS_PAD)
    c_mask = c < COLS
    tok = tl.arange(0, BLOCK_N)
    q_row = q_ptr + row * stride_qt + head * stride_qh + c
    if PADDED:
        q_a = tl.load(q_row, mask=c_mask, other=0.0).to(tl.float32) * qk_scale
    else:
        q_a = tl.load(q_row).to(tl.float32) * qk_scale  # times the log2 softmax scale
    if BITS == 4:
        if PADDED:
            q_b = tl.load(q_row + COLS, mask=c_mask, other=0.0).to(tl.float32) * qk_scale
        else:
            q_b = tl.load(q_row + COLS).to(tl.float32) * qk_scale
        qsum = tl.sum(q_a, 0) + tl.sum(q_b, 0)
    else:
        qsum = tl.sum(q_a, 0)
    m_i = float("-inf")
    l_i = 0.0
    z_i = 0.0
    acc_a = tl.zeros([COLS_PAD], tl.float32)
    acc_b = tl.zeros([COLS_PAD], tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    if CENTRED:
        HALF: tl.constexpr = HEAD_DIM // 2
        jc = tl.arange(0, HEAD_PAD // 2)
        ca, cb = _centre_coeffs((qm_ptr + row * stride_qmt + head * stride_qmh) + tl.zeros([1, 1], tl.int64),
                                jc[None, :] < HALF, _centre_row(bt_row, c_ptr, stride_c_row, last_row)
                                + head * stride_c_h, jc, qk_scale, HALF, PADDED)
    for n0 in range(start, end, BLOCK_N):
        n_mask = n0 + tok < end
        if IN_BLOCK:  # the tile inside one cache block: its number read once
            block = tl.load(bt_row + n0 // BLOCK_SIZE).to(tl.int64)
            slot = n0 % BLOCK_SIZE
            rows = block * stride_kb + slot * stride_ks + head * stride_kh + tok * stride_ks
            s_rows = block * stride_sb + slot * stride_ss + head * stride_sh + tok * stride_ss
        else:
            rows, _, s_rows = _kv_offsets(bt_row, n0 + tok, n_mask, head, stride_kb, stride_ks, stride_kh,
                                          stride_kb, stride_ks, stride_kh, stride_sb, stride_ss, stride_sh,
                                          BLOCK_SIZE, True)
        # (Codes loaded here, before the scales, and converted by a function of the loaded
        # values: loaded inside the converting function, the loop got the slow layouts.)
        kv_mask = n_mask[:, None]
        if PADDED:
            kv_mask = kv_mask & c_mask[None, :]
        kc = tl.load(k_ptr + rows[:, None] + c[None, :], mask=kv_mask, other=0)
        ksc, kz = _scale_zero_rows(ks_ptr + s_rows, n_mask, True, PAIR)
        if BITS == 4:
            k_a, k_b = _u4_f32(kc, FAST)
            s = tl.sum(k_a * q_a[None, :], 1) + tl.sum(k_b * q_b[None, :], 1)
        else:
            s = tl.sum(_u8_f32(kc, FAST) * q_a[None, :], 1)
        s = s * ksc + qsum * kz
        if CENTRED:
            s += tl.sum(_centre_scores(ca, cb, cs_ptr, stride_cs, n0, max_pos, jc, HALF, BLOCK_N, GROUP_C, PADDED), 0)
        s = _score_mods(s, n0 + tok, seqlen - 1, slope, softcap, ALIBI, SOFTCAP)
        if WINDOW:
            s = tl.where(n_mask & (n0 + tok >= seqlen - window), s, float("-inf"))
        else:
            s = tl.where(n_mask, s, float("-inf"))
        # The first key of a partition is inside the sequence, so m_i is finite after any tile.
        m_new = tl.maximum(m_i, tl.max(s, 0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new)
        vc = tl.load(v_ptr + rows[:, None] + c[None, :], mask=kv_mask, other=0)
        vsc, vz = _scale_zero_rows(vs_ptr + s_rows, n_mask, True, PAIR)
        l_i = l_i * alpha + tl.sum(p, 0)
        z_i = z_i * alpha + tl.sum(p * vz, 0)
        pv = (p * vsc)[:, None]
        if BITS == 4:
            v_a, v_b = _u4_f32(vc, FAST)
            acc_b = acc_b * alpha + tl.sum(pv * v_b, 0)
        else:
            v_a = _u8_f32(vc, FAST)
        acc_a = acc_a * alpha + tl.sum(pv * v_a, 0)
        m_i = m_new
    o_a = (acc_a + z_i) / l_i
    o_b = (acc_b + z_i) / l_i
    if SPLIT and part_len < seqlen - lo:
        po = part_out_ptr + seq * stride_pob + head * stride_poh + part * stride_pop + c
        _store_cols(po, o_a, c_mask, PADDED)
        if BITS == 4:
            _store_cols(po + COLS, o_b, c_mask, PADDED)
        tl.store(part_lse_ptr + seq * stride_plb + head * stride_plh + part, m_i + tl.log2(l_i))
    else:
        dst = out_ptr + row * stride_ot + head * stride_oh + c
        _store_cols(dst, o_a.to(out_ptr.dtype.element_ty), c_mask, PADDED)
        if BITS == 4:
            _store_cols(dst + COLS, o_b.to(out_ptr.dtype.element_ty), c_mask, PADDED)
