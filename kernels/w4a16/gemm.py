"""The 2 <= M < ``DEQUANT_MIN_ROWS`` kernels (batched decode; the package doc): a tiled GEMM whose
K tiles of packed weights are dequantized in registers and fed to ``tl.dot``, in two operand
orders, and the kernel that adds split-K partial sums."""

# No ``from __future__ import annotations``: Triton reads ``tl.constexpr`` annotations as objects.

from .._triton import grouped_tile, jit, row_and_cols, tl
from .codes import _centered, _hfma2, _neg_zeros


@jit
def _dequant_tile(q, z, s_ptr, g, N, rp, p_mask, DT: tl.constexpr, ASM: tl.constexpr):
    """The weight tile [BK, 8 * BP] in natural column order and dtype DT from packed words
    q [BK, BP] and zero words z [1, BP] of group g: (q - z) exact as half2 planes (one LOP3 and one
    HFMA2 per two weights), then the scales: fp16 as one more HFMA2 (the half2 scales are
    (col 2j, col 2j + 1) pairs, one int32 of scales viewed as int32), bf16 through fp32."""
    nz0, nz1, nz2, nz3 = _neg_zeros(z, ASM)
    d0, d1, d2, d3 = _centered(q, nz0, nz1, nz2, nz3, ASM)
    if DT == tl.float16:
        s = s_ptr + g * (N // 2) + rp[None, :] * 4  # int32 view: word 4p + j = scales of columns 8p + 2j, +1
        pm = p_mask[None, :]
        zero = tl.zeros(q.shape, tl.int32)
        d0 = _hfma2(d0, tl.load(s, mask=pm, other=0), zero, ASM)
        d1 = _hfma2(d1, tl.load(s + 1, mask=pm, other=0), zero, ASM)
        d2 = _hfma2(d2, tl.load(s + 2, mask=pm, other=0), zero, ASM)
        d3 = _hfma2(d3, tl.load(s + 3, mask=pm, other=0), zero, ASM)
    # join: [BK, BP, 2, 2] whose (u, v) is plane 2u + v, then each half2 split into (lo, hi):
    # [BK, BP, 2, 2, 2] flattens to column 8p + 2j + h.
    planes = tl.join(tl.join(d0, d2), tl.join(d1, d3))
    halves = tl.join(planes.to(tl.int16), (planes >> 16).to(tl.int16))
    w = tl.reshape(halves, [q.shape[0], 8 * q.shape[1]]).to(tl.float16, bitcast=True)
    if DT == tl.float16:
        return w
    else:
        cols = rp[:, None] * 8 + tl.arange(0, 8)[None, :]
        s = tl.load(s_ptr + g * N + cols, mask=p_mask[:, None], other=0.0).to(tl.float32)
        return (w.to(tl.float32) * tl.reshape(s, [8 * q.shape[1]])[None, :]).to(DT)


@jit
def _weight_tile(qw_ptr, qz_ptr, s_ptr, k, k_mask, g, NP, N, rp, p_mask, DT: tl.constexpr, ASM: tl.constexpr):
    """Rows ``k`` (in group ``g``) x packed columns ``rp`` of the weight, loaded and dequantized
    (``_dequant_tile``): the GEMM kernels' B tile, before either lays it out for its dot."""
    q = tl.load(qw_ptr + k.to(tl.int64)[:, None] * NP + rp[None, :], mask=k_mask[:, None] & p_mask[None, :], other=0)
    z = tl.load(qz_ptr + g * NP + rp[None, :], mask=p_mask[None, :], other=0)
    return _dequant_tile(q, z, s_ptr, g, N, rp, p_mask, DT, ASM)


@jit
def _tile_ranges(pid_m, pid_n, pid_s, M, N, NP, K, K_SPLIT,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The GEMM kernels' index ranges of output tile (pid_m, pid_n) and K split pid_s: rows,
    packed-word columns and output columns with their masks, the split's rows [k_lo, k_hi), and
    the K tile's offsets."""
    BLOCK_P: tl.constexpr = BLOCK_N // 8
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = rm < M
    rp = pid_n * BLOCK_P + tl.arange(0, BLOCK_P)
    p_mask = rp < NP
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    k_lo = pid_s * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    kk = tl.arange(0, BLOCK_K)
    return rm, m_mask, rp, p_mask, rn, n_mask, k_lo, k_hi, kk


@jit
def _store_tile(acc, rows, cols, mask, rn, n_mask, pid_s, part_ptr, b_ptr, out_ptr, M, N, stride_om,
                SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, SWAPPED: tl.constexpr):
    """The GEMM kernels' epilogue: the fp32 tile ``acc`` at output ``rows`` x ``cols`` (int64 rows
    and columns, broadcast to the tile's shape: [BM, 1] x [1, BN], or SWAPPED, ``acc`` being
    out^T, [1, BM] x [BN, 1]) goes to split ``pid_s``'s partial sums, or, with the bias of
    columns ``rn``, to the output."""
    if SPLIT:
        part = part_ptr + pid_s.to(tl.int64) * M * N
        tl.store(part + rows * N + cols, acc, mask=mask)
    else:
        if HAS_BIAS:
            if SWAPPED:
                acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[:, None]
            else:
                acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@jit
def _gemm_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, b_ptr, out_ptr, part_ptr,
    M, N, NP, K, K_SPLIT, stride_xm, stride_om,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_IN_F32: tl.constexpr,
    ASM: tl.constexpr,
):
    # Grid: (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N), splits), output tiles in GROUP_M-row bands so
    # that programs running together share weight tiles in L2. A K tile lies in one group
    # (BLOCK_K divides GROUP, or GROUP >= K), and K_SPLIT is a multiple of BLOCK_K. Each K tile
    # of packed weights is dequantized in registers (``_dequant_tile``) and multiplied by one
    # tl.dot accumulating in fp32.
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_s = tl.program_id(1)
    rm, m_mask, rp, p_mask, rn, n_mask, k_lo, k_hi, kk = _tile_ranges(pid_m, pid_n, pid_s, M, N, NP, K, K_SPLIT,
                                                                      BLOCK_M, BLOCK_N, BLOCK_K)
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + kk
        k_mask = k < K
        a = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = _weight_tile(qw_ptr, qz_ptr, s_ptr, k, k_mask, k0 // GROUP, NP, N, rp, p_mask, a.dtype, ASM)
        if DOT_IN_F32:  # the interpreter's bf16 tl.dot is wrong; same operands, in fp32
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32))
        else:
            acc = tl.dot(a, w, acc)
    _store_tile(acc, rm.to(tl.int64)[:, None], rn[None, :], m_mask[:, None] & n_mask[None, :], rn, n_mask, pid_s,
                part_ptr, b_ptr, out_ptr, M, N, stride_om, SPLIT, HAS_BIAS, False)


