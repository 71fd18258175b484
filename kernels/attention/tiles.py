"""One key tile of attention through the block table, shared by the decode and prefill kernels:
offsets of a tile's keys, values and scales, its scores (with ALiBi and soft-capping when the
layer has them), and the online-softmax fold over its values, for a 16-bit cache or (codes
entering the dots as they are) a quantized one; and the slice of keys a decode program walks."""

# No ``from __future__ import annotations``: Triton reads ``tl.constexpr`` annotations as objects.

from .._triton import jit, tl
from .codes import _codes_as, _load_codes, _scale_zero


@jit
def _score_mods(s, n, qpos, slope, softcap, ALIBI: tl.constexpr, SOFTCAP: tl.constexpr):
    """A layer's changes to its log2-scaled scores ``s``, in this order: ALiBi's ``slope * (k - p)``
    (``slope`` already times log2(e); ``n`` the keys' and ``qpos`` the queries' positions, shaped
    to broadcast against ``s``), then soft-capping ``c tanh(s / c)``. Capping commutes with the
    log2 scaling when the cap is scaled too: ``softcap`` comes as ``c log2(e)``. tanh through
    exp2 (not every Triton has one): ``1 - 2 / (e^2x + 1)``, exact in the limits (+-1 for |x|
    large, where e^2x overflows to inf or underflows to 0)."""
    if ALIBI:
        s += slope * (n - qpos).to(tl.float32)
    if SOFTCAP:
        s = softcap * (1.0 - 2.0 / (tl.exp2(s * (2.0 * 1.4426950408889634 / softcap)) + 1.0))
    return s


