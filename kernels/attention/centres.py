"""Giving centred keys their centres back inside the attention kernels (``kv_cache.KeyCentring``):
the score ``q . R(p) m`` of a sequence's mean key turned to each key group's position, per key
tile, on the CUDA cores (decode) or the tensor cores (prefill)."""

# No ``from __future__ import annotations``: Triton reads ``tl.constexpr`` annotations as objects.

from .._triton import jit, tl
from ..kv_centres import centre_position, turn


@jit
def _centre_coeffs(qm_rows, q_mask, m_ptr, j, qk_scale, HALF: tl.constexpr, PADDED: tl.constexpr = False):
    """For centred keys (``kv_cache.KeyCentring``): a key at centre position p gets back the score
    ``q . R(p) m`` of its sequence's mean key ``m`` (``m_ptr``, fp16) turned there, with ``q`` the
    query before the key basis (rows ``qm_rows`` [R, 1] pointers, dims ``j`` [HALF]). Pairwise,
    that is ``sum(a cos(p w) + b sin(p w))`` with ``a = q1 m1 + q2 m2`` and ``b = q2 m1 - q1 m2``
    over the dim pairs (j, HALF + j): a and b [R, HALF], log2-scaled, once a program, then one
    rotary table row a group of keys (``_centre_scores``). PADDED: ``j`` runs past HALF (a head dim
    that is not a power of two); ``q_mask`` masks those dims, and the mean key reads 0 there."""
    q1 = tl.load(qm_rows + j[None, :], mask=q_mask, other=0.0).to(tl.float32) * qk_scale
    q2 = tl.load(qm_rows + HALF + j[None, :], mask=q_mask, other=0.0).to(tl.float32) * qk_scale
    if PADDED:
        m1 = tl.load(m_ptr + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
        m2 = tl.load(m_ptr + HALF + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
    else:
        m1 = tl.load(m_ptr + j).to(tl.float32)[None, :]
        m2 = tl.load(m_ptr + HALF + j).to(tl.float32)[None, :]
    return q1 * m1 + q2 * m2, q2 * m1 - q1 * m2


@jit
def _centre_scores(a, b, cs_ptr, stride_cs, n0, max_pos, j, HALF: tl.constexpr, BLOCK_N: tl.constexpr,
                   GROUP: tl.constexpr, PADDED: tl.constexpr = False):
    """The centres' scores [R, BLOCK_N] of keys ``n0 .. n0 + BLOCK_N`` (``_centre_coeffs``): one
    value a group of GROUP keys (n0 a multiple of min(BLOCK_N, GROUP): tiles never straddle).
    PADDED: ``j`` runs past HALF; the rotary rows are read only below it (a and b are 0 past it)."""
    col = tl.arange(0, BLOCK_N)
    out = tl.zeros([a.shape[0], BLOCK_N], tl.float32)
    for g in tl.static_range(max(BLOCK_N // GROUP, 1)):
        p = centre_position(n0 + g * GROUP, max_pos, GROUP)  # int32: positions stay far below 2**31 / D
        if PADDED:
            cos = tl.load(cs_ptr + p * stride_cs + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
            sin = tl.load(cs_ptr + p * stride_cs + HALF + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
        else:
            cos = tl.load(cs_ptr + p * stride_cs + j).to(tl.float32)[None, :]
            sin = tl.load(cs_ptr + p * stride_cs + HALF + j).to(tl.float32)[None, :]
        score = tl.sum(a * cos + b * sin, 1)
        out = tl.where((col // GROUP == g)[None, :], score[:, None], out)
    return out


@jit
def _centre_scores_dot(qm_lo, qm_hi, m1, m2, cs_ptr, stride_cs, n, max_pos, j, HALF: tl.constexpr,
                       GROUP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The centres' scores [M, N] of keys at positions ``n`` [N] for queries given before the key
    basis as halves ``qm_lo``, ``qm_hi`` [M, HALF] (``_centre_coeffs``), on the tensor cores: the
    sequence's mean key (halves m1, m2 [HALF], float32) turned to each key's centre position
    makes an extra [D, N] key tile in q's dtype. For the prefill kernel, whose query tiles are
    too large for ``_centre_coeffs``' [M, HALF] pairs in registers."""
    p = centre_position(n.to(tl.int64), max_pos, GROUP)
    u1, u2 = turn(m1[:, None], m2[:, None], cs_ptr, p[None, :], stride_cs, j[:, None], HALF)  # [HALF, N]
    return tl.dot(qm_hi, u2.to(qm_lo.dtype), tl.dot(qm_lo, u1.to(qm_lo.dtype), input_precision=DOT_PRECISION),
                  input_precision=DOT_PRECISION)


@jit
def _centre_row(bt_row, c_ptr, stride_c_row, last_row):
    """The centre row of a sequence (its first block's, or the zero row past the table)."""
    return c_ptr + tl.minimum(tl.load(bt_row).to(tl.int64), last_row) * stride_c_row
