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

The Triton kernels take float16, bfloat16 or float32 ``x`` / ``y`` with ``a`` / ``b`` of the same
dtype, unit stride along the last dimension of each (a pool slice such as ``a[layer]`` is fine),
a rank R that is a multiple of 16 (tl.dot's least; the pool pads ranks), one to three parts whose
sizes are multiples of 16, and contiguous int32 segment tensors; the products accumulate in
float32. How the programs are laid out (rows per program, K splits, warps) is one function,
:func:`launch_plan`. Other inputs go to the references (``ref`` / ``auto``) or raise (``triton``).

The torch references (``*_ref``) loop over segments and read the segment table on the host: they
are for the CPU and the tests, not for graphs.
"""

# No ``from __future__ import annotations``: Triton reads ``tl.constexpr`` annotations as objects.

import math
from typing import NamedTuple

import torch

from ._triton import FLOAT_DTYPES, TRITON_INTERPRETED, cdiv, jit, next_pow2, sm_count, tl, triton_takes


class LoRASegments(NamedTuple):
    """Which rows of x / y use which pool slot."""

    token_order: torch.Tensor  # int32 [L]: row indices of x / y, grouped by segment (L >= their total)
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
    """This program's segment slot, the segment's length, and its block of rows (indices into
    x / y, int64 for addresses) with their mask."""
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
    N, K, k_per_split, n_blocks, stride_x, stride_a_slot, stride_a_row, stride_out_split, stride_out_row,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):
    # Grid: (segments, cdiv(max_len, BLOCK_M), split_k * n_blocks). Each program multiplies its
    # segment's BLOCK_M rows of x by BLOCK_N rows of the slot's A over one split of K, into its own
    # float32 partial product: no atomics, no zeroing.
    slot, count, rows, mask_m = _segment_rows(order_ptr, start_ptr, slot_ptr, BLOCK_M)
    if (slot < 0) | (tl.program_id(1) * BLOCK_M >= count):  # padding, or past this segment's rows
        return
    split = tl.program_id(2) // n_blocks
    offs_n = (tl.program_id(2) % n_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    k_lo = split * k_per_split
    a_base = a_ptr + slot.to(tl.int64) * stride_a_slot
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_lo, k_lo + k_per_split, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        xs = tl.load(x_ptr + rows[:, None] * stride_x + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                     other=0.0)
        at = tl.load(a_base + offs_n[None, :] * stride_a_row + offs_k[:, None], mask=mask_k[:, None] & mask_n[None, :],
                     other=0.0)
        if IEEE:  # float32 inputs: no TF32 rounding (tl.dot's default for them); see _ieee_shrink
            acc += tl.dot(xs.to(tl.float32), at.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(xs, at)
    out = out_ptr + split * stride_out_split + rows[:, None] * stride_out_row + offs_n[None, :]
    tl.store(out, acc, mask=mask_m[:, None] & mask_n[None, :])


@jit
def _expand_kernel(
    y_ptr, p_ptr, b_ptr, order_ptr, start_ptr, slot_ptr,
    M, bound1, bound2, stride_y, stride_p_split, stride_p_row, stride_b_slot, stride_b_row,
    SPLIT_K: tl.constexpr, RANK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT: tl.constexpr,
):
    # Grid: (segments, cdiv(max_len, BLOCK_M), cdiv(M, BLOCK_N)). Each program adds its segment's
    # rows' delta to BLOCK_N columns of y, which lie in one part (the launcher picks BLOCK_N so):
    # the part is found from the part boundaries, and the program reads that part's R columns of
    # the low-rank product, summing the split-K partials as it loads them.
    slot, count, rows, mask_m = _segment_rows(order_ptr, start_ptr, slot_ptr, BLOCK_M)
    if (slot < 0) | (tl.program_id(1) * BLOCK_M >= count):
        return
    n0 = tl.program_id(2) * BLOCK_N
    part = (n0 >= bound1).to(tl.int32) + (n0 >= bound2).to(tl.int32)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < M
    b_base = b_ptr + slot.to(tl.int64) * stride_b_slot
    delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in tl.static_range(0, RANK, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        low = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            low += tl.load(p_ptr + s * stride_p_split + rows[:, None] * stride_p_row + part * RANK + offs_r[None, :],
                           mask=mask_m[:, None], other=0.0)
        bt = tl.load(b_base + offs_n[None, :] * stride_b_row + offs_r[:, None], mask=mask_n[None, :], other=0.0)
        if DOT == 0:  # float16: tensor cores; rounding low to fp16 costs no more than TF32 would
            delta += tl.dot(low.to(bt.dtype), bt)
        elif DOT == 1:  # bfloat16: TF32 keeps 10 bits of low (bf16 would keep 7, as coarse as y itself)
            delta += tl.dot(low, bt.to(tl.float32), input_precision="tf32")
        else:  # float32: exact products
            delta += tl.dot(low, bt, input_precision="ieee")
    y_tile = y_ptr + rows[:, None] * stride_y + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    y = tl.load(y_tile, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_tile, (y + delta).to(y_ptr.dtype.element_ty), mask=mask)


# ---- launch policy ------------------------------------------------------------------------------


class LaunchPlan(NamedTuple):
    """Block sizes, K splits and warps of one shrink / expand pair (:func:`launch_plan`)."""

    block_m: int  # rows of a segment per program (both kernels)
    shrink_block_n: int  # columns of N (parts * R) per shrink program
    block_k: int  # K per shrink loop step
    split_k: int  # shrink programs along K (the partials' first dimension)
    num_warps: int


def _block_m(max_len: int) -> int:
    """Rows of a segment per program (both kernels): 16, the fewest tl.dot takes, up to 64-row
    segments (decode: a few rows each; a graph sized for 64 rows with 8 slots launches 8 x 4 row
    blocks, of which the unused exit at once); 32 up to 128 rows, then 64 (prefill chunks)."""
    return 16 if max_len <= 64 else 32 if max_len <= 128 else 64


def launch_plan(t: int, max_len: int, segments: int, k: int, n: int, sms: int,
                split_k: int | None = None) -> LaunchPlan:
    """The shrink's launch policy, from host ints only (graph-safe); ``split_k`` forces a split.

    * ``block_m``: :func:`_block_m`.
    * ``shrink_block_n``: all of N in one tile up to 128 (N = parts * R: 48 for q|k|v at rank 16,
      so x is read once); a wider N is tiled by 128.
    * ``split_k``: the shrink is a skinny GEMM with a long K (4,096 or 11,008): a decode segment's
      few rows would leave one program to read a whole slot's A. K is split until the programs
      that have rows to work on fill about one wave (``sms``). Those are at most
      ``cdiv(t, block_m) + segments - 1`` row blocks whatever ``max_len`` says (a decode graph
      passes its batch size there, though its rows are spread over the slots). Each split keeps
      >= 256 columns of K and there are at most 16 (the expand sums the partials in registers).
      From 1,024 rows (prefill) the row blocks fill the machine themselves: 1 split, no partials
      beyond one.
    * ``block_k``: 128 when each split spans that much (fewer loop steps), else 64.
    * ``num_warps``: 4; 8 for a 64 x 128 float32 accumulator.
    """
    block_m = _block_m(max_len)
    block_n = min(128, max(16, next_pow2(n)))
    busy_rows = min(segments * cdiv(max_len, block_m), cdiv(t, block_m) + max(segments - 1, 0))
    row_programs = max(1, busy_rows * cdiv(n, block_n))
    if split_k is None:
        split_k = 1 if t >= 1024 else max(1, min(16, cdiv(sms, row_programs), k // 256))
    block_k = 128 if cdiv(k, split_k) >= 128 else 64
    num_warps = 8 if block_m * block_n >= 64 * 128 else 4
    return LaunchPlan(block_m, block_n, block_k, split_k, num_warps)


def _expand_block_n(part_sizes: tuple[int, ...]) -> int:
    """The widest power of two <= 128 dividing every part size: a program's columns in one part."""
    g = math.gcd(*part_sizes)
    return min(128, g & -g)


def _rank_block(rank: int) -> int:
    """Rank columns per expand step: the widest power of two <= 64 dividing R (R may be 48)."""
    return min(64, rank & -rank)


def lora_shrink_triton(x: torch.Tensor, a: torch.Tensor, seg: LoRASegments, split_k: int | None = None) -> torch.Tensor:
    """Triton launcher for :func:`lora_shrink_ref` (float32 ``[split_k, T, N]`` partials; the
    split count may come out lower than asked, so that no split is empty)."""
    t, k = x.shape
    n = a.shape[1]
    segments = seg.seg_slot.numel()
    plan = launch_plan(t, seg.max_len, segments, k, n, sm_count(x.device), split_k)
    block_k = plan.block_k
    k_per = cdiv(cdiv(k, plan.split_k), block_k) * block_k
    split = cdiv(k, k_per)
    out = torch.empty(split, t, n, dtype=torch.float32, device=x.device)
    if t and segments and seg.max_len:
        n_blocks = cdiv(n, plan.shrink_block_n)
        grid = (segments, cdiv(seg.max_len, plan.block_m), split * n_blocks)
        _shrink_kernel[grid](x, a, out, seg.token_order, seg.seg_start, seg.seg_slot,
                             n, k, k_per, n_blocks, x.stride(0), a.stride(0), a.stride(1), out.stride(0),
                             out.stride(1), BLOCK_M=plan.block_m, BLOCK_N=plan.shrink_block_n, BLOCK_K=block_k,
                             IEEE=_ieee_shrink(x.dtype), num_warps=plan.num_warps)
    return out


def _ieee_shrink(dtype: torch.dtype) -> bool:
    """Whether the shrink multiplies in float32: float32 inputs, and bfloat16 ones under the
    interpreter, whose bfloat16 tl.dot returns garbage (Triton 3.9 on CPU). A bfloat16 product is
    exact in float32, so only the summation order differs from the tensor cores' bf16 dot."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and TRITON_INTERPRETED)


_DOT_MODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}


def lora_expand_triton(y: torch.Tensor, partial: torch.Tensor, b: torch.Tensor, seg: LoRASegments,
                       part_sizes: tuple[int, ...]) -> None:
    """Triton launcher for :func:`lora_expand_ref`."""
    m, rank = b.shape[1], b.shape[2]
    bounds = [m, m]  # where parts 1 and 2 start (M: no such part)
    for i in range(1, len(part_sizes)):
        bounds[i - 1] = sum(part_sizes[:i])
    segments = seg.seg_slot.numel()
    if not (y.shape[0] and segments and seg.max_len):
        return
    block_m = _block_m(seg.max_len)
    block_n = _expand_block_n(part_sizes)
    grid = (segments, cdiv(seg.max_len, block_m), cdiv(m, block_n))
    _expand_kernel[grid](y, partial, b, seg.token_order, seg.seg_start, seg.seg_slot,
                         m, bounds[0], bounds[1], y.stride(0), partial.stride(0), partial.stride(1), b.stride(0),
                         b.stride(1), SPLIT_K=partial.shape[0], RANK=rank, BLOCK_R=_rank_block(rank),
                         BLOCK_M=block_m, BLOCK_N=block_n, DOT=_DOT_MODES[y.dtype], num_warps=4)


def _shrink_problem(x: torch.Tensor, a: torch.Tensor, seg: LoRASegments) -> str | None:
    if x.dtype not in FLOAT_DTYPES or a.dtype != x.dtype:
        return f"dtypes {x.dtype} / {a.dtype}: x and a both float16, bfloat16 or float32"
    if x.dim() != 2 or a.dim() != 3 or a.shape[2] != x.shape[1]:
        return f"x {tuple(x.shape)} / a {tuple(a.shape)}: x [T, K] and a [slots, N, K]"
    if x.stride(1) != 1 or a.stride(2) != 1:
        return "x and a need unit stride along K"
    if a.shape[1] % 16:
        return f"N={a.shape[1]}: a multiple of 16 (parts x a rank padded to 16)"
    return _segments_problem(seg)


def _expand_problem(y: torch.Tensor, partial: torch.Tensor, b: torch.Tensor, part_sizes: tuple[int, ...],
                    seg: LoRASegments) -> str | None:
    if y.dtype not in FLOAT_DTYPES or b.dtype != y.dtype or partial.dtype != torch.float32:
        return f"dtypes y {y.dtype} / b {b.dtype} / partial {partial.dtype}: y and b alike, partial float32"
    if y.dim() != 2 or b.dim() != 3 or partial.dim() != 3 or y.stride(1) != 1 or b.stride(2) != 1 \
            or partial.stride(2) != 1:
        return "y [T, M], b [slots, M, R] and partial [splits, T, N], each with unit stride along its last dim"
    rank = b.shape[2]
    if rank % 16 or not 1 <= len(part_sizes) <= 3 or sum(part_sizes) != b.shape[1] or b.shape[1] != y.shape[1]:
        return f"rank {rank} (a multiple of 16), parts {part_sizes} (1 to 3, summing to {b.shape[1]} = y's columns)"
    if partial.shape[2] != len(part_sizes) * rank or partial.shape[1] != y.shape[0]:
        return f"partial {tuple(partial.shape)}: [splits, {y.shape[0]}, {len(part_sizes) * rank}] expected"
    if _expand_block_n(part_sizes) < 16:
        return f"part sizes {part_sizes}: multiples of 16"
    return _segments_problem(seg)


def _segments_problem(seg: LoRASegments) -> str | None:
    for name in ("token_order", "seg_start", "seg_slot"):
        t = getattr(seg, name)
        if t.dtype != torch.int32 or t.dim() != 1 or (t.stride(0) != 1 and t.numel() > 1):
            return f"seg.{name}: a contiguous 1-D int32 tensor"
    if seg.seg_start.numel() != seg.seg_slot.numel() + 1:
        return "seg.seg_start needs one entry more than seg.seg_slot"
    return None


def _seg_tensors(seg: LoRASegments) -> tuple[torch.Tensor, ...]:
    return seg.token_order, seg.seg_start, seg.seg_slot


def lora_shrink(x: torch.Tensor, a: torch.Tensor, seg: LoRASegments, split_k: int | None = None) -> torch.Tensor:
    """float32 partial products ``[split_k, T, N]``; summed over dim 0 they are ``x[t] @ a[slot]^T``
    for every row t in a segment (other rows undefined, never read). ``split_k`` None: the policy
    (:func:`launch_plan`) picks. Triton on CUDA, else the reference."""
    if triton_takes("lora_shrink", (x, a, *_seg_tensors(seg)), _shrink_problem, x, a, seg):
        return lora_shrink_triton(x, a, seg, split_k)
    return lora_shrink_ref(x, a, seg, split_k)


def lora_expand(y: torch.Tensor, partial: torch.Tensor, b: torch.Tensor, seg: LoRASegments,
                part_sizes: tuple[int, ...]) -> None:
    """In place: ``y[t, part p's columns] += sum_s partial[s, t, p*R:(p+1)*R] @ b[slot, part p's
    columns, :]^T`` (rounded once to y's dtype) for every row t in a segment; other rows untouched.
    R = b.shape[2], N = partial.shape[2] = len(part_sizes) * R."""
    tensors = (y, partial, b, *_seg_tensors(seg))
    if triton_takes("lora_expand", tensors, _expand_problem, y, partial, b, tuple(part_sizes), seg):
        lora_expand_triton(y, partial, b, seg, tuple(part_sizes))
    else:
        lora_expand_ref(y, partial, b, seg, part_sizes)
