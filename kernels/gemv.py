"""Skinny matrix products for decode: ``y = x @ W.T`` with few rows in ``x`` (batch-1 decode).

At batch 1 a decode step is a chain of matrix-vector products that must stream every weight
once; their speed is the share of memory bandwidth they reach. This kernel is the candidate to
stand in for cuBLAS there: each program owns ``BLOCK_N`` output features, streams their weight
rows in ``BLOCK_K`` slices once, and applies each slice to all ``M`` rows of ``x`` (``M`` is at
most ``MAX_ROWS``: the weights are read once however many rows share them). No split over K,
so no second reduction kernel; the many output tiles of every Llama projection (>= 256 with
16-row tiles) keep all SMs streaming. Accumulation is float32. Whether it beats cuBLAS is
measured by ``benchmarks/gemv_vs_cublas.py`` and end to end by ``profile_generation``; the
model uses it only where it does (``LAYER_ROWS``).
"""

# No ``from __future__ import annotations``: Triton reads ``tl.constexpr`` annotations as objects.

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ._triton import FLOAT_DTYPES, cdiv, gdc_wait, jit, next_pow2, pdl_trigger, tl, triton_takes
from .lora import LoRASegments, lora_expand

MAX_ROWS = 4  # rows of x the kernel takes
# Rows up to which the model's layers use this kernel instead of cuBLAS. Measured on an H100
# (Llama-2-7B shape, fp16): at 1 row the projections read the weights at ~2.9 TB/s against
# cuBLAS's ~2.66 (batch-1 decode 182.1 vs 168.5 tok/s); at 4 rows a decode step took 10.6 ms,
# far slower than cuBLAS (the four per-row reductions per tile cost more than the reads).
LAYER_ROWS = 1
# (output features a program, warps) of a launch: one row (every decode projection at batch 1),
# and more. Replayed from CUDA graphs on an H200 (``benchmarks/gemv_vs_cublas.py [--tp 2]``) the
# Llama-2-7B projections took 3,275 µs a token with the one-row tile against 3,496 with the other
# (1,762 against 1,963 for a rank of tp=2), within 1 % of the fastest of 51 configurations; more
# rows keep the tile picked on an H100 (not re-measured).
ONE_ROW_TILE = (4, 4)
ROWS_TILE = (16, 8)
# One row with a LoRA epilogue (``GemvLoRA``): every program first reads the shrink's split-K
# partials for its features, a fixed cost a program, so fewer, wider programs win. H200, Llama-2-7B's
# four adapted projections, shrink + GEMV replayed from CUDA graphs (`python -m
# benchmarks.bench_lora_kernels --rows 1 --gemv-tiles 4x4 8x4 16x4 16x8 32x8`): 128.3 µs a layer
# at 16 x 8, the fastest, against 294.1 at ONE_ROW_TILE's 4 x 4 (the plain GEMVs: 99.2).
LORA_ONE_ROW_TILE = (16, 8)


class GemvLoRA(NamedTuple):
    """A LoRA delta the one-row GEMV adds in its epilogue (batch-1 decode with an adapter: the
    separate expand kernel would add its whole latency to every linear): the step's segments
    (the row's slot is ``seg_slot[0]``, -1 for none), the shrink's float32 partials
    ``[splits, 1, parts * R]``, the pool's ``b`` [slots, N, R] and the parts' sizes."""

    seg: LoRASegments
    partial: torch.Tensor
    b: torch.Tensor
    part_sizes: tuple[int, ...]


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T (+ bias [N]) -> [M, N] in x's dtype, accumulated in float32."""
    out = x.float() @ weight.float().t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


@jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr,
    K, N, stride_xm, stride_wn, stride_om,
    slot_ptr, low_ptr, lb_ptr, stride_low_split, stride_lb_slot, bound1, bound2,
    M: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    LORA_SPLITS: tl.constexpr, LORA_RANK: tl.constexpr, PDL: tl.constexpr = False,
):
    # Grid: (cdiv(N, BLOCK_N),). One program: BLOCK_N output features for all M rows.
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    k_start = 0
    if PDL:  # launched with programmatic dependent launch (gemv_triton): the kernel before may
        # still run. Its first weight slice (which nothing before writes) is requested now; x,
        # which that kernel writes, is read only after it has finished (gdc_wait).
        tl.static_assert(M == 1 and LORA_SPLITS == 0, "the PDL prologue is written for one row, no LoRA")
        w_first = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & (k < K)[None, :], other=0.0).to(tl.float32)
        gdc_wait()
        k_start = BLOCK_K
    if LORA_SPLITS > 0:  # one row's LoRA delta (its low-rank row times these columns' B rows), read
        # before the weights stream so that its loads' latency hides behind theirs
        slot = tl.load(slot_ptr)
        on = n_mask[:, None] & (slot >= 0)
        part = (n >= bound1).to(tl.int32) + (n >= bound2).to(tl.int32)  # each column's fused part
        r = tl.arange(0, LORA_RANK)
        low = tl.zeros([BLOCK_N, LORA_RANK], tl.float32)
        for s in tl.static_range(LORA_SPLITS):
            low += tl.load(low_ptr + s * stride_low_split + part[:, None] * LORA_RANK + r[None, :], mask=on, other=0.0)
        lb = tl.load(lb_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_lb_slot + n.to(tl.int64)[:, None] * LORA_RANK
                     + r[None, :], mask=on, other=0.0).to(tl.float32)
        delta = tl.sum(low * lb, 1)
    acc0 = tl.zeros([BLOCK_N], tl.float32)
    acc1 = tl.zeros([BLOCK_N], tl.float32)
    acc2 = tl.zeros([BLOCK_N], tl.float32)
    acc3 = tl.zeros([BLOCK_N], tl.float32)
    if PDL:  # the first slice, peeled (one row: PDL is not taken for more)
        x0 = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        acc0 += tl.sum(w_first * x0[None, :], 1)
    for k0 in range(k_start, K, BLOCK_K):
        kk = k0 + k
        k_mask = kk < K
        w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        x0 = tl.load(x_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
        acc0 += tl.sum(w * x0[None, :], 1)
        if M > 1:
            x1 = tl.load(x_ptr + stride_xm + kk, mask=k_mask, other=0.0).to(tl.float32)
            acc1 += tl.sum(w * x1[None, :], 1)
        if M > 2:
            x2 = tl.load(x_ptr + 2 * stride_xm + kk, mask=k_mask, other=0.0).to(tl.float32)
            acc2 += tl.sum(w * x2[None, :], 1)
        if M > 3:
            x3 = tl.load(x_ptr + 3 * stride_xm + kk, mask=k_mask, other=0.0).to(tl.float32)
            acc3 += tl.sum(w * x3[None, :], 1)
    if HAS_BIAS:
        bias = tl.load(b_ptr + n, mask=n_mask, other=0.0).to(tl.float32)
        acc0 += bias
        acc1 += bias
        acc2 += bias
        acc3 += bias
    if LORA_SPLITS > 0:
        acc0 += delta
    ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + n, acc0.to(ty), mask=n_mask)
    if M > 1:
        tl.store(out_ptr + stride_om + n, acc1.to(ty), mask=n_mask)
    if M > 2:
        tl.store(out_ptr + 2 * stride_om + n, acc2.to(ty), mask=n_mask)
    if M > 3:
        tl.store(out_ptr + 3 * stride_om + n, acc3.to(ty), mask=n_mask)


