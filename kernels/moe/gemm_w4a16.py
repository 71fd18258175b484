"""The grouped GEMMs of the fused expert MLP on AWQ (W4A16) experts, over ``align.moe_align``'s
layout: ``gemm.py``'s two kernels with each K tile of 4-bit weights dequantized in registers
(``kernels/w4a16``'s ``_weight_tile``: the group's zero and scale, x's dtype) before its
``tl.dot``. The grid, the tile rows and the epilogues are ``gemm.py``'s.

Weights per expert are AutoAWQ's "gemm" triples, stacked on a leading expert dim (the package
doc of ``kernels/w4a16`` gives the layout): ``w13_qweight`` [E, H, 2I/8] (each expert's gate
columns then its up columns, the order ``fused_moe`` reads), ``w13_qzeros`` [E, H/g, 2I/8],
``w13_scales`` [E, H/g, 2I]; ``w2_qweight`` [E, I, H/8], ``w2_qzeros`` [E, I/g, H/8],
``w2_scales`` [E, I/g, H]. A K tile lies in one group (``BLOCK_K`` divides the group size, or one
group covers K), so a tile reads one row of zeros and scales.
"""

# No ``from __future__ import annotations``: Triton reads ``tl.constexpr`` annotations as objects.

from .._triton import jit, tl
from ..w4a16.gemm import _weight_tile
from .gemm import _activate, _tile_rows


@jit
def _gate_up_w4a16_kernel(
    x, qw, qz, sc, h, sorted_pairs, tile_expert, num_pairs, top_k, hidden, inter, stride_x, stride_h,
    stride_qw, stride_qz, stride_sc,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ACT: tl.constexpr, DOT_IN_F32: tl.constexpr, ASM: tl.constexpr,
):
    # h[p] = act(x[t] @ Wg[e]) * (x[t] @ Wu[e]): one program holds the gate and the up tile of the
    # same BLOCK_N columns (packed words rp of the gate half, rp + I/8 of the up half).
    expert, pairs, real = _tile_rows(sorted_pairs, tile_expert, num_pairs, BLOCK_M)
    if expert < 0:
        return
    BLOCK_P: tl.constexpr = BLOCK_N // 8
    np_half = inter // 8
    rp = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    p_mask = rp < np_half
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    e = expert.to(tl.int64)
    qw_e, qz_e, sc_e = qw + e * stride_qw, qz + e * stride_qz, sc + e * stride_sc
    kk = tl.arange(0, BLOCK_K)
    x_rows = x + (pairs // top_k).to(tl.int64)[:, None] * stride_x
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + kk
        k_ok = k < hidden
        a = tl.load(x_rows + k[None, :], mask=real[:, None] & k_ok[None, :], other=0.0)
        g = k0 // GROUP
        wg = _weight_tile(qw_e, qz_e, sc_e, k, k_ok, g, 2 * np_half, 2 * inter, rp, p_mask, a.dtype, ASM)
        wu = _weight_tile(qw_e, qz_e, sc_e, k, k_ok, g, 2 * np_half, 2 * inter, rp + np_half, p_mask, a.dtype, ASM)
        if DOT_IN_F32:  # the interpreter's bf16 tl.dot is wrong; same operands, in fp32
            gate += tl.dot(a.to(tl.float32), wg.to(tl.float32))
            up += tl.dot(a.to(tl.float32), wu.to(tl.float32))
        else:
            gate = tl.dot(a, wg, gate)
            up = tl.dot(a, wu, up)
    out = _activate(gate, ACT) * up
    h_ptrs = h + pairs[:, None].to(tl.int64) * stride_h + cols[None, :]
    tl.store(h_ptrs, out.to(h.dtype.element_ty), mask=real[:, None] & col_ok[None, :])


@jit
def _down_w4a16_kernel(
    h, qw, qz, sc, y, weights, sorted_pairs, tile_expert, num_pairs, hidden, inter, stride_h, stride_y,
    stride_qw, stride_qz, stride_sc,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_IN_F32: tl.constexpr, ASM: tl.constexpr,
):
    # y[p] = weight[p] * (h[p] @ W2[e]), W2[e] the dequantized [I, H] down projection.
    expert, pairs, real = _tile_rows(sorted_pairs, tile_expert, num_pairs, BLOCK_M)
    if expert < 0:
        return
    BLOCK_P: tl.constexpr = BLOCK_N // 8
    rp = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    p_mask = rp < hidden // 8
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    e = expert.to(tl.int64)
    qw_e, qz_e, sc_e = qw + e * stride_qw, qz + e * stride_qz, sc + e * stride_sc
    kk = tl.arange(0, BLOCK_K)
    h_rows = h + pairs[:, None].to(tl.int64) * stride_h
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k = k0 + kk
        k_ok = k < inter
        a = tl.load(h_rows + k[None, :], mask=real[:, None] & k_ok[None, :], other=0.0)
        w = _weight_tile(qw_e, qz_e, sc_e, k, k_ok, k0 // GROUP, hidden // 8, hidden, rp, p_mask, a.dtype, ASM)
        if DOT_IN_F32:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32))
        else:
            acc = tl.dot(a, w, acc)
    # The routing weight in fp32 before the one rounding to the output dtype.
    acc *= tl.load(weights + pairs, mask=real, other=0.0)[:, None]
    y_ptrs = y + pairs[:, None].to(tl.int64) * stride_y + cols[None, :]
    tl.store(y_ptrs, acc.to(y.dtype.element_ty), mask=real[:, None] & col_ok[None, :])
