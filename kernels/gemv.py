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

import torch
import torch.nn.functional as F

from ._triton import FLOAT_DTYPES, cdiv, jit, next_pow2, tl, triton_takes

MAX_ROWS = 4  # rows of x the kernel takes
# Rows up to which the model's layers use this kernel instead of cuBLAS. Measured on an H100
# (Llama-2-7B shape, fp16): at 1 row the projections read the weights at ~2.9 TB/s against
# cuBLAS's ~2.66 (batch-1 decode 182.1 vs 168.5 tok/s); at 4 rows a decode step took 10.6 ms,
# far slower than cuBLAS (the four per-row reductions per tile cost more than the reads).
LAYER_ROWS = 1


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
    M: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # Grid: (cdiv(N, BLOCK_N),). One program: BLOCK_N output features for all M rows.
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    acc0 = tl.zeros([BLOCK_N], tl.float32)
    acc1 = tl.zeros([BLOCK_N], tl.float32)
    acc2 = tl.zeros([BLOCK_N], tl.float32)
    acc3 = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
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
    *, block_n: int = 16, block_k: int = 1024, num_warps: int = 8, num_stages: int = 3,
) -> torch.Tensor:
    """Triton launcher for :func:`gemv_ref`; the keyword arguments are for tuning (the defaults
    were the fastest of 39 configurations on an H100 over the Llama-2-7B projections:
    ``benchmarks/gemv_vs_cublas.py``)."""
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1], "x [M, K], weight [N, K]"
    m, k_dim = x.shape
    n = weight.shape[0]
    assert 1 <= m <= MAX_ROWS, f"gemv takes 1..{MAX_ROWS} rows, got {m}"
    assert x.dtype in FLOAT_DTYPES and weight.dtype in FLOAT_DTYPES, f"unsupported dtypes {x.dtype}, {weight.dtype}"
    if x.stride(-1) != 1:
        x = x.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(cdiv(n, block_n),)](
        x, weight, bias if bias is not None else x, out,
        k_dim, n, x.stride(0), weight.stride(0), out.stride(0),
        M=m, HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=min(block_k, next_pow2(k_dim)),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def _problem(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    supported = (x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.dtype in FLOAT_DTYPES
                 and weight.dtype in FLOAT_DTYPES)
    return None if supported else f"x {tuple(x.shape)} {x.dtype}"


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` of 1..MAX_ROWS rows: Triton on CUDA, else ``F.linear``
    (the layers' own path, so the CPU computes exactly what it did without this kernel)."""
    if triton_takes("gemv", (x, weight), _problem, x, weight):
        return gemv_triton(x, weight, bias)
    return F.linear(x, weight, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The model's ``F.linear``: inputs of up to ``LAYER_ROWS`` rows take :func:`gemv` (the GEMV
    on the GPU; ``F.linear`` itself elsewhere), larger ones cuBLAS."""
    if x.dim() == 2 and x.shape[0] <= LAYER_ROWS:
        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)