def gemv_triton(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
    *, block_n: int | None = None, block_k: int = 1024, num_warps: int | None = None, num_stages: int = 3,
    lora: GemvLoRA | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton launcher for :func:`gemv_ref` (plus ``lora``'s delta, one row only), written into
    ``out`` ([M, N] of x's dtype, unit stride along N) when given; the keyword arguments are for
    tuning (``block_n`` and ``num_warps`` default to ``ONE_ROW_TILE``, ``LORA_ONE_ROW_TILE`` or
    ``ROWS_TILE``)."""
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1], "x [M, K], weight [N, K]"
    m, k_dim = x.shape
    tile_n, tile_warps = ROWS_TILE if m > 1 else ONE_ROW_TILE if lora is None else LORA_ONE_ROW_TILE
    block_n = tile_n if block_n is None else block_n
    num_warps = tile_warps if num_warps is None else num_warps
    n = weight.shape[0]
    assert 1 <= m <= MAX_ROWS, f"gemv takes 1..{MAX_ROWS} rows, got {m}"
    assert x.dtype in FLOAT_DTYPES and weight.dtype in FLOAT_DTYPES, f"unsupported dtypes {x.dtype}, {weight.dtype}"
    if x.stride(-1) != 1:
        x = x.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    assert out.shape == (m, n) and out.dtype == x.dtype and out.stride(-1) == 1, "out: [M, N] of x's dtype"
    lora_args, splits, rank = (x, x, x, 0, 0, n, n), 0, 16
    # Programmatic dependent launch (Hopper): one row without a LoRA delta (whose partials the
    # shrink kernel just before writes), where the norm / SiLU / merge kernels before it trigger.
    pdl = m == 1 and lora is None and pdl_trigger(x)
    if lora is not None:
        assert m == 1 and lora.b.shape[1] == n, "a GEMV LoRA epilogue takes one row and the linear's outputs"
        bounds = [n, n]
        for i in range(1, len(lora.part_sizes)):
            bounds[i - 1] = sum(lora.part_sizes[:i])
        lora_args = (lora.seg.seg_slot, lora.partial, lora.b, lora.partial.stride(0), lora.b.stride(0), *bounds)
        splits, rank = lora.partial.shape[0], lora.b.shape[2]
    _gemv_kernel[(cdiv(n, block_n),)](
        x, weight, bias if bias is not None else x, out,
        k_dim, n, x.stride(0), weight.stride(0), out.stride(0), *lora_args,
        M=m, HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=min(block_k, next_pow2(k_dim)),
        LORA_SPLITS=splits, LORA_RANK=rank, PDL=pdl, num_warps=num_warps, num_stages=num_stages,
        **({"launch_pdl": True} if pdl else {}),
    )
    return out


def _problem(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    supported = (x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.dtype in FLOAT_DTYPES
                 and weight.dtype in FLOAT_DTYPES)
    return None if supported else f"x {tuple(x.shape)} {x.dtype}"


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         lora: GemvLoRA | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` (plus ``lora``'s delta) for ``x`` of 1..MAX_ROWS rows: Triton on
    CUDA, else ``F.linear`` (the layers' own path, so the CPU computes exactly what it did
    without this kernel) and the LoRA expand; into ``out`` when given (``linear``'s)."""
    if triton_takes("gemv", (x, weight), _problem, x, weight) and (lora is None or x.shape[0] == 1):
        return gemv_triton(x, weight, bias, lora=lora, out=out)
    y = _dense(x, weight, bias, out)
    if lora is not None:
        lora_expand(y, lora.partial, lora.b, lora.seg, lora.part_sizes)
    return y


def _dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None) -> torch.Tensor:
    """``F.linear``, or the same product written into ``out`` (the same cuBLAS call: ``F.linear``
    is ``mm`` / ``addmm`` on 2-D inputs)."""
    if out is None:
        return F.linear(x, weight, bias)
    assert x.dim() == 2 and out.shape == (x.shape[0], weight.shape[0]), "out: [M, N] for x [M, K]"
    if bias is None:
        return torch.mm(x, weight.t(), out=out)
    return torch.addmm(bias, x, weight.t(), out=out)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """The model's ``F.linear``: inputs of up to ``LAYER_ROWS`` rows take :func:`gemv` (the GEMV
    on the GPU; ``F.linear`` itself elsewhere), larger ones cuBLAS. ``out`` ([M, N], 2-D ``x``
    only): the buffer to write the product into (tensor parallel's fused all-reduce slot)."""
    if x.dim() == 2 and x.shape[0] <= LAYER_ROWS:
        return gemv(x, weight, bias, out=out)
    return F.linear(x, weight, bias) if out is None else _dense(x, weight, bias, out)