@jit
def _gemm_swap_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, b_ptr, out_ptr, part_ptr,
    M, N, NP, K, K_SPLIT, stride_xm, stride_om,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_IN_F32: tl.constexpr, ASM: tl.constexpr,
):
    # _gemm_kernel with the operands swapped: out^T [BLOCK_N, BLOCK_M] = W^T @ x^T. The weight
    # columns are the MMA's 64-row side and the few activation rows its narrow side (warp-group
    # MMA takes 8..256 there), so 16 or 32 rows need no padding to 64, and the dequantized tile
    # is operand A, which the warp-group MMA may read from registers (x^T, operand B, is what
    # goes through shared memory). Grid: (cdiv(N, BLOCK_N), splits, cdiv(M, BLOCK_M)).
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    rm, m_mask, rp, p_mask, rn, n_mask, k_lo, k_hi, kk = _tile_ranges(pid_m, pid_n, pid_s, M, N, NP, K, K_SPLIT,
                                                                      BLOCK_M, BLOCK_N, BLOCK_K)
    x_cols = x_ptr + rm.to(tl.int64)[None, :] * stride_xm
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + kk
        k_mask = k < K
        a = tl.load(x_cols + k[:, None], mask=k_mask[:, None] & m_mask[None, :], other=0.0)
        w = tl.trans(_weight_tile(qw_ptr, qz_ptr, s_ptr, k, k_mask, k0 // GROUP, NP, N, rp, p_mask, a.dtype, ASM))
        if DOT_IN_F32:  # the interpreter's bf16 tl.dot is wrong; same operands, in fp32
            acc += tl.dot(w.to(tl.float32), a.to(tl.float32))
        else:
            acc = tl.dot(w, a, acc)
    _store_tile(acc, rm.to(tl.int64)[None, :], rn[:, None], n_mask[:, None] & m_mask[None, :], rn, n_mask, pid_s,
                part_ptr, b_ptr, out_ptr, M, N, stride_om, SPLIT, HAS_BIAS, True)


@jit
def _splitk_reduce_kernel(
    part_ptr, b_ptr, out_ptr, M, N, S, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK: tl.constexpr,
):
    # Grid: (M, cdiv(N, BLOCK)). Adds the S partial rows [S, M, N] of one output row, in order.
    row, cols = row_and_cols(BLOCK)
    mask = cols < N
    acc = tl.zeros([BLOCK], tl.float32)
    for s0 in range(0, S, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        offs = (s.to(tl.int64)[:, None] * M + row) * N + cols[None, :]
        acc += tl.sum(tl.load(part_ptr + offs, mask=(s < S)[:, None] & mask[None, :], other=0.0), axis=0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)
