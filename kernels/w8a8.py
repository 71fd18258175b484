"""W8A8 (SmoothQuant-style) kernels: int8 weights and activations, int32 accumulation.

Weights are int8 ``[N, K]``, symmetric per output channel with float32 scales ``[N]``
(``w ≈ wq * w_scale[:, None]``; :func:`quant_per_token` applied to ``w`` makes them). Activations
are quantized per token (per row) at run time: ``s = max|x_row| / 127``, ``xq = round(x / s)``
(round half to even, clamped to ±127; an all-zero row gets ``s = 0`` and ``xq = 0``). Then

    y = (xq @ wq.T) * s[:, None] * w_scale[None, :] (+ bias)

with the product summed exactly in int32 and both scales (and the bias) applied in float32 before
the one rounding to the activation dtype.

* :func:`quant_per_token`: ``x [..., K]`` -> ``(xq int8 [M, K], scale float32 [M, 1])``;
* :func:`rms_norm_quant`: RMSNorm (optionally after the residual add, as ``add_rms_norm``) and the
  per-token quantization of its output in one pass: the normalized row lives only in registers;
* :func:`silu_mul_quant`: the SwiGLU gate (``silu_and_mul``) and the per-token quantization of
  its output in one pass, for the down projection's input;
* :func:`int8_matmul`: the GEMM with the dequantizing epilogue. On CUDA it is a Triton kernel
  (``tl.dot`` on int8 tiles: ``mma.sync`` for small row tiles, ``wgmma`` on Hopper for 64+ rows);
  :func:`int8_matmul_int_mm` is the cuBLAS baseline (``torch._int_mm`` + a Triton epilogue), used
  from ``INT_MM_MIN_ROWS`` rows on if the benchmark (``benchmarks/bench_w8a8.py``) shows it faster.

The quantizer computes ``x * (127 / amax)`` rather than ``x / scale``: one IEEE division per row and
an exact multiply per element, which the reference reproduces bit for bit (``torch.round`` and
``rint`` both round half to even), so kernel and reference give the same codes on the same input.
"""

# No ``from __future__ import annotations``: Triton reads ``tl.constexpr`` annotations as objects.

import torch

from ._triton import (
    FLOAT_DTYPES,
    HAS_TRITON,
    TRITON_INTERPRETED,
    cdiv,
    grouped_tile,
    jit,
    next_pow2,
    row_and_cols,
    tl,
    triton,
    triton_takes,
)
from .activation import silu_and_mul_ref
from .rms_norm import MAX_HIDDEN, add_rms_norm_ref, as_rows, norm_inputs, normed_row, rms_norm_ref, row_warps

try:  # CUDA's round-half-even instruction; the interpreter cannot run libdevice (see _round_half_even)
    from triton.language.extra import libdevice
except Exception:  # noqa: BLE001 - no Triton, or an older layout: the interpreter path never needs it
    libdevice = None
_USE_RINT = libdevice is not None and not TRITON_INTERPRETED

QMAX = 127
# |sum| <= K * 128 * 128 must stay below 2**31 for the int32 accumulator (int8 codes may be -128
# when the weights come from another quantizer).
MAX_K = 2**31 // (128 * 128) - 1
# Rows from which int8_matmul takes torch._int_mm (cuBLAS) instead of the Triton GEMM on CUDA;
# None: never. The Triton kernel applies the scales in its epilogue, while _int_mm writes an int32
# [M, N] product that a second kernel reads back (8 extra bytes per output element, ~25% of the
# GEMM's time at K = 4096). Against that, Triton runs int8 wgmma synchronously (MATMUL_CONFIGS), so
# cuBLAS's main loop may win at large M: benchmarks/bench_w8a8.py on the GPU prints the value to
# put here. Triton until measured.
INT_MM_MIN_ROWS: int | None = None

_NORM_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}


# ------------------------------------------------------------------------------------------ references