@jit
def _running_max(s, m_i, SAFE: tl.constexpr):
    """The online softmax's new row maxima of scores ``s`` [M, N] after ``m_i``, with the rescale
    of the old sums and the tile's probabilities. SAFE: a row may have seen only masked keys so
    far (a sliding window's tiles before its own window): its max stays -inf and it subtracts 0
    instead (exp2(-inf - -inf) would be NaN), so those tiles add exactly 0."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if SAFE:
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_sub = m_new
    return m_new, tl.exp2(m_i - m_sub), tl.exp2(s - m_sub[:, None])


@jit
def _fold_tile(s, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr, SAFE: tl.constexpr = False):
    """One online-softmax step: fold log2-scaled scores s [M, N] over values v [N, D] into (m, l, acc)."""
    m_new, alpha, p = _running_max(s, m_i, SAFE)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@jit
def _tile_mask(n_mask, d, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, PADDED: tl.constexpr,
               ROWS_ARE_KEYS: tl.constexpr):
    """The load mask of a key tile [D, N] (ROWS_ARE_KEYS: keys for q @ k) or value tile [N, D]:
    MASKED, keys where ``n_mask``; PADDED (a head dim that is not a power of two, ``d`` running
    to the next one), dims below HEAD_DIM. Only called where one of the two holds."""
    if ROWS_ARE_KEYS:
        if MASKED and PADDED:
            return n_mask[None, :] & (d < HEAD_DIM)[:, None]
        elif MASKED:
            return n_mask[None, :]
        else:
            return (d < HEAD_DIM)[:, None]
    else:
        if MASKED and PADDED:
            return n_mask[:, None] & (d < HEAD_DIM)[None, :]
        elif MASKED:
            return n_mask[:, None]
        else:
            return (d < HEAD_DIM)[None, :]


@jit
def _kv_offsets(
    bt_row, n, n_mask, kv_head,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_sb, stride_ss, stride_sh,
    BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr,
):
    """Element offsets of one kv head's keys, values and (quantized caches) scales at key
    positions ``n``, read through the sequence's block table row ``bt_row``. MASKED: positions
    where ``n_mask`` is false read block 0; without it every position must lie inside the
    sequence (no mask: the common, faster case). The loads stay in the kernels, each where its
    value is first needed (the key before the dot, the value after it), the order the loops
    were tuned with."""
    if MASKED:
        block = tl.load(bt_row + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    else:
        block = tl.load(bt_row + n // BLOCK_SIZE).to(tl.int64)
    slot = n % BLOCK_SIZE
    k_off = block * stride_kb + slot * stride_ks + kv_head * stride_kh
    v_off = block * stride_vb + slot * stride_vs + kv_head * stride_vh
    s_off = block * stride_sb + slot * stride_ss + kv_head * stride_sh
    return k_off, v_off, s_off


@jit
def _scores(q, k_ptr, ks_ptr, k_off, s_off, d, n_mask, qsum, qk_scale,
            HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, BITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
            PADDED: tl.constexpr):
    """log2-scaled scores q @ k [M, N] of the keys at offsets ``k_off``. A quantized cache's codes
    enter the dot as they are (small integers, exact in fp16/bf16) and the per-key scale and zero
    come after: ``q . (c * s + z) = s * (q . c) + z * sum(q)``, so no dequantized key is ever made."""
    if BITS:
        if MASKED or PADDED:
            c = _load_codes(k_ptr, k_off, d, _tile_mask(n_mask, d, HEAD_DIM, MASKED, PADDED, True), True, HEAD_DIM,
                            True, BITS)
        else:
            c = _load_codes(k_ptr, k_off, d, n_mask, True, HEAD_DIM, False, BITS)
        s = tl.dot(q, _codes_as(c, q.dtype), input_precision=DOT_PRECISION)
        scale, zero = _scale_zero(ks_ptr, s_off, n_mask, MASKED)
        s = s * scale[None, :] + qsum[:, None] * zero[None, :]
    elif MASKED or PADDED:
        k_t = tl.load(k_ptr + k_off[None, :] + d[:, None], mask=_tile_mask(n_mask, d, HEAD_DIM, MASKED, PADDED, True),
                      other=0.0)  # [D, N]
        s = tl.dot(q, k_t, input_precision=DOT_PRECISION)
    else:
        k_t = tl.load(k_ptr + k_off[None, :] + d[:, None])  # [D, N]
        s = tl.dot(q, k_t, input_precision=DOT_PRECISION)
    return s * qk_scale


@jit
def _fold_values(s, v_ptr, vs_ptr, v_off, s_off, d, n_mask, m_i, l_i, acc, q_dtype: tl.constexpr,
                 HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, BITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 SAFE: tl.constexpr, PADDED: tl.constexpr):
    """Load the values at offsets ``v_off`` and fold scores ``s`` over them (``_fold_tile``). A
    quantized cache's codes enter the dot as they are, the per-value scale folded into the
    probabilities and the zero added as one row sum: ``p @ (c * s + z) = (p * s) @ c + sum(p * z)``."""
    if BITS:
        if MASKED or PADDED:
            c = _load_codes(v_ptr, v_off, d, _tile_mask(n_mask, d, HEAD_DIM, MASKED, PADDED, False), False, HEAD_DIM,
                            True, BITS)
        else:
            c = _load_codes(v_ptr, v_off, d, n_mask, False, HEAD_DIM, False, BITS)
        scale, zero = _scale_zero(vs_ptr, s_off, n_mask, MASKED)
        m_new, alpha, p = _running_max(s, m_i, SAFE)
        l_i = l_i * alpha + tl.sum(p, 1)
        pv = tl.dot((p * scale[None, :]).to(q_dtype), _codes_as(c, q_dtype), input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv + tl.sum(p * zero[None, :], 1)[:, None]
        return m_new, l_i, acc
    elif MASKED or PADDED:
        v = tl.load(v_ptr + v_off[:, None] + d[None, :], mask=_tile_mask(n_mask, d, HEAD_DIM, MASKED, PADDED, False),
                    other=0.0)  # [N, D]
        return _fold_tile(s, v, m_i, l_i, acc, DOT_PRECISION, SAFE)
    else:
        v = tl.load(v_ptr + v_off[:, None] + d[None, :])  # [N, D]
        return _fold_tile(s, v, m_i, l_i, acc, DOT_PRECISION, SAFE)


@jit
def _tile_step(
    q, qsum, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, n, n_mask, visible, kv_head, d, m_i, l_i, acc, qk_scale,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_sb, stride_ss, stride_sh,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, BITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, centre=0.0, CENTRED: tl.constexpr = False,
    qpos=0, slope=0.0, softcap=0.0, ALIBI: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
    SAFE: tl.constexpr = False, PADDED: tl.constexpr = False,
):
    """One key tile: load the keys, score, mask (MASKED: the tile may run past the sequence,
    ``n_mask``, and is seen only where ``visible``), load the values, fold into the running
    softmax. ``qsum``: the rows' sums of q, for a quantized cache's zeros; CENTRED: ``centre``
    [M, N] the keys' centres' scores (``_centre_scores_dot``); ALIBI / SOFTCAP: ``_score_mods``
    with the queries' positions ``qpos`` and slopes ``slope`` shaped [M, 1] or scalar; SAFE:
    ``_running_max``; PADDED: ``d`` runs past HEAD_DIM to a power of two, the dims past it read
    as 0 (so they add nothing to the scores, and the caller does not store them)."""
    k_off, v_off, s_off = _kv_offsets(bt_row, n, n_mask, kv_head, stride_kb, stride_ks, stride_kh,
                                      stride_vb, stride_vs, stride_vh, stride_sb, stride_ss, stride_sh,
                                      BLOCK_SIZE, MASKED)
    s = _scores(q, k_ptr, ks_ptr, k_off, s_off, d, n_mask, qsum, qk_scale, HEAD_DIM, MASKED, BITS, DOT_PRECISION,
                PADDED)
    if CENTRED:
        s += centre * qk_scale
    s = _score_mods(s, n[None, :], qpos, slope, softcap, ALIBI, SOFTCAP)
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
    return _fold_values(s, v_ptr, vs_ptr, v_off, s_off, d, n_mask, m_i, l_i, acc, q.dtype,
                        HEAD_DIM, MASKED, BITS, DOT_PRECISION, SAFE, PADDED)


@jit
def _decode_slice(seqlen, window, num_parts, min_part, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr):
    """The keys a decode program's sequence spreads over its ``num_parts`` partitions: from ``lo``
    to ``seqlen``, cut in slices of ``part_len`` keys (whole key tiles, at least ``min_part``;
    the package doc). ``lo`` is 0, or with a sliding window (WINDOW) the start of the key tile
    holding the first key the query sees (``seqlen - window``): keys before it are never read,
    and tiles stay aligned (a tile inside one cache block, centres a group at a time). Returns
    (lo, part_len); the decode kernels and the merge kernel all call it."""
    if WINDOW:
        lo = tl.maximum(seqlen - window, 0) // BLOCK_N * BLOCK_N
    else:
        lo = 0
    part_len = tl.maximum(tl.cdiv(tl.cdiv(seqlen - lo, num_parts), BLOCK_N) * BLOCK_N, min_part)
    return lo, part_len
