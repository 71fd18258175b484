"""The M == 1 kernels (batch-1 decode; the package doc): the bf16 GEMV (``_gemv_kernel``, fp32
sums, zeros folded in per group, split K merged by ``gemm._splitk_reduce_kernel``) and the fp16
one (``_gemv_f16_kernel``, half2 chains, split K merged by its own last program)."""

# No ``from __future__ import annotations``: Triton reads ``tl.constexpr`` annotations as objects.

from .._triton import jit, tl
from .codes import _centered, _codes, _column_consts, _half, _hfma2, _neg_zeros, _spread


@jit
def _gemv_rows(x_ptr, qw_ptr, k, k_hi, NP, p, p_mask):
    """Packed words [BLOCK_R, BLOCK_P] and x values [BLOCK_R] of rows ``k`` (zero from ``k_hi``)."""
    k_mask = k < k_hi
    x = tl.load(x_ptr + k, mask=k_mask, other=0.0)
    q = tl.load(qw_ptr + k.to(tl.int64)[:, None] * NP + p[None, :], mask=k_mask[:, None] & p_mask[None, :], other=0)
    return q, x


@jit
def _gemv_rows_2d(x_ptr, qw_ptr, k, k_hi, NP, p, p_mask):
    """As ``_gemv_rows`` with x as a column [BLOCK_R, 1]: loaded in the words' layout, so that
    broadcasting it over the columns needs no exchange through shared memory."""
    k_mask = (k < k_hi)[:, None]
    x = tl.load(x_ptr + k[:, None], mask=k_mask, other=0.0)
    q = tl.load(qw_ptr + k.to(tl.int64)[:, None] * NP + p[None, :], mask=k_mask & p_mask[None, :], other=0)
    return q, x


@jit
def _gemv_accumulate(gacc, xsum, q, x, masks):
    """``gacc += x * q * 16**j`` (q read in place, see _codes) and ``xsum += x``, element-wise."""
    x = x.to(tl.float32)
    return gacc + (_codes(_spread(q), masks[None, :]) - 8388608.0) * x[:, None], xsum + x


@jit
def _gemv_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, b_ptr, out_ptr, part_ptr,
    K, N, NP, K_SPLIT,
    GROUP: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_R: tl.constexpr,
    SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    # Grid: (cdiv(N / 8, BLOCK_P), splits). A program: 8 * BLOCK_P columns (NP = N / 8 packed
    # words, an argument so that Triton sees its divisibility and vectorizes the masked loads),
    # rows [pid_s * K_SPLIT, (pid_s + 1) * K_SPLIT) in steps of 4 * BLOCK_R rows (K_SPLIT is a
    # multiple of the step, and the step divides GROUP or GROUP >= K: a step lies in one group).
    #
    # Per group, sum x * (q - z) = sum x * q - z * sum x: each step adds x * q into a
    # [BLOCK_R, 8 * BLOCK_P] register tile, one fused multiply-add per weight and no reduction;
    # the zeros and scales enter once per group, when it ends. Triton gives each thread 16 bytes
    # (4 words, 32 columns) of a row and spreads BLOCK_R rows over the threads.
    #
    # Memory latency: Triton does not software-pipeline loads that feed no tl.dot, and ptxas,
    # saving registers, issues a load only after the previous tile's arithmetic (one latency per
    # tile). So the four row tiles of the next step are loaded, by hand, before this step's
    # arithmetic: 8 loads of 16 bytes in flight per thread at ~100 registers.
    pid_n = tl.program_id(0)
    p = pid_n * BLOCK_P + tl.arange(0, BLOCK_P)
    p_mask = p < NP
    cols = pid_n * (8 * BLOCK_P) + tl.arange(0, 8 * BLOCK_P)
    c_mask = cols < N
    masks, units = _column_consts(8 * BLOCK_P)
    r = tl.arange(0, BLOCK_R)
    pid_s = tl.program_id(1)
    k_lo = pid_s * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    q0, x0 = _gemv_rows(x_ptr, qw_ptr, k_lo + r, k_hi, NP, p, p_mask)
    q1, x1 = _gemv_rows(x_ptr, qw_ptr, k_lo + BLOCK_R + r, k_hi, NP, p, p_mask)
    q2, x2 = _gemv_rows(x_ptr, qw_ptr, k_lo + 2 * BLOCK_R + r, k_hi, NP, p, p_mask)
    q3, x3 = _gemv_rows(x_ptr, qw_ptr, k_lo + 3 * BLOCK_R + r, k_hi, NP, p, p_mask)
    gacc = tl.zeros([BLOCK_R, 8 * BLOCK_P], tl.float32)
    xsum = tl.zeros([BLOCK_R], tl.float32)
    out = tl.zeros([8 * BLOCK_P], tl.float32)
    for k0 in range(k_lo, k_hi, 4 * BLOCK_R):
        c0, y0, c1, y1, c2, y2, c3, y3 = q0, x0, q1, x1, q2, x2, q3, x3
        nxt = k0 + 4 * BLOCK_R
        q0, x0 = _gemv_rows(x_ptr, qw_ptr, nxt + r, k_hi, NP, p, p_mask)
        q1, x1 = _gemv_rows(x_ptr, qw_ptr, nxt + BLOCK_R + r, k_hi, NP, p, p_mask)
        q2, x2 = _gemv_rows(x_ptr, qw_ptr, nxt + 2 * BLOCK_R + r, k_hi, NP, p, p_mask)
        q3, x3 = _gemv_rows(x_ptr, qw_ptr, nxt + 3 * BLOCK_R + r, k_hi, NP, p, p_mask)
        gacc, xsum = _gemv_accumulate(gacc, xsum, c0, y0, masks)
        gacc, xsum = _gemv_accumulate(gacc, xsum, c1, y1, masks)
        gacc, xsum = _gemv_accumulate(gacc, xsum, c2, y2, masks)
        gacc, xsum = _gemv_accumulate(gacc, xsum, c3, y3, masks)
        if (nxt % GROUP == 0) | (nxt >= k_hi):  # this step ends a group (or the range)
            g = k0 // GROUP
            zc = _codes(_spread(tl.load(qz_ptr + g * NP + p, mask=p_mask, other=0)), masks) - 8388608.0
            su = tl.load(s_ptr + g * N + cols, mask=c_mask, other=0.0).to(tl.float32) * units
            out += (tl.sum(gacc, axis=0) - zc * tl.sum(xsum, axis=0)) * su  # masked columns: s = 0
            gacc = tl.zeros([BLOCK_R, 8 * BLOCK_P], tl.float32)
            xsum = tl.zeros([BLOCK_R], tl.float32)
    if SPLIT:
        tl.store(part_ptr + pid_s * N + cols, out, mask=c_mask)
    else:
        if HAS_BIAS:
            out += tl.load(b_ptr + cols, mask=c_mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + cols, out.to(out_ptr.dtype.element_ty), mask=c_mask)


