"""The M >= ``DEQUANT_MIN_ROWS`` path's kernel: the dense weight in x's dtype, for cuBLAS to
multiply (the package doc)."""

# No ``from __future__ import annotations``: Triton reads ``tl.constexpr`` annotations as objects.

from .._triton import jit, tl
from .codes import _codes, _column_consts, _spread


@jit
def _dequant_kernel(
    qw_ptr, qz_ptr, s_ptr, out_ptr, K, N, NP,
    GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr,
):
    # Grid: (cdiv(K, BLOCK_K), cdiv(N / 8, BLOCK_P)): the dense [K, N] weight in out's dtype,
    # dequantized as _gemm_kernel does its tiles (BLOCK_K divides GROUP, or GROUP >= K).
    k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    k_mask = k < K
    p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    p_mask = p < NP
    cols = tl.program_id(1) * (8 * BLOCK_P) + tl.arange(0, 8 * BLOCK_P)
    c_mask = cols < N
    masks, units = _column_consts(8 * BLOCK_P)
    g = tl.program_id(0) * BLOCK_K // GROUP
    q = tl.load(qw_ptr + k.to(tl.int64)[:, None] * NP + p[None, :], mask=k_mask[:, None] & p_mask[None, :], other=0)
    zb = _codes(_spread(tl.load(qz_ptr + g * NP + p, mask=p_mask, other=0)), masks)
    su = tl.load(s_ptr + g * N + cols, mask=c_mask, other=0.0).to(tl.float32) * units
    w = (_codes(_spread(q), masks[None, :]) - zb[None, :]) * su[None, :]
    tl.store(out_ptr + k.to(tl.int64)[:, None] * N + cols[None, :], w.to(out_ptr.dtype.element_ty),
             mask=k_mask[:, None] & c_mask[None, :])
