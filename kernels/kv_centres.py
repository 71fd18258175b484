"""Key centres of a quantized cache (``kv_cache.py``'s module doc): what a store subtracts and
attention adds back (``KeyCentring``, ``KeyCentres``), the centres' positions and turns, the
reference, and the kernel that computes a sequence's centre from its first chunk."""

# No ``from __future__ import annotations``: Triton reads ``tl.constexpr`` annotations as objects.

from typing import NamedTuple

import torch

from ._triton import jit, next_pow2, tl
from .kv_basis import _basis_args, _in_key_basis, to_key_basis
from .kv_layout import CENTRE_GROUP, CENTRE_TOKENS, turned_centres
from .kv_quant import _quantize, dequantize_kv_ref, quantize_kv_ref
from .rotary import apply_rotary_ref


class KeyCentring(NamedTuple):
    """The key centres a quantized store subtracts and attention adds back (the module doc).
    ``table`` [R + 1, 2, Hkv, D] fp16: row ``b`` belongs to the sequence whose first block is
    ``b``; its vector 0 is the sequence's mean key before the rotary embedding (``m``), vector 1
    the constant shift in the key basis that keeps the first key exact (``e``). ``index`` [T]
    (any stride): token t's sequence's first block; ``new`` [S, 3] int32 (or None): (first token,
    tokens to use, first block) of each sequence whose first chunk this step writes, whose centre
    is computed first. Only blocks below R have a row (the block manager hands those out as
    first blocks while it can); a sequence whose first block is R or more reads the last row,
    which stays zero: it is stored uncentred, consistently. ``m`` turns to a key's position with
    the rotary embedding's own ``cos_sin_cache`` (``centre_positions``), the store's argument."""

    table: torch.Tensor
    index: torch.Tensor
    new: torch.Tensor | None = None


class KeyCentres(NamedTuple):
    """What attention over a centred cache needs to add the centres back (``KeyCentring``):
    the centre ``table`` and the rotary ``cos_sin`` table, and, for the kernels, ``queries``:
    the step's queries rotated but not in the key basis, [T, H, D] (the rotary kernel writes
    them), since the added score ``q . B R(p) m`` equals ``(q B^T) . R(p) m``."""

    table: torch.Tensor
    cos_sin: torch.Tensor
    queries: torch.Tensor | None = None