@jit
def _gemv_f16_tile(a0, a1, a2, a3, q, x, nz0, nz1, nz2, nz3, ASM: tl.constexpr):
    """Add one row tile's ``x * (q - z)`` to the fp16 chains ``a0..a3`` (half2 planes [R, P]):
    per two weights one LOP3 and two HFMA2."""
    xb = x.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    x2 = xb | (xb << 16)  # x[k] in both halves, [R, 1]
    d0, d1, d2, d3 = _centered(q, nz0, nz1, nz2, nz3, ASM)
    return _hfma2(x2, d0, a0, ASM), _hfma2(x2, d1, a1, ASM), _hfma2(x2, d2, a2, ASM), _hfma2(x2, d3, a3, ASM)


@jit
def _group_consts(qz_ptr, s_ptr, g, N, NP, p, p_mask, R: tl.constexpr, ASM: tl.constexpr):
    """Group ``g``'s negated zero planes (``_neg_zeros``) and its 8 scales per word (column c of
    word p, fp32), each broadcast to the [R, P] tiles: so the loop carries them in the tiles'
    own layout, and any layout exchange happens here, once per group, not once per tile."""
    nz0, nz1, nz2, nz3 = _neg_zeros(tl.load(qz_ptr + g * NP + p, mask=p_mask, other=0), ASM)
    s = s_ptr + g * N + p * 8
    return (_rows(nz0, R), _rows(nz1, R), _rows(nz2, R), _rows(nz3, R),
            _rows(tl.load(s, mask=p_mask, other=0.0).to(tl.float32), R),
            _rows(tl.load(s + 1, mask=p_mask, other=0.0).to(tl.float32), R),
            _rows(tl.load(s + 2, mask=p_mask, other=0.0).to(tl.float32), R),
            _rows(tl.load(s + 3, mask=p_mask, other=0.0).to(tl.float32), R),
            _rows(tl.load(s + 4, mask=p_mask, other=0.0).to(tl.float32), R),
            _rows(tl.load(s + 5, mask=p_mask, other=0.0).to(tl.float32), R),
            _rows(tl.load(s + 6, mask=p_mask, other=0.0).to(tl.float32), R),
            _rows(tl.load(s + 7, mask=p_mask, other=0.0).to(tl.float32), R))


@jit
def _rows(v, R: tl.constexpr):
    """A vector [P] repeated as R rows [R, P]."""
    return tl.broadcast_to(v[None, :], (R, v.shape[0]))


