"""The key basis (``kv_cache.py``'s module doc): the orthonormal ``B = key_basis(D)`` keys of a
quantized cache are stored in (and queries turned into), as a torch tensor and, inside the
kernels, as a Sylvester-Hadamard product computed in registers."""

# No ``from __future__ import annotations``: Triton reads ``tl.constexpr`` annotations as objects.

import functools
import math

import torch

from ._triton import jit, tl


@functools.lru_cache(maxsize=16)
def _key_basis(head_dim: int, device: str, dtype: torch.dtype) -> torch.Tensor:
    if head_dim & (head_dim - 1) == 0:  # Sylvester's Hadamard matrix
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < head_dim:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        basis = h / math.sqrt(head_dim)
    else:  # no Hadamard matrix of this order: a fixed random orthonormal one does the same job
        gen = torch.Generator().manual_seed(head_dim)
        basis, _ = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=gen, dtype=torch.float64))
    return basis.to(device=device, dtype=dtype)


def key_basis(head_dim: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The orthonormal [D, D] matrix a quantized cache stores keys in (``k @ B``), and queries
    are multiplied by (the module doc): normalized Hadamard for a power-of-two D."""
    return _key_basis(head_dim, str(device), dtype)


def _basis_args(head_dim: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, float, str, bool]:
    """What the store kernels take for the key basis: ``B * sqrt(D)`` in fp32 (a Hadamard
    matrix's entries are then +-1, exact in any dtype, so the product runs on x's own dtype
    with no rounding of B), the ``1 / sqrt(D)`` applied after it, the dot's precision, and
    whether B is Sylvester's (built in the kernel, its matrix never read: ``_in_key_basis``)."""
    scaled = _scaled_key_basis(head_dim, str(device))
    sylvester = head_dim & (head_dim - 1) == 0
    return scaled, 1.0 / math.sqrt(head_dim), "ieee" if dtype == torch.float32 else "tf32", sylvester


@functools.lru_cache(maxsize=16)
def _scaled_key_basis(head_dim: int, device: str) -> torch.Tensor:
    scaled = key_basis(head_dim, "cpu", torch.float64) * math.sqrt(head_dim)
    return scaled.to(device=device, dtype=torch.float32).contiguous()  # row-major: the kernels index it so


def to_key_basis(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] @ key_basis(D), computed in fp32, in x's dtype."""
    return (x.to(torch.float32) @ key_basis(x.shape[-1], x.device)).to(x.dtype)


@jit
def _sylvester_half(HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, dtype: tl.constexpr):
    """Sylvester's Hadamard matrix of order HALF, [BLOCK_HALF, BLOCK_HALF] (zero past HALF), in
    registers: entry (i, j) is (-1) ** popcount(i & j), so no basis is read from memory."""
    r = tl.arange(0, BLOCK_HALF)
    x = r[:, None] & r[None, :]
    x = x ^ (x >> 8)  # fold the bits down to one: the parity of popcount (HALF <= 2 ** 16)
    x = x ^ (x >> 4)
    x = x ^ (x >> 2)
    x = x ^ (x >> 1)
    sign = 1 - 2 * (x & 1)
    return tl.where((r[:, None] < HALF) & (r[None, :] < HALF), sign, 0).to(dtype)


@jit
def _in_key_basis(x1, x2, b_ptr, scale, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                  DOT_PRECISION: tl.constexpr, SYLVESTER: tl.constexpr):
    """Heads given as halves x1, x2 [BLOCK_H >= 16, BLOCK_HALF] (zero past HALF) times the key
    basis ``B`` (``scale`` = 1 / sqrt(D)): the halves of ``x @ B``, fp32.

    SYLVESTER (D a power of two): ``B * sqrt(D)`` is ``[[H, H], [H, -H]]`` with H Sylvester's
    matrix of order D / 2, built in registers (``_sylvester_half``): ``x @ B`` is ``(a + b, a - b)
    * scale`` with ``a = x1 @ H`` and ``b = x2 @ H``, two products on the tensor cores. (Four
    quadrant products of a basis loaded from memory, 64 KB a program, made the batch-1 rotary
    kernel 13 us a layer instead of 5; H200, Llama-2-7B.) Otherwise ``b_ptr`` holds ``B * sqrt(D)``,
    [D, D] row-major, and its four quadrants are loaded and multiplied."""
    ty = x1.dtype
    if SYLVESTER:
        h = _sylvester_half(HALF, BLOCK_HALF, ty)
        a = tl.dot(x1, h, input_precision=DOT_PRECISION)
        b = tl.dot(x2, h, input_precision=DOT_PRECISION)
        return (a + b) * scale, (a - b) * scale
    r = tl.arange(0, BLOCK_HALF)
    m = (r[:, None] < HALF) & (r[None, :] < HALF)
    b = b_ptr + r[:, None] * HEAD_DIM + r[None, :]
    b11 = tl.load(b, mask=m, other=0.0).to(ty)
    b12 = tl.load(b + HALF, mask=m, other=0.0).to(ty)
    b21 = tl.load(b + HALF * HEAD_DIM, mask=m, other=0.0).to(ty)
    b22 = tl.load(b + HALF * HEAD_DIM + HALF, mask=m, other=0.0).to(ty)
    y1 = tl.dot(x1, b11, input_precision=DOT_PRECISION) + tl.dot(x2, b21, input_precision=DOT_PRECISION)
    y2 = tl.dot(x1, b12, input_precision=DOT_PRECISION) + tl.dot(x2, b22, input_precision=DOT_PRECISION)
    return y1 * scale, y2 * scale
