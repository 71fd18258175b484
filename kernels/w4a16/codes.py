"""Reading packed 4-bit codes in registers, without int-to-float conversions (the package doc):
the fp32 form (a code under the exponent of 2**23, read in place times ``16**j``: the bf16 GEMV
and the dense dequantization) and the half2 form (two fp16 ``1024 + c`` a word and HFMA2: the
fp16 GEMV and the GEMM tiles)."""

# No ``from __future__ import annotations``: Triton reads ``tl.constexpr`` annotations as objects.

from .._triton import HAS_TRITON, jit, tl


@jit
def _spread(words):
    """Packed words [..., C] -> int32 [..., 8C] with column ``8c + 2j + h`` holding word ``c``
    shifted right by ``16h``: that column's code is then its nibble ``j`` (see ``_codes``). The
    copies stay in the thread that loaded the word (``interleave`` is a register move)."""
    lo = tl.interleave(words, words)
    hi = words >> 16
    hi = tl.interleave(hi, hi)
    return tl.interleave(tl.interleave(lo, lo), tl.interleave(hi, hi))


@jit
def _column_consts(BLOCK_N: tl.constexpr):
    """Per column of a tile: the mask ``0xF << 4j`` of its nibble in ``_spread``'s word, and
    ``2**(-4j)``, the factor that undoes reading the code in place (times ``16**j``).

    AWQ's order puts columns ``2j`` and ``2j + 1`` in nibbles ``j`` and ``j + 4`` (the low and high
    16 bits), so column ``r`` of a word is nibble ``r // 2`` of half ``r % 2``; one AND reads it."""
    j4 = ((tl.arange(0, BLOCK_N) % 8) >> 1) * 4
    return 0xF << j4, ((127 - j4) << 23).to(tl.float32, bitcast=True)


@jit
def _codes(words, masks):
    """``float(code * 16**j) + 2**23`` of each column: the masked bits under an exponent of 2**23
    (exact: code * 16**j < 2**16), no int-to-float conversion instruction. Two such values
    subtract to ``(q - z) * 16**j`` exactly."""
    return ((words & masks) | 0x4B000000).to(tl.float32, bitcast=True)


# Two fp16 values in one int32 ("half2": the low 16 bits hold the first). On the GPU the
# arithmetic on them is one PTX ``fma.rn.f16x2`` (HFMA2: two weights per instruction); Triton's
# interpreter runs no inline assembly, so there the same rounding is emulated through fp32.
_const = tl.constexpr if HAS_TRITON else (lambda v: v)  # jit code reads only constexpr globals
F16X2_MAGIC = _const(0x64006400)  # 1024.0 twice: OR-ing a nibble into the mantissa gives 1024 + code
F16X2_ONE = _const(0x3C003C00)  # 1.0
F16X2_SIXTEENTH = _const(0x2C002C00)  # 1 / 16
F16X2_MINUS_ONE = _const(0xBC00BC00 - 2**32)  # -1.0 (as a signed int32)
F16X2_MINUS_SIXTEENTH = _const(0xAC00AC00 - 2**32)  # -1 / 16


@jit
def _half(w, HI: tl.constexpr):
    """Half ``HI`` (0: low, 1: high) of half2 words, as fp32."""
    if HI:
        w = w >> 16
    return w.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@jit
def _half2(lo, hi):
    """Two fp32 tensors rounded to fp16, packed as half2 words."""
    lo16 = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hi16 = hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
    return lo16 | (hi16 << 16)


@jit
def _hfma2(a, b, c, ASM: tl.constexpr):
    """``a * b + c`` on half2 words, rounded once to fp16 (the interpreter: via fp32)."""
    if ASM:
        return tl.inline_asm_elementwise("fma.rn.f16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        return _half2(_half(a, 0) * _half(b, 0) + _half(c, 0), _half(a, 1) * _half(b, 1) + _half(c, 1))


@jit
def _nibble_planes(q):
    """The 4 half2 planes of packed words: plane j holds columns 2j and 2j + 1 of each word (its
    nibbles j and j + 4, bits 4j and 16 + 4j) as ``1024 + code`` (j even) or ``1024 + 16 * code``
    (j odd), exact in fp16: one shift per word and one AND-OR (LOP3) per two weights."""
    hi = q >> 8
    return ((q & 0x000F000F) | F16X2_MAGIC, (q & 0x00F000F0) | F16X2_MAGIC,
            (hi & 0x000F000F) | F16X2_MAGIC, (hi & 0x00F000F0) | F16X2_MAGIC)


@jit
def _neg_zeros(z, ASM: tl.constexpr):
    """Per plane, ``-(1024 + z)`` (even planes) or ``-(64 + z)`` (odd: the code read as
    ``1024 + 16 z``, times 1/16) as half2, so that ``_centered`` subtracts the zero exactly."""
    z0, z1, z2, z3 = _nibble_planes(z)
    zero = tl.zeros(z.shape, tl.int32)
    m1 = tl.full(z.shape, F16X2_MINUS_ONE, tl.int32)
    m16 = tl.full(z.shape, F16X2_MINUS_SIXTEENTH, tl.int32)
    return _hfma2(z0, m1, zero, ASM), _hfma2(z1, m16, zero, ASM), _hfma2(z2, m1, zero, ASM), _hfma2(z3, m16, zero, ASM)


@jit
def _centered(q, nz0, nz1, nz2, nz3, ASM: tl.constexpr):
    """``q - z`` of packed words [R, P] (zeros [1, P]) as 4 half2 planes (see ``_nibble_planes``), exact: each is
    one HFMA2 ``v * 1 - (1024 + z)`` or ``v / 16 - (64 + z)`` on ``_nibble_planes``' values."""
    v0, v1, v2, v3 = _nibble_planes(q)
    one = tl.full(q.shape, F16X2_ONE, tl.int32)
    sixteenth = tl.full(q.shape, F16X2_SIXTEENTH, tl.int32)
    return (_hfma2(v0, one, nz0, ASM), _hfma2(v1, sixteenth, nz1, ASM),
            _hfma2(v2, one, nz2, ASM), _hfma2(v3, sixteenth, nz3, ASM))
