"""Segmented LoRA kernels (S-LoRA / Punica's shrink and expand): many adapters in one batch.

Beside a linear layer's output ``y = x W^T`` the engine adds, for each token, its adapter's
``(x A^T) B^T`` (the adapter's scaling folded into ``B``). Every adapter the engine may run sits
in one slot of a pool: ``a`` [slots, N, K], ``b`` [slots, M, R]. The step's tokens are grouped
into segments by slot (``LoRASegments``: the host sorts them, ``engine/lora/segments.py``), and
each kernel runs every segment with its own slot's weights:

* **shrink**: ``low[t] = x[t] @ a[slot]^T`` ([T, N], N = parts * R: a fused linear such as q|k|v
  or gate|up has one ``A`` block of R rows per part, all reading the same input). A skinny GEMM
  with a long K: at decode sizes (a few rows per segment) K is split over ``split_k`` programs,
  each writing its own float32 partial product (no atomics, no zeroing), so that one token's
  ``A`` is read by many SMs at once;
* **expand**: ``y[t, part p's columns] += low[t, p*R:(p+1)*R] @ b[slot, part p's columns]^T``,
  summing the split-K partials as it loads ``low``; each program's columns lie in one part.

Both are safe inside a CUDA graph: no host sync, a launch grid that depends only on host ints
(rows, ``max_len``, segments), early exits for a segment shorter than the grid or marked -1 (the
decode graphs' padding). Rows in no segment are never read or written.

The torch references (``*_ref``) loop over segments and read the segment table on the host: they
are for the CPU and the tests, not for graphs.
"""

# No ``from __future__ import annotations``: Triton reads ``tl.constexpr`` annotations as objects.

import math
from typing import NamedTuple

import torch

from ._triton import FLOAT_DTYPES, cdiv, jit, next_pow2, tl, triton_takes


class LoRASegments(NamedTuple):
    """Which rows of x / y use which pool slot."""

    token_order: torch.Tensor  # int32 [L]: row indices of x / y, grouped by segment
    seg_start: torch.Tensor  # int32 [S + 1]: segment s is token_order[seg_start[s]:seg_start[s + 1]]
    seg_slot: torch.Tensor  # int32 [S]: the pool slot of segment s; -1: skip the segment (padding)
    max_len: int  # host int: no segment is longer (sizes the launch grid)


# ---- references -------------------------------------------------------------------------------


def _segments(seg: LoRASegments):
    """(slot, rows) of each non-empty segment with a slot (host reads: reference only)."""
    starts, slots = seg.seg_start.tolist(), seg.seg_slot.tolist()
    for s, slot in enumerate(slots):
        if slot >= 0 and starts[s + 1] > starts[s]:
            yield slot, seg.token_order[starts[s]:starts[s + 1]].long()