@jit
def _store8(ptr, p, mask, t0, t1, t2, t3, t4, t5, t6, t7):
    """Write 8 per-word vectors [P] to their interleaved columns ``8 * p + c``."""
    o = ptr + p * 8
    ty = ptr.dtype.element_ty
    tl.store(o, t0.to(ty), mask=mask)
    tl.store(o + 1, t1.to(ty), mask=mask)
    tl.store(o + 2, t2.to(ty), mask=mask)
    tl.store(o + 3, t3.to(ty), mask=mask)
    tl.store(o + 4, t4.to(ty), mask=mask)
    tl.store(o + 5, t5.to(ty), mask=mask)
    tl.store(o + 6, t6.to(ty), mask=mask)
    tl.store(o + 7, t7.to(ty), mask=mask)


@jit
def _reduce_last(part_ptr, lock_ptr, b_ptr, out_ptr, tile, N, SPLITS, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Split-K without a second kernel: every program of column tile ``tile`` has written its fp32
    partial row [N] (in ``part_ptr``, one row per split); the last to arrive adds them in split
    order (deterministic), writes the output and re-arms the tile's counter for the next launch.
    The partials are read 8 splits per load: a loop of one load per split would wait out one L2
    latency per split, in the one program that every column tile finishes with."""
    tl.debug_barrier()  # all threads' partial stores precede the (release) atomic below
    arrived = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLITS - 1:
        cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        c_mask = cols < N
        acc = tl.zeros([BLOCK_N], tl.float32)
        for s0 in range(0, SPLITS, 8):  # .cg: read from L2, where the other SMs' stores are
            s = s0 + tl.arange(0, 8)
            part = tl.load(part_ptr + s[:, None] * N + cols[None, :], mask=(s < SPLITS)[:, None] & c_mask[None, :],
                           other=0.0, cache_modifier=".cg")
            acc += tl.sum(part, axis=0)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=c_mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + cols, acc.to(out_ptr.dtype.element_ty), mask=c_mask)
        tl.atomic_xchg(lock_ptr + tile, 0, sem="relaxed", scope="gpu")


@jit
def _gemv_f16_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, b_ptr, out_ptr, part_ptr, lock_ptr,
    K, N, NP, K_SPLIT, SPLITS,
    GROUP: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_R: tl.constexpr, CHAIN: tl.constexpr,
    SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, ASM: tl.constexpr,
):
    # The fp16 GEMV. Grid and row steps as _gemv_kernel's (a step is 4 tiles of BLOCK_R rows and
    # lies in one group). Per two weights: one AND-OR, one HFMA2 for q - z (exact), one HFMA2
    # into an fp16 chain of x * (q - z); a chain holds CHAIN steps (4 * CHAIN rows a thread)
    # before it is added, times the group's scales, into fp32: short chains keep the fp16
    # rounding near the output's own (8 rows: ~4.5e-4 rms relative on randn x, against ~2e-4
    # for rounding the output alone), and the conversion costs 2 instructions per 8 weights.
    pid_n = tl.program_id(0)
    p = pid_n * BLOCK_P + tl.arange(0, BLOCK_P)
    p_mask = p < NP
    r = tl.arange(0, BLOCK_R)
    pid_s = tl.program_id(1)
    k_lo = pid_s * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    STEP: tl.constexpr = 4 * BLOCK_R
    q0, x0 = _gemv_rows_2d(x_ptr, qw_ptr, k_lo + r, k_hi, NP, p, p_mask)
    q1, x1 = _gemv_rows_2d(x_ptr, qw_ptr, k_lo + BLOCK_R + r, k_hi, NP, p, p_mask)
    q2, x2 = _gemv_rows_2d(x_ptr, qw_ptr, k_lo + 2 * BLOCK_R + r, k_hi, NP, p, p_mask)
    q3, x3 = _gemv_rows_2d(x_ptr, qw_ptr, k_lo + 3 * BLOCK_R + r, k_hi, NP, p, p_mask)
    nz0, nz1, nz2, nz3, s0, s1, s2, s3, s4, s5, s6, s7 = _group_consts(
        qz_ptr, s_ptr, k_lo // GROUP, N, NP, p, p_mask, BLOCK_R, ASM)
    a0 = tl.zeros([BLOCK_R, BLOCK_P], tl.int32)  # half2 +0.0
    a1 = tl.zeros([BLOCK_R, BLOCK_P], tl.int32)
    a2 = tl.zeros([BLOCK_R, BLOCK_P], tl.int32)
    a3 = tl.zeros([BLOCK_R, BLOCK_P], tl.int32)
    o0 = tl.zeros([BLOCK_R, BLOCK_P], tl.float32)
    o1 = tl.zeros([BLOCK_R, BLOCK_P], tl.float32)
    o2 = tl.zeros([BLOCK_R, BLOCK_P], tl.float32)
    o3 = tl.zeros([BLOCK_R, BLOCK_P], tl.float32)
    o4 = tl.zeros([BLOCK_R, BLOCK_P], tl.float32)
    o5 = tl.zeros([BLOCK_R, BLOCK_P], tl.float32)
    o6 = tl.zeros([BLOCK_R, BLOCK_P], tl.float32)
    o7 = tl.zeros([BLOCK_R, BLOCK_P], tl.float32)
    for k0 in range(k_lo, k_hi, STEP):
        c0, y0, c1, y1, c2, y2, c3, y3 = q0, x0, q1, x1, q2, x2, q3, x3
        nxt = k0 + STEP
        q0, x0 = _gemv_rows_2d(x_ptr, qw_ptr, nxt + r, k_hi, NP, p, p_mask)
        q1, x1 = _gemv_rows_2d(x_ptr, qw_ptr, nxt + BLOCK_R + r, k_hi, NP, p, p_mask)
        q2, x2 = _gemv_rows_2d(x_ptr, qw_ptr, nxt + 2 * BLOCK_R + r, k_hi, NP, p, p_mask)
        q3, x3 = _gemv_rows_2d(x_ptr, qw_ptr, nxt + 3 * BLOCK_R + r, k_hi, NP, p, p_mask)
        a0, a1, a2, a3 = _gemv_f16_tile(a0, a1, a2, a3, c0, y0, nz0, nz1, nz2, nz3, ASM)
        a0, a1, a2, a3 = _gemv_f16_tile(a0, a1, a2, a3, c1, y1, nz0, nz1, nz2, nz3, ASM)
        a0, a1, a2, a3 = _gemv_f16_tile(a0, a1, a2, a3, c2, y2, nz0, nz1, nz2, nz3, ASM)
        a0, a1, a2, a3 = _gemv_f16_tile(a0, a1, a2, a3, c3, y3, nz0, nz1, nz2, nz3, ASM)
        group_end = (nxt % GROUP == 0) | (nxt >= k_hi)
        if group_end | ((nxt - k_lo) % (CHAIN * STEP) == 0):  # close the fp16 chains
            o0 += _half(a0, 0) * s0
            o1 += _half(a0, 1) * s1
            o2 += _half(a1, 0) * s2
            o3 += _half(a1, 1) * s3
            o4 += _half(a2, 0) * s4
            o5 += _half(a2, 1) * s5
            o6 += _half(a3, 0) * s6
            o7 += _half(a3, 1) * s7
            a0 = tl.zeros([BLOCK_R, BLOCK_P], tl.int32)
            a1 = tl.zeros([BLOCK_R, BLOCK_P], tl.int32)
            a2 = tl.zeros([BLOCK_R, BLOCK_P], tl.int32)
            a3 = tl.zeros([BLOCK_R, BLOCK_P], tl.int32)
            if group_end & (nxt < k_hi):
                nz0, nz1, nz2, nz3, s0, s1, s2, s3, s4, s5, s6, s7 = _group_consts(
                    qz_ptr, s_ptr, nxt // GROUP, N, NP, p, p_mask, BLOCK_R, ASM)
    t0, t1, t2, t3 = tl.sum(o0, axis=0), tl.sum(o1, axis=0), tl.sum(o2, axis=0), tl.sum(o3, axis=0)
    t4, t5, t6, t7 = tl.sum(o4, axis=0), tl.sum(o5, axis=0), tl.sum(o6, axis=0), tl.sum(o7, axis=0)
    if SPLIT:
        _store8(part_ptr + pid_s * N, p, p_mask, t0, t1, t2, t3, t4, t5, t6, t7)
        _reduce_last(part_ptr, lock_ptr, b_ptr, out_ptr, pid_n, N, SPLITS, 8 * BLOCK_P, HAS_BIAS)
    else:
        if HAS_BIAS:
            bias = b_ptr + p * 8
            t0 += tl.load(bias, mask=p_mask, other=0.0).to(tl.float32)
            t1 += tl.load(bias + 1, mask=p_mask, other=0.0).to(tl.float32)
            t2 += tl.load(bias + 2, mask=p_mask, other=0.0).to(tl.float32)
            t3 += tl.load(bias + 3, mask=p_mask, other=0.0).to(tl.float32)
            t4 += tl.load(bias + 4, mask=p_mask, other=0.0).to(tl.float32)
            t5 += tl.load(bias + 5, mask=p_mask, other=0.0).to(tl.float32)
            t6 += tl.load(bias + 6, mask=p_mask, other=0.0).to(tl.float32)
            t7 += tl.load(bias + 7, mask=p_mask, other=0.0).to(tl.float32)
        _store8(out_ptr, p, p_mask, t0, t1, t2, t3, t4, t5, t6, t7)
