"""The grouped GEMMs of the fused expert MLP (the package doc), over ``align.moe_align``'s layout.

Grid ``(tiles, cdiv(N, BLOCK_N))``: program ``(i, j)`` takes the ``BLOCK_M`` sorted rows of tile
``i`` (one expert's pairs, padding rows masked) and output columns ``j``. Axis 0 runs fastest, so
the programs in flight together are the tiles of one expert on the same columns: they read the
same weight tile, from L2 after the first. Tiles past the used ones (``tile_expert`` -1) return.

* ``_gate_up_kernel``: ``h[p] = act(x[t] @ w13[e, :I].T) * (x[t] @ w13[e, I:].T)`` for pair
  ``p = t*k + j``; one program holds the gate and the up tile of the same columns, so the [T*k, 2I]
  product is never written.
* ``_down_kernel``: ``y[p] = weight[p] * (h[p] @ w2[e].T)``, one row per pair (the launcher sums
  the k rows of a token; pairs of other ranks' experts stay zero).
"""

# No ``from __future__ import annotations``: Triton reads ``tl.constexpr`` annotations as objects.

from .._triton import jit, tl

ACT_CODES = {"silu": 0, "gelu": 1, "gelu_tanh": 2}


@jit
def _activate(g, ACT: tl.constexpr):
    """The expert's gate activation in fp32 (``ACT_CODES``)."""
    if ACT == 0:
        return g / (1.0 + tl.exp(-g))
    elif ACT == 1:
        return 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))
    else:
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        # tanh(u) = 2 * sigmoid(2u) - 1: exp only, which every backend and the interpreter have.
        return 0.5 * g * (2.0 / (1.0 + tl.exp(-2.0 * inner)))


@jit
def _tile_rows(sorted_pairs, tile_expert, num_pairs, BLOCK_M: tl.constexpr):
    """This program's expert (-1: nothing to do), pair indices and which of them are real."""
    tile = tl.program_id(0)
    expert = tl.load(tile_expert + tile)
    pairs = tl.load(sorted_pairs + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    return expert, pairs, pairs < num_pairs


@jit
def _gate_up_kernel(
    x, w13, h, sorted_pairs, tile_expert, num_pairs, top_k, hidden, inter, stride_x, stride_h,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ACT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    expert, pairs, real = _tile_rows(sorted_pairs, tile_expert, num_pairs, BLOCK_M)
    if expert < 0:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    ks = tl.arange(0, BLOCK_K)
    tokens = (pairs // top_k).to(tl.int64)
    x_ptrs = x + tokens[:, None] * stride_x + ks[None, :]
    # w13[e] is [2I, H] row-major: the [BLOCK_K, BLOCK_N] tile of its transpose walks H down rows.
    w_base = w13 + expert.to(tl.int64) * (2 * inter * hidden)
    g_ptrs = w_base + cols[None, :].to(tl.int64) * hidden + ks[:, None]
    u_ptrs = g_ptrs + inter * hidden
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = ks < hidden - k0
        a = tl.load(x_ptrs, mask=real[:, None] & k_ok[None, :], other=0.0)
        wg = tl.load(g_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        wu = tl.load(u_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        gate = tl.dot(a, wg, gate, input_precision=PRECISION)
        up = tl.dot(a, wu, up, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    out = _activate(gate, ACT) * up
    h_ptrs = h + pairs[:, None].to(tl.int64) * stride_h + cols[None, :]
    tl.store(h_ptrs, out.to(h.dtype.element_ty), mask=real[:, None] & col_ok[None, :])


@jit
def _down_kernel(
    h, w2, y, weights, sorted_pairs, tile_expert, num_pairs, hidden, inter, stride_h, stride_y,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    expert, pairs, real = _tile_rows(sorted_pairs, tile_expert, num_pairs, BLOCK_M)
    if expert < 0:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    ks = tl.arange(0, BLOCK_K)
    h_ptrs = h + pairs[:, None].to(tl.int64) * stride_h + ks[None, :]
    # w2[e] is [H, I] row-major: the tile of its transpose walks I down rows.
    w_ptrs = w2 + expert.to(tl.int64) * (hidden * inter) + cols[None, :].to(tl.int64) * inter + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_ok = ks < inter - k0
        a = tl.load(h_ptrs, mask=real[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    # The routing weight in fp32 before the one rounding to the output dtype.
    acc *= tl.load(weights + pairs, mask=real, other=0.0)[:, None]
    y_ptrs = y + pairs[:, None].to(tl.int64) * stride_y + cols[None, :]
    tl.store(y_ptrs, acc.to(y.dtype.element_ty), mask=real[:, None] & col_ok[None, :])


@jit
def _sum_slots_kernel(y, out, ids, num_experts, hidden, stride_y, stride_out, TOP_K: tl.constexpr,
                      BLOCK: tl.constexpr):
    """``out[t] = sum_j y[t*k + j]`` over the slots whose expert is in [0, E) (rows of other
    ranks' experts were never written), in fp32 with one rounding, as torch's half sum does."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_ok = cols < hidden
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        # The slot's expert, broadcast over the columns (a vector mask, which every backend takes).
        e = tl.load(ids + t * TOP_K + j + tl.zeros((BLOCK,), dtype=tl.int64))
        mine = col_ok & (e >= 0) & (e < num_experts)
        acc += tl.load(y + (t * TOP_K + j) * stride_y + cols, mask=mine, other=0.0).to(tl.float32)
    tl.store(out + t * stride_out + cols, acc.to(out.dtype.element_ty), mask=col_ok)