def lora_shrink_ref(x: torch.Tensor, a: torch.Tensor, seg: LoRASegments, split_k: int | None = None) -> torch.Tensor:
    """float32 ``[1, T, N]``: row t of a segment is ``x[t] @ a[slot]^T``; other rows are zeros here
    (undefined in the kernel's output). ``split_k`` is the kernel's business; the reference uses one."""
    out = torch.zeros(1, x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    for slot, rows in _segments(seg):
        out[0, rows] = x[rows].float() @ a[slot].float().t()
    return out


def lora_expand_ref(y: torch.Tensor, partial: torch.Tensor, b: torch.Tensor, seg: LoRASegments,
                    part_sizes: tuple[int, ...]) -> None:
    """In place: ``y[t, part p] += sum_s partial[s, t, p*R:(p+1)*R] @ b[slot, part p]^T`` for the rows
    of every segment, rounded once to y's dtype."""
    rank = b.shape[2]
    for slot, rows in _segments(seg):
        low = partial[:, rows].sum(0)
        deltas, col = [], 0
        for p, size in enumerate(part_sizes):
            deltas.append(low[:, p * rank:(p + 1) * rank] @ b[slot, col:col + size].float().t())
            col += size
        y[rows] = (y[rows].float() + torch.cat(deltas, 1)).to(y.dtype)


# ---- kernels ------------------------------------------------------------------------------------


@jit
def _segment_rows(order_ptr, start_ptr, slot_ptr, BLOCK_M: tl.constexpr):
    """This program's segment slot, and its block of rows (indices into x / y) with their mask."""
    seg = tl.program_id(0)
    slot = tl.load(slot_ptr + seg)
    first = tl.load(start_ptr + seg)
    count = tl.load(start_ptr + seg + 1) - first
    offs = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = offs < count
    rows = tl.load(order_ptr + first + offs, mask=mask, other=0).to(tl.int64)
    return slot, count, rows, mask


@jit
def _shrink_kernel(
    x_ptr, a_ptr, out_ptr, order_ptr, start_ptr, slot_ptr,
    N, K, k_per_split, stride_x, stride_a_slot, stride_out_split, stride_out_row,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # Grid: (segments, cdiv(max_len, BLOCK_M), split_k). Each program multiplies its segment's
    # BLOCK_M rows of x by the slot's A over one split of K, into its own partial product.
    slot, count, rows, mask_m = _segment_rows(order_ptr, start_ptr, slot_ptr, BLOCK_M)
    if (slot < 0) | (tl.program_id(1) * BLOCK_M >= count):
        return
    k_lo = tl.program_id(2) * k_per_split
    offs_n = tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    a_base = a_ptr + slot.to(tl.int64) * stride_a_slot
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_lo, k_lo + k_per_split, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        xs = tl.load(x_ptr + rows[:, None] * stride_x + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                     other=0.0)
        at = tl.load(a_base + offs_n[None, :] * K + offs_k[:, None], mask=mask_k[:, None] & mask_n[None, :],
                     other=0.0)
        acc += tl.dot(xs, at)
    out = out_ptr + tl.program_id(2) * stride_out_split + rows[:, None] * stride_out_row + offs_n[None, :]
    tl.store(out, acc, mask=mask_m[:, None] & mask_n[None, :])


@jit
def _expand_kernel(
    y_ptr, p_ptr, b_ptr, order_ptr, start_ptr, slot_ptr,
    M, bound1, bound2, stride_y, stride_p_split, stride_p_row, stride_b_slot,
    SPLIT_K: tl.constexpr, RANK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    # Grid: (segments, cdiv(max_len, BLOCK_M), cdiv(M, BLOCK_N)). Each program adds its segment's
    # rows' delta to BLOCK_N columns of y, which lie in one part (the launcher picks BLOCK_N so).
    slot, count, rows, mask_m = _segment_rows(order_ptr, start_ptr, slot_ptr, BLOCK_M)
    if (slot < 0) | (tl.program_id(1) * BLOCK_M >= count):
        return
    n0 = tl.program_id(2) * BLOCK_N
    part = (n0 >= bound1).to(tl.int32) + (n0 >= bound2).to(tl.int32)
    offs_r = tl.arange(0, RANK)
    low = tl.zeros((BLOCK_M, RANK), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        low += tl.load(p_ptr + s * stride_p_split + rows[:, None] * stride_p_row + part * RANK + offs_r[None, :],
                       mask=mask_m[:, None], other=0.0)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < M
    bt = tl.load(b_ptr + slot.to(tl.int64) * stride_b_slot + offs_n[None, :] * RANK + offs_r[:, None],
                 mask=mask_n[None, :], other=0.0)
    if FP32_DOT:  # a float32 pool: keep the product in float32 (no TF32 rounding)
        delta = tl.dot(low, bt.to(tl.float32), input_precision="ieee")
    else:  # 16-bit weights: tensor cores, float32 accumulation
        delta = tl.dot(low.to(bt.dtype), bt)
    y_tile = y_ptr + rows[:, None] * stride_y + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    y = tl.load(y_tile, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_tile, (y + delta).to(y_ptr.dtype.element_ty), mask=mask)


def _block_m(max_len: int) -> int:
    """Rows per program: 16 at decode sizes (the fewest tl.dot takes), more for prefill chunks."""
    return 16 if max_len <= 16 else 32 if max_len <= 64 else 64


def shrink_split(max_len: int, k: int, block_k: int = 64) -> int:
    """K splits of the shrink: at decode sizes a segment's few rows would leave one program to read
    a whole slot's A (K up to 11,008) alone, so K goes to up to 16 programs of at least 256
    columns; prefill-sized segments bring enough programs of their own (1)."""
    if max_len > 64:
        return 1
    return max(1, min(16, k // (4 * block_k)))


def _expand_block_n(part_sizes: tuple[int, ...]) -> int:
    """The widest power of two <= 128 dividing every part size: a program's columns in one part."""
    g = math.gcd(*part_sizes) if len(part_sizes) > 1 else part_sizes[0]
    return min(128, g & -g)


def lora_shrink_triton(x: torch.Tensor, a: torch.Tensor, seg: LoRASegments, split_k: int | None = None) -> torch.Tensor:
    """Triton launcher for :func:`lora_shrink_ref` (float32 ``[split_k, T, N]`` partials)."""
    t, k = x.shape
    n = a.shape[1]
    split = split_k or shrink_split(seg.max_len, k)
    block_k = 64
    k_per = cdiv(cdiv(k, split), block_k) * block_k
    split = cdiv(k, k_per)
    out = torch.empty(split, t, n, dtype=torch.float32, device=x.device)
    segments = seg.seg_slot.numel()
    if t and segments and seg.max_len:
        block_m = _block_m(seg.max_len)
        grid = (segments, cdiv(seg.max_len, block_m), split)
        _shrink_kernel[grid](x, a, out, seg.token_order, seg.seg_start, seg.seg_slot,
                             n, k, k_per, x.stride(0), a.stride(0), out.stride(0), out.stride(1),
                             BLOCK_M=block_m, BLOCK_N=max(16, next_pow2(n)), BLOCK_K=block_k, num_warps=4)
    return out


def lora_expand_triton(y: torch.Tensor, partial: torch.Tensor, b: torch.Tensor, seg: LoRASegments,
                       part_sizes: tuple[int, ...]) -> None:
    """Triton launcher for :func:`lora_expand_ref`."""
    m, rank = b.shape[1], b.shape[2]
    bounds = [m, m]
    for i in range(1, len(part_sizes)):
        bounds[i - 1] = sum(part_sizes[:i])
    segments = seg.seg_slot.numel()
    if not (y.shape[0] and segments and seg.max_len):
        return
    block_m, block_n = _block_m(seg.max_len), _expand_block_n(part_sizes)
    grid = (segments, cdiv(seg.max_len, block_m), cdiv(m, block_n))
    _expand_kernel[grid](y, partial, b, seg.token_order, seg.seg_start, seg.seg_slot,
                         m, bounds[0], bounds[1], y.stride(0), partial.stride(0), partial.stride(1), b.stride(0),
                         SPLIT_K=partial.shape[0], RANK=rank, BLOCK_M=block_m, BLOCK_N=block_n,
                         FP32_DOT=b.dtype == torch.float32, num_warps=4)


def _shrink_problem(x: torch.Tensor, a: torch.Tensor) -> str | None:
    if x.dtype not in FLOAT_DTYPES or a.dtype != x.dtype:
        return f"dtypes {x.dtype} / {a.dtype}"
    if x.dim() != 2 or x.stride(1) != 1 or not a.is_contiguous():
        return "x must be [T, K] with unit column stride and a contiguous"
    if a.shape[1] % 16 or a.shape[1] > 256:
        return f"N={a.shape[1]}: a multiple of 16 up to 256"
    return None


def _expand_problem(y: torch.Tensor, b: torch.Tensor, part_sizes: tuple[int, ...]) -> str | None:
    if y.dtype not in FLOAT_DTYPES or b.dtype != y.dtype:
        return f"dtypes {y.dtype} / {b.dtype}"
    if y.dim() != 2 or y.stride(1) != 1 or not b.is_contiguous():
        return "y must be [T, M] with unit column stride and b contiguous"
    if b.shape[2] % 16 or not 1 <= len(part_sizes) <= 3 or sum(part_sizes) != b.shape[1]:
        return f"rank {b.shape[2]} (a multiple of 16), parts {part_sizes} (1 to 3, summing to {b.shape[1]})"
    if _expand_block_n(part_sizes) < 16:
        return f"part sizes {part_sizes}: multiples of 16"
    return None


def lora_shrink(x: torch.Tensor, a: torch.Tensor, seg: LoRASegments, split_k: int | None = None) -> torch.Tensor:
    """float32 partial products ``[split_k, T, N]``; summed over dim 0 they are ``x[t] @ a[slot]^T``
    for every row t in a segment (other rows undefined, never read). Triton on CUDA, else the
    reference."""
    if triton_takes("lora_shrink", (x, a), _shrink_problem, x, a):
        return lora_shrink_triton(x, a, seg, split_k)
    return lora_shrink_ref(x, a, seg, split_k)


def lora_expand(y: torch.Tensor, partial: torch.Tensor, b: torch.Tensor, seg: LoRASegments,
                part_sizes: tuple[int, ...]) -> None:
    """In place: ``y[t, part p's columns] += sum_s partial[s, t, p*R:(p+1)*R] @ b[slot, part p's
    columns, :]^T`` (rounded once to y's dtype) for every row t in a segment; other rows untouched."""
    if triton_takes("lora_expand", (y, partial, b), _expand_problem, y, b, part_sizes):
        lora_expand_triton(y, partial, b, seg, part_sizes)
    else:
        lora_expand_ref(y, partial, b, seg, part_sizes)