def quant_per_token_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (xq int8 [M, K], scale float32 [M, 1]) with x ≈ xq * scale, M = x.numel() // K."""
    x2 = x.reshape(-1, x.shape[-1]).to(torch.float32)
    amax = x2.abs().amax(-1, keepdim=True) if x2.shape[-1] else x2.new_zeros(x2.shape[0], 1)
    # Tensor / tensor divisions: IEEE on every device (CUDA turns a Python-scalar divisor into a
    # multiply by its reciprocal, one more rounding than the kernel's div_rn).
    qmax = torch.full_like(amax, float(QMAX))
    scale = amax / qmax
    inv = torch.where(amax > 0, qmax / amax, torch.zeros_like(amax))
    xq = torch.round(x2 * inv).clamp_(-QMAX, QMAX).to(torch.int8)
    return xq, scale


def rms_norm_quant_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quant_per_token(rms_norm(x))``, or with ``residual``: ``residual += x`` first and the
    updated residual returned third (``add_rms_norm``'s contract)."""
    if residual is None:
        return quant_per_token_ref(rms_norm_ref(x, weight, eps))
    normed, residual = add_rms_norm_ref(x, residual, weight, eps)
    xq, scale = quant_per_token_ref(normed)
    return xq, scale, residual


def silu_mul_quant_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quant_per_token(silu_and_mul(x))``: the SwiGLU gate over ``x = cat(gate, up)``, quantized per row."""
    return quant_per_token_ref(silu_and_mul_ref(x))


def int8_mm_int32_ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] int8 @ b [N, K].T -> int32 [M, N], exactly.

    A float64 product: every partial sum is an integer below 2**31 < 2**53, so it is exact
    whatever order or FMA the BLAS uses, on CPU and CUDA alike (cuBLAS has no int64 GEMM).
    """
    assert a.dtype == torch.int8 and b.dtype == torch.int8, f"int8 inputs expected, got {a.dtype}, {b.dtype}"
    assert a.shape[-1] == b.shape[-1] <= MAX_K, f"K {a.shape[-1]} vs {b.shape[-1]} (at most {MAX_K})"
    return (a.to(torch.float64) @ b.to(torch.float64).t()).to(torch.int32)


def int8_matmul_ref(
    xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
    bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float16,
) -> torch.Tensor:
    """(xq [M, K] @ wq [N, K].T) * x_scale [M, 1] * w_scale [N] (+ bias [N]) -> [M, N] in out_dtype.

    Exact int32 sums; the epilogue in float32 in the kernel's order, then one rounding.
    """
    acc = int8_mm_int32_ref(xq, wq)
    y = acc.to(torch.float32) * x_scale.reshape(-1, 1).to(torch.float32) * w_scale.reshape(1, -1).to(torch.float32)
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(out_dtype)


# --------------------------------------------------------------------------------- per-token quantizer


@jit
def _round_half_even(t, USE_RINT: tl.constexpr):
    """Round float32 ``t`` to the nearest integer, ties to even (like ``torch.round``)."""
    if USE_RINT:
        r = libdevice.rint(t)  # one cvt.rni.f32.f32 on CUDA
    else:
        # The interpreter has no libdevice. floor and the difference below are exact for |t| < 2**23
        # (the quantizer's |t| <= 127), so this is round-half-even without a rounding add.
        r = tl.floor(t)
        frac = t - r
        odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
        r = tl.where((frac > 0.5) | ((frac == 0.5) & odd), r + 1.0, r)
    return r


@jit
def _quantize_row(y, cols, mask, q_row_ptr, scale_ptr, USE_RINT: tl.constexpr):
    """Quantize the float32 row ``y`` (masked lanes 0): store its int8 codes and its scale."""
    amax = tl.max(tl.abs(y), axis=0)
    # IEEE divisions (div_rn), once per row: a plain ``/`` compiles to div.full.f32 (2 ulp) on CUDA.
    # Both operands as float32 tensors: older Triton's div_rn takes no Python constants.
    qmax = tl.full([], 127.0, tl.float32)
    scale = tl.math.div_rn(amax, qmax)
    inv = tl.where(amax > 0, tl.math.div_rn(qmax, tl.maximum(amax, 1e-30)), 0.0)
    r = _round_half_even(y * inv, USE_RINT)
    q = tl.minimum(tl.maximum(r, -127.0), 127.0)
    tl.store(q_row_ptr + cols, q.to(tl.int8), mask=mask)
    tl.store(scale_ptr, scale)


@jit
def _quant_kernel(x_ptr, q_ptr, scale_ptr, stride_x, stride_q, K, USE_RINT: tl.constexpr, BLOCK: tl.constexpr):
    # Grid: (rows,); one program quantizes one whole row (BLOCK >= K): one read, no second pass.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    _quantize_row(x, cols, mask, q_ptr + row * stride_q, scale_ptr + row, USE_RINT)


@jit
def _rms_norm_quant_kernel(
    x_ptr, res_ptr, w_ptr, q_ptr, scale_ptr, res_out_ptr,
    stride_x, stride_res, stride_q, stride_res_out,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr, NORM_DTYPE: tl.constexpr, USE_RINT: tl.constexpr, BLOCK: tl.constexpr,
):
    # Grid: (rows,). kernels/rms_norm.py's normalized row (``normed_row``), rounded to the dtype
    # rms_norm would have returned (NORM_DTYPE: 0 fp16, 1 bf16, 2 fp32) and quantized in registers
    # instead of being stored: the same codes as rms_norm followed by quant_per_token.
    row, cols, mask, y = normed_row(x_ptr, res_ptr, w_ptr, res_out_ptr, stride_x, stride_res, stride_res_out,
                                     hidden, eps, HAS_RESIDUAL, BLOCK)
    if NORM_DTYPE == 0:
        y = y.to(tl.float16).to(tl.float32)
    elif NORM_DTYPE == 1:
        y = y.to(tl.bfloat16).to(tl.float32)
    _quantize_row(y, cols, mask, q_ptr + row * stride_q, scale_ptr + row, USE_RINT)


@jit
def _silu_mul_quant_kernel(x_ptr, q_ptr, scale_ptr, stride_x, stride_q, inter_size,
                           USE_RINT: tl.constexpr, BLOCK: tl.constexpr):
    # Grid: (rows,). kernels/activation.py's gate over a whole row, rounded to the input dtype as
    # silu_and_mul returns it, then quantized in registers: the [M, I] activation is never stored.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < inter_size
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter_size + cols, mask=mask, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    y = (act.to(tl.float32) * up.to(tl.float32)).to(up.dtype).to(tl.float32)
    _quantize_row(y, cols, mask, q_ptr + row * stride_q, scale_ptr + row, USE_RINT)


def _int8_rows(rows: int, width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty outputs of a row quantizer: codes int8 [rows, width] and scales float32 [rows, 1]."""
    return (torch.empty(rows, width, dtype=torch.int8, device=device),
            torch.empty(rows, 1, dtype=torch.float32, device=device))


def _quantize_rows(kernel, x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch a row quantizer (``_quant_kernel``, ``_silu_mul_quant_kernel``: one program a row of
    x, ``width`` codes out) and return its codes and scales."""
    x2 = as_rows(x)
    xq, scale = _int8_rows(x2.shape[0], width, x.device)
    if x2.shape[0]:
        block = next_pow2(width)
        kernel[(x2.shape[0],)](
            x2, xq, scale, x2.stride(0), xq.stride(0), width,
            USE_RINT=_USE_RINT, BLOCK=block, num_warps=row_warps(block),
        )
    return xq, scale


def quant_per_token_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher for :func:`quant_per_token_ref`."""
    k = x.shape[-1]
    assert x.dtype in FLOAT_DTYPES, f"unsupported dtype {x.dtype}"
    assert 0 < k <= MAX_HIDDEN, f"row length {k} not in 1..{MAX_HIDDEN}"
    return _quantize_rows(_quant_kernel, x, k)


def rms_norm_quant_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton launcher for :func:`rms_norm_quant_ref`: one read of x (and residual) per row."""
    hidden = x.shape[-1]
    assert 0 < hidden <= MAX_HIDDEN, f"hidden size {hidden} not in 1..{MAX_HIDDEN}"
    x2, r2, w, res_out, normed_dtype = norm_inputs(x, residual, weight)
    xq, scale = _int8_rows(x2.shape[0], hidden, x.device)
    if x2.shape[0]:
        block = next_pow2(hidden)
        _rms_norm_quant_kernel[(x2.shape[0],)](
            x2, r2, w, xq, scale, res_out,
            x2.stride(0), r2.stride(0), xq.stride(0), res_out.stride(0),
            hidden, float(eps),
            HAS_RESIDUAL=residual is not None,
            # rms_norm returns ``weight * normed``: its dtype follows torch promotion.
            NORM_DTYPE=_NORM_CODES[torch.promote_types(weight.dtype, normed_dtype)],
            USE_RINT=_USE_RINT, BLOCK=block, num_warps=row_warps(block),
        )
    if residual is None:
        return xq, scale
    return xq, scale, res_out.view(x.shape)


def silu_mul_quant_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher for :func:`silu_mul_quant_ref`: one read of the gate/up row, int8 codes out."""
    assert x.dtype in FLOAT_DTYPES, f"unsupported dtype {x.dtype}"
    assert x.shape[-1] % 2 == 0 and 0 < x.shape[-1] // 2 <= MAX_HIDDEN, f"bad gate/up width {x.shape[-1]}"
    return _quantize_rows(_silu_mul_quant_kernel, x, x.shape[-1] // 2)


# ------------------------------------------------------------------------------------------- the GEMM


@jit
def _int8_matmul_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, bias_ptr, c_ptr,
    M, N, K,
    stride_am, stride_bn, stride_cm,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # Grid: (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N),). Consecutive programs take GROUP_M row tiles of
    # one column of tiles before moving right, so each weight tile is fetched from HBM once per group
    # and the group's activation rows stay in L2.
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Out-of-range rows/columns wrap onto valid ones: every load stays in bounds without a per-element
    # mask (full-width async copies); the store below drops the wrapped results.
    am = rm % M
    bn = rn % N
    rk = tl.arange(0, BLOCK_K)
    # Both operands are K-contiguous (xq [M, K] and wq [N, K] row-major): the K-major layout that
    # Hopper's int8 wgmma requires for A and B, so no shared-memory transpose is needed.
    a_ptrs = a_ptr + am.to(tl.int64)[:, None] * stride_am + rk[None, :]
    b_ptrs = b_ptr + bn.to(tl.int64)[None, :] * stride_bn + rk[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=rk[None, :] < k_left, other=0)
            b = tl.load(b_ptrs, mask=rk[:, None] < k_left, other=0)
        # int8 x int8 -> int32: exact (Triton 3.6 needs out_dtype to match acc)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    # Epilogue in float32, in the reference's order: (acc * s_x) * s_w (+ bias), one rounding.
    sa = tl.load(a_scale_ptr + am)
    sb = tl.load(b_scale_ptr + bn)
    out = acc.to(tl.float32) * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + bn).to(tl.float32)[None, :]
    c_ptrs = c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :]
    tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=(rm < M)[:, None] & (rn < N)[None, :])


def _config(bm: int, bn: int, bk: int, warps: int, stages: int) -> dict[str, int]:
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages)


# Candidate tiles per row bucket, for an H100/H200 (132 SMs, 227 KiB shared memory and 64K registers
# per SM). The autotuner times them once per (bucket, N, K, dtypes) on first use and skips any that
# does not fit (OutOfResources). Shared memory per stage is (BM + BN) * BK bytes. Checked by compiling
# for sm_90a (Triton 3.9's ptxas): no spills; 64+ row tiles use wgmma, 16/32-row tiles mma.sync.
# Triton issues int8 wgmma synchronously (its pipeliner overlaps a wgmma with the next one only for
# float32 accumulators), so each K step ends in a wait: large K tiles amortize it, and 128x128x64
# (64 KiB, 120 registers x 256 threads) lets two programs share an SM and hide each other's waits.
MATMUL_CONFIGS: dict[int, list[dict[str, int]]] = {
    # Decode (M <= 16): streaming the weights is the whole cost (K * N bytes). 16-row tiles
    # (mma.sync m16n8k32), narrow N tiles so that even N = 4096 makes 128-256 programs for the 132
    # SMs, and deep K slices in 4-6 stages (12-24 KiB each) to keep enough bytes in flight per SM.
    16: [_config(16, 32, 256, 4, 5), _config(16, 64, 256, 4, 4), _config(16, 16, 512, 4, 4),
         _config(16, 64, 128, 4, 6), _config(16, 128, 128, 4, 4)],
    # Small batches: still mostly weight-bound; 32-64 row tiles (wgmma from 64), 64-128 wide, and
    # 32 wide so that N = 4096 (o_proj, down_proj) makes 128 programs for the 132 SMs, not 64
    # (measured under CUDA graphs at M = 64: 64-wide tiles left o_proj at 1.18x fp16).
    64: [_config(64, 64, 128, 4, 5), _config(64, 128, 128, 4, 4), _config(32, 64, 256, 4, 4),
         _config(64, 64, 256, 4, 4), _config(32, 128, 128, 4, 4), _config(64, 32, 256, 4, 4),
         _config(64, 32, 128, 4, 6), _config(64, 64, 256, 4, 5), _config(64, 32, 256, 4, 6)],
    # Medium batches: one warpgroup per 64 rows; 3-4 stages of 24-48 KiB.
    256: [_config(64, 128, 128, 4, 4), _config(128, 128, 128, 8, 4), _config(128, 128, 64, 8, 4),
          _config(64, 256, 128, 8, 3), _config(128, 256, 128, 8, 3)],
    # Prefill (M > 256): compute-bound. 128x256 (or 256x128) tiles with two warpgroups (8 warps) on
    # a 128-register int32 accumulator per thread; BK = 128 is 4 wgmma k-steps per wait; 3 stages of
    # 48 KiB (144 KiB). Then the two-programs-per-SM tile and two 128-wide ones.
    1 << 62: [_config(128, 256, 128, 8, 3), _config(256, 128, 128, 8, 3), _config(128, 128, 64, 8, 4),
              _config(128, 128, 128, 8, 4), _config(128, 256, 64, 8, 4)],
}


def m_bucket(m: int) -> int:
    """The MATMUL_CONFIGS key for ``m`` rows."""
    return next(b for b in MATMUL_CONFIGS if m <= b)


def _even_k(args: dict) -> bool:
    return args["K"] % args["BLOCK_K"] == 0


if HAS_TRITON:
    _matmul = triton.heuristics({"EVEN_K": _even_k})(_int8_matmul_kernel)
    # One autotuner per row bucket, keyed on (N, K) (and the tensors' dtypes, which Triton adds):
    # M varies every step, so it picks the list, not a new tuning run.
    _AUTOTUNED = {
        bucket: triton.autotune(
            configs=[
                triton.Config({k: v for k, v in c.items() if k.isupper()}, num_warps=c["num_warps"],
                              num_stages=c["num_stages"])
                for c in configs
            ],
            key=["N", "K"],
        )(_matmul)
        for bucket, configs in MATMUL_CONFIGS.items()
    }


def _interpreter_config(m: int, n: int, k: int) -> dict[str, int]:
    # The interpreter runs each program in numpy: few, large tiles are fastest (no tuning meaning).
    return _config(min(64, max(16, next_pow2(m))), min(128, max(16, next_pow2(n))),
                   min(128, max(32, next_pow2(k))), 4, 1)


def _check_matmul_inputs(
    xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Assert shapes, dtypes and devices; return xq, x_scale [M], wq, w_scale [N] ready to launch."""
    assert xq.dim() == 2 and wq.dim() == 2 and xq.shape[1] == wq.shape[1], (
        f"xq [M, K] and wq [N, K] expected, got {tuple(xq.shape)}, {tuple(wq.shape)}")
    assert xq.dtype == torch.int8 and wq.dtype == torch.int8, f"int8 inputs expected, got {xq.dtype}, {wq.dtype}"
    m, k = xq.shape
    n = wq.shape[0]
    assert 0 < k <= MAX_K, f"K = {k} not in 1..{MAX_K} (int32 accumulation)"
    assert x_scale.numel() == m and x_scale.dtype == torch.float32, f"x_scale: {m} float32 values expected"
    assert w_scale.numel() == n and w_scale.dtype == torch.float32, f"w_scale: {n} float32 values expected"
    assert bias is None or (bias.numel() == n and bias.dtype in FLOAT_DTYPES), f"bias: {n} float values expected"
    assert out_dtype in FLOAT_DTYPES, f"unsupported out_dtype {out_dtype}"
    tensors = (x_scale, wq, w_scale) + (() if bias is None else (bias,))
    assert all(t.device == xq.device for t in tensors), "inputs on different devices"
    xq = xq if xq.stride(1) == 1 else xq.contiguous()
    wq = wq if wq.stride(1) == 1 else wq.contiguous()
    return xq, x_scale.reshape(-1).contiguous(), wq, w_scale.reshape(-1).contiguous()


def int8_matmul_triton(
    xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
    bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float16,
    *, config: dict[str, int] | None = None,
) -> torch.Tensor:
    """Triton launcher for :func:`int8_matmul_ref`. ``config`` (a MATMUL_CONFIGS entry) replaces
    the autotuner, for benchmarks and tests; the interpreter uses one fixed configuration."""
    xq, xs, wq, ws = _check_matmul_inputs(xq, x_scale, wq, w_scale, bias, out_dtype)
    m, k = xq.shape
    n = wq.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0 or n == 0:
        return out
    b = bias.reshape(-1).contiguous() if bias is not None else ws  # unused when HAS_BIAS=False
    args = (xq, xs, wq, ws, b, out, m, n, k, xq.stride(0), wq.stride(0), out.stride(0))
    if config is None and TRITON_INTERPRETED:
        config = _interpreter_config(m, n, k)
    if config is None:
        def grid(meta: dict) -> tuple[int]:
            return (cdiv(m, meta["BLOCK_M"]) * cdiv(n, meta["BLOCK_N"]),)

        _AUTOTUNED[m_bucket(m)][grid](*args, HAS_BIAS=bias is not None)
    else:
        grid = (cdiv(m, config["BLOCK_M"]) * cdiv(n, config["BLOCK_N"]),)
        _matmul[grid](*args, HAS_BIAS=bias is not None, **config)
    return out


# ------------------------------------------------------------------------ cuBLAS baseline: torch._int_mm


@jit
def _dequant_kernel(acc_ptr, xs_ptr, ws_ptr, bias_ptr, out_ptr, N, stride_acc, stride_out,
                    HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    # Grid: (M, cdiv(N, BLOCK)): int32 products -> (acc * s_x) * s_w (+ bias) -> out dtype.
    row, cols = row_and_cols(BLOCK)
    mask = cols < N
    acc = tl.load(acc_ptr + row * stride_acc + cols, mask=mask, other=0).to(tl.float32)
    out = acc * tl.load(xs_ptr + row) * tl.load(ws_ptr + cols, mask=mask, other=0.0)
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def int_mm_problem(m: int, n: int, k: int) -> str | None:
    """Why ``torch._int_mm`` (CUDA) cannot take an [m, k] @ [k, n] product, or None when it can."""
    if m <= 16:
        return f"M = {m} (torch._int_mm needs M > 16)"
    if k % 8 or n % 8:
        return f"K = {k}, N = {n} (torch._int_mm needs multiples of 8)"
    return None


def int8_matmul_int_mm(
    xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
    bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float16,
) -> torch.Tensor:
    """:func:`int8_matmul_ref` through cuBLAS (``torch._int_mm``, int32 out) and a Triton epilogue.

    ``wq.t()`` is passed as a view: the column-major B of cuBLASLt's fast int8 "TN" layout (a
    contiguous [K, N] copy is several times slower)."""
    xq, xs, wq, ws = _check_matmul_inputs(xq, x_scale, wq, w_scale, bias, out_dtype)
    m, k = xq.shape
    n = wq.shape[0]
    why = int_mm_problem(m, n, k)
    assert why is None, why
    acc = torch._int_mm(xq, wq.t())
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    block = min(1024, next_pow2(n))
    _dequant_kernel[(m, cdiv(n, block))](
        acc, xs, ws, bias.reshape(-1).contiguous() if bias is not None else ws, out, n, acc.stride(0),
        out.stride(0), HAS_BIAS=bias is not None, BLOCK=block, num_warps=4,
    )
    return out


# ---------------------------------------------------------------------------------------- dispatchers


def _row_problem(x: torch.Tensor, *others: torch.Tensor) -> str | None:
    supported = all(t.dtype in FLOAT_DTYPES for t in (x, *others)) and 0 < x.shape[-1] <= MAX_HIDDEN
    return None if supported else f"{x.dtype} {tuple(x.shape)}"


def _matmul_problem(xq: torch.Tensor, wq: torch.Tensor) -> str | None:
    supported = (xq.dim() == 2 and wq.dim() == 2 and xq.dtype == wq.dtype == torch.int8
                 and 0 < xq.shape[1] <= MAX_K)
    return None if supported else f"xq {tuple(xq.shape)} {xq.dtype}, wq {tuple(wq.shape)} {wq.dtype}"


def quant_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 quantization: (xq [M, K], scale [M, 1]); Triton on CUDA, else the reference."""
    if triton_takes("quant_per_token", (x,), _row_problem, x):
        return quant_per_token_triton(x)
    return quant_per_token_ref(x)


def _gate_problem(x: torch.Tensor) -> str | None:
    ok = x.dtype in FLOAT_DTYPES and x.shape[-1] % 2 == 0 and 0 < x.shape[-1] // 2 <= MAX_HIDDEN
    return None if ok else f"{x.dtype} {tuple(x.shape)}"


def silu_mul_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(xq [M, I], scale [M, 1]) of ``silu_and_mul(x)`` in one pass: Triton on CUDA, else the reference."""
    if triton_takes("silu_mul_quant", (x,), _gate_problem, x):
        return silu_mul_quant_triton(x)
    return silu_mul_quant_ref(x)


def rms_norm_quant(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(xq, scale) of ``rms_norm(x)``, or (xq, scale, new residual) of ``add_rms_norm(x, residual)``,
    fused in one pass: Triton on CUDA, else the reference."""
    tensors = (x, weight) if residual is None else (x, weight, residual)
    if triton_takes("rms_norm_quant", tensors[:1] + tensors[2:], _row_problem, *tensors):
        return rms_norm_quant_triton(x, weight, eps, residual)
    return rms_norm_quant_ref(x, weight, eps, residual)


def int8_matmul(
    xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
    bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float16,
) -> torch.Tensor:
    """W8A8 GEMM ``(xq @ wq.T) * x_scale * w_scale (+ bias)``: Triton on CUDA (cuBLAS from
    ``INT_MM_MIN_ROWS`` rows when set), else the reference."""
    if not triton_takes("int8_matmul", (xq, wq), _matmul_problem, xq, wq):
        return int8_matmul_ref(xq, x_scale, wq, w_scale, bias, out_dtype)
    m, k = xq.shape
    if (INT_MM_MIN_ROWS is not None and m >= INT_MM_MIN_ROWS and xq.is_cuda
            and int_mm_problem(m, wq.shape[0], k) is None):
        return int8_matmul_int_mm(xq, x_scale, wq, w_scale, bias, out_dtype)
    return int8_matmul_triton(xq, x_scale, wq, w_scale, bias, out_dtype)
