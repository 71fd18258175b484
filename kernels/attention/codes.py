"""Reading a quantized KV cache inside the attention kernels: code and (scale, zero) loads, and
the conversions of codes to floats, the portable ones and the inline-PTX ones (``ptx.py``). The
layouts are ``kv_cache.py``'s: int8 one byte a dim; int4 dims ``j`` and ``j + D / 2`` in the low
and high nibbles of byte ``j``."""

# No ``from __future__ import annotations``: Triton reads ``tl.constexpr`` annotations as objects.

from .._triton import jit, tl
from .ptx import (_U4_TO_BF16, _U4_TO_F16, _U4_TO_F16_BIASED, _U4_TO_F32, _U8_TO_BF16, _U8_TO_F16, _U8_TO_F16_BIASED,
                  _U8_TO_F32)


@jit
def _load_codes(ptr, off, d, mask, ROWS_ARE_KEYS: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr,
                BITS: tl.constexpr):
    """A quantized cache's codes at element offsets ``off`` [N], as uint8 values [D, N] (keys,
    for q @ k) or [N, D] (values): int8 one byte per dim; int4 dim ``d`` in byte ``d % (D / 2)``,
    low nibble for the first half of the dims, high for the second (``kv_cache.py``). MASKED:
    ``mask`` is the tile's, already shaped [D, N] or [N, D] (``tiles._tile_mask``): 0 where off."""
    if BITS == 4:
        HALF: tl.constexpr = HEAD_DIM // 2
        byte = d % HALF
        shift = (d // HALF * 4).to(tl.uint8)
    else:
        byte = d
    if ROWS_ARE_KEYS:
        if MASKED:
            c = tl.load(ptr + off[None, :] + byte[:, None], mask=mask, other=0)
        else:
            c = tl.load(ptr + off[None, :] + byte[:, None])
        if BITS == 4:
            c = (c >> shift[:, None]) & 0xF
    else:
        if MASKED:
            c = tl.load(ptr + off[:, None] + byte[None, :], mask=mask, other=0)
        else:
            c = tl.load(ptr + off[:, None] + byte[None, :])
        if BITS == 4:
            c = (c >> shift[None, :]) & 0xF
    return c


@jit
def _scale_zero(ptr, s_off, mask, MASKED: tl.constexpr):
    """The (scale, zero) pairs at offsets ``s_off`` [N], as two fp32 vectors (0 where masked)."""
    if MASKED:
        return (tl.load(ptr + s_off, mask=mask, other=0.0).to(tl.float32),
                tl.load(ptr + s_off + 1, mask=mask, other=0.0).to(tl.float32))
    return tl.load(ptr + s_off).to(tl.float32), tl.load(ptr + s_off + 1).to(tl.float32)


@jit
def _codes_as(c, dtype: tl.constexpr):
    """uint8 codes as ``dtype`` values, exactly. fp16: the magic-number read (``c | 0x6400`` is the
    fp16 ``1024 + c``), two integer ops and one subtraction instead of a slow int-to-float
    conversion per value; others: a plain conversion."""
    if dtype == tl.float16:
        return (c.to(tl.int16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
    return c.to(dtype)


@jit
def _u8_as(c, dtype: tl.constexpr, FAST: tl.constexpr, PURE: tl.constexpr, BIASED: tl.constexpr):
    """uint8 codes as ``dtype`` values, exactly (FAST: the asm above, for fp16 / bf16; BIASED: fp16
    1024 + c). PURE lets Triton hoist the layout conversion to the dot operand above it."""
    if FAST:
        if BIASED:
            return tl.inline_asm_elementwise(_U8_TO_F16_BIASED, "=r,=r,r", [c], dtype=tl.float16, is_pure=PURE,
                                             pack=4)
        elif dtype == tl.float16:
            return tl.inline_asm_elementwise(_U8_TO_F16, "=r,=r,r", [c], dtype=tl.float16, is_pure=PURE, pack=4)
        else:
            return tl.inline_asm_elementwise(_U8_TO_BF16, "=r,=r,r", [c], dtype=tl.bfloat16, is_pure=PURE, pack=4)
    elif BIASED:
        return _codes_as(c, dtype) + 1024.0
    else:
        return _codes_as(c, dtype)


@jit
def _u4_as(c, dtype: tl.constexpr, FAST: tl.constexpr, PURE: tl.constexpr, BIASED: tl.constexpr):
    """Bytes of two int4 codes as (low nibbles, high nibbles) in ``dtype``, exactly (as ``_u8_as``)."""
    if FAST:
        if BIASED:
            return tl.inline_asm_elementwise(_U4_TO_F16_BIASED, "=r,=r,=r,=r,r", [c],
                                             dtype=(tl.float16, tl.float16), is_pure=PURE, pack=4)
        elif dtype == tl.float16:
            return tl.inline_asm_elementwise(_U4_TO_F16, "=r,=r,=r,=r,r", [c], dtype=(tl.float16, tl.float16),
                                             is_pure=PURE, pack=4)
        else:
            return tl.inline_asm_elementwise(_U4_TO_BF16, "=r,=r,=r,=r,r", [c], dtype=(tl.bfloat16, tl.bfloat16),
                                             is_pure=PURE, pack=4)
    elif BIASED:
        return _codes_as(c & 0xF, dtype) + 1024.0, _codes_as(c >> 4, dtype) + 1024.0
    else:
        return _codes_as(c & 0xF, dtype), _codes_as(c >> 4, dtype)


@jit
def _code_halves(ptrs, mask, HALF: tl.constexpr, BITS: tl.constexpr, dtype: tl.constexpr, MASKED: tl.constexpr,
                 FAST: tl.constexpr, PURE: tl.constexpr, BIASED: tl.constexpr):
    """The codes of dims [0, HALF) and [HALF, 2 HALF) of the rows ``ptrs`` point into, as two
    ``dtype`` tensors (``_u8_as``). int8: two loads, HALF bytes apart; int4: one load, whose low
    and high nibbles are those halves (``kv_cache.py``'s layout)."""
    if MASKED:
        c = tl.load(ptrs, mask=mask, other=0)
    else:
        c = tl.load(ptrs)
    if BITS == 4:
        return _u4_as(c, dtype, FAST, PURE, BIASED)
    else:
        if MASKED:
            c2 = tl.load(ptrs + HALF, mask=mask, other=0)
        else:
            c2 = tl.load(ptrs + HALF)
        return _u8_as(c, dtype, FAST, PURE, BIASED), _u8_as(c2, dtype, FAST, PURE, BIASED)


@jit
def _scale_zero_rows(rows, mask, MASKED: tl.constexpr, PAIR: tl.constexpr):
    """The (scale, zero) pairs ``rows`` point at, as two fp32 vectors (0 where masked). PAIR: one
    32-bit load per pair (the pair is 4-byte aligned: the launcher checks)."""
    if PAIR:
        w_ptrs = rows.to(tl.pointer_type(tl.uint32), bitcast=True)
        if MASKED:
            w = tl.load(w_ptrs, mask=mask, other=0)
        else:
            w = tl.load(w_ptrs)
        scale = (w & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        zero = (w >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        return scale, zero
    else:
        return _scale_zero(rows, 0, mask, MASKED)


@jit
def _u8_f32(c, FAST: tl.constexpr):
    """int8 codes (uint8) as fp32."""
    if FAST:
        return tl.inline_asm_elementwise(_U8_TO_F32, "=r,=r,=r,=r,r", [c], dtype=tl.float32, is_pure=True, pack=4)
    return c.to(tl.float32)


@jit
def _u4_f32(c, FAST: tl.constexpr):
    """Bytes of two int4 codes as fp32 (low nibbles, high nibbles): the two halves of the dims
    (``kv_cache.py``'s layout)."""
    if FAST:
        lo, hi = tl.inline_asm_elementwise(_U4_TO_F32, "=r,=r,=r,=r,=r,=r,=r,=r,r", [c],
                                           dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
    else:
        lo = (c & 0xF).to(tl.float32)
        hi = (c >> 4).to(tl.float32)
    return lo, hi