def centre_positions(positions: torch.Tensor, max_position: int) -> torch.Tensor:
    """The position each key's centre is turned to: the middle of its group of ``CENTRE_GROUP``
    positions, at most ``max_position - 1`` (the rotary table's last row)."""
    g = CENTRE_GROUP
    return ((positions.long() // g) * g + g // 2).clamp(max=max_position - 1)


def rotate_ref(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """x [T, Hkv, D] turned by the rotary embedding at ``positions`` [T], float32."""
    return apply_rotary_ref(x[:, :1].float(), x.float(), positions, cos_sin_cache.float())[1]


def key_shifts_ref(table: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
                   cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """What a centred key at ``positions`` [T] of the sequences whose centre rows are ``rows``
    [T] is stored minus, in the key basis, float32 [T, Hkv, D]: its sequence's mean key ``m``
    turned to the key's centre position, plus the shift ``e`` (``KeyCentring``)."""
    rows = rows.long().clamp(0, table.shape[0] - 1)
    m = table[rows, 0].float()
    turned = rotate_ref(m, centre_positions(positions, cos_sin_cache.shape[0]), cos_sin_cache)
    return to_key_basis(turned) + table[rows, 1].float()


def key_centres_ref(keys: torch.Tensor, positions: torch.Tensor, new: torch.Tensor, table: torch.Tensor, bits: int,
                    cos_sin_cache: torch.Tensor) -> None:
    """Write the centres of the sequences starting in this step (``KeyCentring.new``) into
    ``table`` from their keys before the rotary embedding, ``keys`` [T, Hkv, D] at ``positions``
    [T]: ``m``, the mean of rows 1 .. n - 1 after the first (0 when n is 1; int8 keeps m zero
    and takes the mean of those keys as rotated into ``e``: ``turned_centres``), and ``e``, the
    shift that makes the first key (rotated) minus its centre quantize exactly (the module doc).
    n counts at most ``CENTRE_TOKENS``."""
    last = table.shape[0] - 1  # the zero row (KeyCentring)
    for t0, n, row in new.tolist():
        if row >= last:
            continue
        n = min(n, CENTRE_TOKENS)
        first = rotate_ref(keys[t0 : t0 + 1], positions[t0 : t0 + 1], cos_sin_cache)[0]
        rest = slice(t0 + 1, t0 + n)
        constant = torch.zeros_like(first)
        if turned_centres(bits):
            table[row, 0] = (keys[rest].float().mean(0) if n > 1 else constant).to(table.dtype)
        else:  # m stays zero; the constant is the mean of the keys as rotated
            table[row, 0] = 0
            constant = rotate_ref(keys[rest], positions[rest], cos_sin_cache).mean(0) if n > 1 else constant
        turned = rotate_ref(table[row, 0].float()[None], centre_positions(positions[t0 : t0 + 1],
                            cos_sin_cache.shape[0]), cos_sin_cache)[0]
        codes, sz = quantize_kv_ref(to_key_basis(first - turned - constant), bits)
        table[row, 1] = (to_key_basis(first - turned) - dequantize_kv_ref(codes, sz, bits)).to(table.dtype)


@jit
def centre_position(pos, max_pos, GROUP: tl.constexpr):
    """``centre_positions`` of one position (int64)."""
    return tl.minimum((pos // GROUP) * GROUP + GROUP // 2, max_pos - 1)


@jit
def turn(m1, m2, cs_ptr, p, stride_cs, d, HALF: tl.constexpr):
    """Halves m1, m2 [..., BLOCK_HALF] (float32, dims ``d`` and ``HALF + d``) turned by the
    rotary embedding to position ``p`` (``cos_sin_cache``'s row)."""
    cos = tl.load(cs_ptr + p * stride_cs + d, mask=d < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + p * stride_cs + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
    return m1 * cos - m2 * sin, m2 * cos + m1 * sin


@jit
def _key_centre_kernel(
    k_ptr, pos_ptr, new_ptr, c_ptr, cs_ptr, b_ptr, b_scale,
    stride_kt, stride_kh, stride_cs, stride_c_row, stride_c_kind, stride_c_h, last_row, max_pos,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_T: tl.constexpr, BITS: tl.constexpr,
    GROUP: tl.constexpr, DOT_PRECISION: tl.constexpr, SYLVESTER: tl.constexpr, TURNED: tl.constexpr,
):
    # Grid: (S, Hkv); program (s, head) computes one head's centre of the s-th new sequence
    # (``key_centres_ref``) from its first chunk's keys before the rotary embedding, the tokens
    # as the rows of one tile: one short chain, where a walk over the tokens would be ~63
    # dependent loads.
    s = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    t0 = tl.load(new_ptr + s * 3).to(tl.int64)
    n = tl.minimum(tl.load(new_ptr + s * 3 + 1), BLOCK_T)
    row = tl.load(new_ptr + s * 3 + 2).to(tl.int64)
    r = tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_HALF)
    d_mask = d < HALF
    mask = (r < n)[:, None] & d_mask[None, :]
    src = k_ptr + (t0 + r[:, None]) * stride_kt + head * stride_kh + d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    rest = ((r >= 1) & (r < n))[:, None]
    count = tl.maximum(n - 1, 1).to(tl.float32)
    # Every key rotated by its position and rounded to k's dtype, as the store kernel has them.
    pos = tl.load(pos_ptr + t0 + r, mask=r < n, other=0).to(tl.int64)
    ty = k_ptr.dtype.element_ty
    f1, f2 = turn(x1, x2, cs_ptr, pos[:, None], stride_cs, d[None, :], HALF)
    f1 = f1.to(ty).to(tl.float32)
    f2 = f2.to(ty).to(tl.float32)
    # (stored only for a first block with a row: past the table's rows there is no centre)
    one = d_mask & (d * 0 + row < last_row)
    m_ptr = c_ptr + row * stride_c_row + head * stride_c_h
    if TURNED:  # m: the mean before the rotary embedding
        m1 = (tl.sum(tl.where(rest, x1, 0.0), 0) / count).to(c_ptr.dtype.element_ty)
        m2 = (tl.sum(tl.where(rest, x2, 0.0), 0) / count).to(c_ptr.dtype.element_ty)
        c1 = tl.zeros([BLOCK_HALF], tl.float32)
        c2 = tl.zeros([BLOCK_HALF], tl.float32)
    else:  # m stays zero; the constant: the mean of the rotated keys
        m1 = tl.zeros([BLOCK_HALF], c_ptr.dtype.element_ty)
        m2 = tl.zeros([BLOCK_HALF], c_ptr.dtype.element_ty)
        c1 = tl.sum(tl.where(rest, f1, 0.0), 0) / count
        c2 = tl.sum(tl.where(rest, f2, 0.0), 0) / count
    tl.store(m_ptr + d, m1, mask=one)
    tl.store(m_ptr + HALF + d, m2, mask=one)
    # The first key minus the stored m turned to its centre position, as the store kernel
    # computes it (a), then in the key basis with the constant off (row 0 of a tile: y) and on
    # (row 1: z); e = z - y's quantized value, so that a - e, what the store writes, is exactly
    # that value.
    u1, u2 = turn(m1.to(tl.float32), m2.to(tl.float32), cs_ptr, centre_position(tl.load(pos_ptr + t0).to(tl.int64),
                  max_pos, GROUP), stride_cs, d, HALF)
    first = (r == 0)[:, None]
    second = (r == 1)[:, None]
    a1 = tl.sum(tl.where(first, f1, 0.0), 0) - u1
    a2 = tl.sum(tl.where(first, f2, 0.0), 0) - u2
    y1, y2 = _in_key_basis(tl.where(first, (a1 - c1)[None, :], tl.where(second, a1[None, :], 0.0)).to(ty),
                           tl.where(first, (a2 - c2)[None, :], tl.where(second, a2[None, :], 0.0)).to(ty),
                           b_ptr, b_scale, 2 * HALF, HALF, BLOCK_HALF, DOT_PRECISION, SYLVESTER)
    k1 = tl.sum(tl.where(first, y1, 0.0), 0)[None, :]
    k2 = tl.sum(tl.where(first, y2, 0.0), 0)[None, :]
    q1, q2, scale, zero, _ = _quantize(k1, k2, one[None, :], BITS)
    sc = scale.to(tl.float32)[:, None]
    ze = zero.to(tl.float32)[:, None]
    z1 = tl.sum(tl.where(second, y1, 0.0), 0)[None, :]
    z2 = tl.sum(tl.where(second, y2, 0.0), 0)[None, :]
    dst = m_ptr + stride_c_kind + d[None, :]
    tl.store(dst, (z1 - (q1 * sc + ze)).to(c_ptr.dtype.element_ty), mask=one[None, :])
    tl.store(dst + HALF, (z2 - (q2 * sc + ze)).to(c_ptr.dtype.element_ty), mask=one[None, :])


def _key_centres_triton(k: torch.Tensor, positions: torch.Tensor, cs: torch.Tensor, centring: KeyCentring,
                        bits: int) -> None:
    """``key_centres_ref`` for the sequences in ``centring.new``, from k [T, Hkv, D] before the
    rotary embedding."""
    new = centring.new
    if new is None or new.shape[0] == 0:
        return
    head_dim = k.shape[-1]
    half = head_dim // 2
    basis, b_scale, precision, sylvester = _basis_args(head_dim, k.device, k.dtype)
    table = centring.table
    _key_centre_kernel[(new.shape[0], k.shape[1])](
        k, positions, new, table, cs, basis, b_scale, k.stride(0), k.stride(1), cs.stride(0),
        table.stride(0), table.stride(1), table.stride(2), table.shape[0] - 1, cs.shape[0],
        HALF=half, BLOCK_HALF=max(16, next_pow2(half)), BLOCK_T=CENTRE_TOKENS, BITS=bits, GROUP=CENTRE_GROUP,
        DOT_PRECISION=precision, SYLVESTER=sylvester, TURNED=turned_centres(bits), num_warps=4,
    )
