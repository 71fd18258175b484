"""The grouped GEMMs of the fused expert MLP on W8A8 (SmoothQuant int8) experts, over
``align.moe_align``'s layout: ``gemm.py``'s two kernels with int8 x int8 tiles summed exactly in
int32 and both scales applied in the fp32 epilogue (``kernels/w8a8``'s dense GEMM does the same).
The grid, the tile rows, the activation and the routing weight are ``gemm.py``'s.

Weights per expert are compressed-tensors' int8 layout stacked on a leading expert dim:
``w13`` int8 [E, 2I, H] (each expert's gate rows then its up rows, ``fused_moe``'s order) with
``w13_scale`` fp32 [E, 2I] (one per output channel), ``w2`` int8 [E, H, I] with ``w2_scale``
fp32 [E, H]. Activations come quantized per row: x per token (``xq`` [T, H], ``x_scale`` [T]),
the intermediate per (token, slot) pair (``hq`` [T*k, I], ``h_scale`` [T*k]).

* ``_gate_up_w8a8_kernel``: ``h[p] = act(g) * u`` with ``g = (xq[t] @ w13[e, :I].T) * x_scale[t]
  * w13_scale[e, :I]`` (``u`` the same on the up rows), rounded once to h's dtype;
* ``_down_w8a8_kernel``: ``y[p] = (hq[p] @ w2[e].T) * h_scale[p] * w2_scale[e] * weight[p]``.
"""

# No ``from __future__ import annotations``: Triton reads ``tl.constexpr`` annotations as objects.

from .._triton import jit, tl
from .gemm import _activate, _tile_rows


@jit
def _gate_up_w8a8_kernel(
    xq, x_scale, w13, w13_scale, h, sorted_pairs, tile_expert, num_pairs, top_k, hidden, inter, stride_x,
    stride_h, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ACT: tl.constexpr,
):
    expert, pairs, real = _tile_rows(sorted_pairs, tile_expert, num_pairs, BLOCK_M)
    if expert < 0:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    ks = tl.arange(0, BLOCK_K)
    tokens = (pairs // top_k).to(tl.int64)
    x_ptrs = xq + tokens[:, None] * stride_x + ks[None, :]
    e = expert.to(tl.int64)
    # w13[e] is [2I, H] row-major: the tile of its transpose walks H down rows (K-major, as int8
    # wgmma wants its B operand).
    g_ptrs = w13 + e * (2 * inter * hidden) + cols[None, :].to(tl.int64) * hidden + ks[:, None]
    u_ptrs = g_ptrs + inter * hidden
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = ks < hidden - k0
        a = tl.load(x_ptrs, mask=real[:, None] & k_ok[None, :], other=0)
        wg = tl.load(g_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0)
        wu = tl.load(u_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0)
        gate = tl.dot(a, wg, gate, out_dtype=tl.int32)
        up = tl.dot(a, wu, up, out_dtype=tl.int32)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    # Both scales in fp32, in the reference's order: (acc * s_x) * s_w.
    sx = tl.load(x_scale + tokens, mask=real, other=0.0)[:, None]
    s_base = w13_scale + e * (2 * inter) + cols
    sg = tl.load(s_base, mask=col_ok, other=0.0)[None, :]
    su = tl.load(s_base + inter, mask=col_ok, other=0.0)[None, :]
    out = _activate(gate.to(tl.float32) * sx * sg, ACT) * (up.to(tl.float32) * sx * su)
    h_ptrs = h + pairs[:, None].to(tl.int64) * stride_h + cols[None, :]
    tl.store(h_ptrs, out.to(h.dtype.element_ty), mask=real[:, None] & col_ok[None, :])


@jit
def _down_w8a8_kernel(
    hq, h_scale, w2, w2_scale, y, weights, sorted_pairs, tile_expert, num_pairs, hidden, inter, stride_h, stride_y,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    expert, pairs, real = _tile_rows(sorted_pairs, tile_expert, num_pairs, BLOCK_M)
    if expert < 0:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    ks = tl.arange(0, BLOCK_K)
    h_ptrs = hq + pairs[:, None].to(tl.int64) * stride_h + ks[None, :]
    e = expert.to(tl.int64)
    # w2[e] is [H, I] row-major: the tile of its transpose walks I down rows.
    w_ptrs = w2 + e * (hidden * inter) + cols[None, :].to(tl.int64) * inter + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, inter, BLOCK_K):
        k_ok = ks < inter - k0
        a = tl.load(h_ptrs, mask=real[:, None] & k_ok[None, :], other=0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0)
        acc = tl.dot(a, w, acc, out_dtype=tl.int32)
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    sh = tl.load(h_scale + pairs, mask=real, other=0.0)[:, None]
    sw = tl.load(w2_scale + e * hidden + cols, mask=col_ok, other=0.0)[None, :]
    out = acc.to(tl.float32) * sh * sw
    # The routing weight in fp32 before the one rounding to the output dtype.
    out *= tl.load(weights + pairs, mask=real, other=0.0)[:, None]
    y_ptrs = y + pairs[:, None].to(tl.int64) * stride_y + cols[None, :]
    tl.store(y_ptrs, out.to(y.dtype.element_ty), mask=real[:, None] & col_ok[None, :])
