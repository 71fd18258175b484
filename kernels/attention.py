"""Attention over the paged KV cache for a flattened variable-length batch.

One entry point serves prefill, chunked prefill with a cached prefix, and decode: sequence ``b``
brings ``q_len = cu_seqlens_q[b+1] - cu_seqlens_q[b]`` new queries, which are the *last*
``q_len`` positions of its ``seqlens_k[b]`` keys (already written to the cache). Masking is
causal with that offset. The Triton kernels (GPU) are checked against ``paged_attention_ref``.

Two Triton kernels sit behind :func:`paged_attention`, chosen by ``max_seqlen_q``:

* **decode** (every sequence brings one query): flash-decoding. Grid ``(kv_head, sequence,
  partition)``: each program reads one slice of one sequence's keys for one kv head, once, and
  scores it against all ``H / Hkv`` query heads of that group together (the group padded to a
  power of two >= 16 rows so it feeds ``tl.dot``). A quantized cache with one query a kv head
  (MHA) has its own kernel on the CUDA cores, one warp a program (``_decode_simt_kernel``).
  With more than one partition the programs write partial (output, log-sum-exp) pairs and a
  second kernel, grid ``(head, sequence)``, merges them; so a long context is spread over many
  programs even at batch 1.
  The number of partitions is fixed by the grid (sized on the host for ``max_seqlen_k``, which a
  CUDA graph fixes at the longest allowed context), but each sequence cuts its *own* length into
  that many slices (whole key tiles, at least ``min_part`` keys): a short context in a graph
  captured for 4k tokens still spreads over the partitions instead of leaving most programs
  idle. When the batch alone fills the GPU, ``min_part`` is the host's partition size, so short
  sequences keep one program each; a sequence that one partition covers writes its output
  directly and the merge kernel skips it.
* **prefill** (any ``q_len >= 1``, with or without a cached prefix): flash attention. Grid
  ``(query_tile, head, sequence)`` over ``cdiv(max_seqlen_q, BLOCK_M)`` query tiles; programs past
  their sequence's ``q_len`` return at once (no host-side tile list, so no device sync when the
  caller passes ``max_seqlen_q``). Key tiles after the tile's last query position are never read.

Both read keys through the block table token by token (a gather per key row), so any block size
works, including the one-token blocks of the attention layer's cache-less path. Softmax runs in
fp32 with exp2 (the scale is folded with log2(e)); outputs are cast to ``q.dtype``.
"""

# No ``from __future__ import annotations``: Triton reads ``tl.constexpr`` annotations as objects.

import functools

import torch
import torch.nn.functional as F

from ._triton import (
    FLOAT_DTYPES,
    HAS_TRITON,
    TRITON_INTERPRETED,
    cdiv,
    is_pow2,
    jit,
    next_pow2,
    tl,
    triton_takes,
)
from .kv_cache import (CENTRE_GROUP, SCALE_DTYPE, KeyCentres, cache_bits, centre_position, dequantize_kv_ref,
                       key_shifts_ref, turn)


def gather_kv_ref(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """Read the first ``length`` token slots of one sequence: [length, Hkv, D]."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]  # [nb, bs, Hkv, D]
    return blocks.reshape(-1, *cache.shape[2:])[:length]


def paged_attention_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, seqlens_k: torch.Tensor, scale: float,
    k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None,
    key_centres: KeyCentres | None = None,
) -> torch.Tensor:
    """Plain-torch reference: gather each sequence's keys, then causal SDPA with GQA.

    q: [T, H, D]; caches: [num_blocks, block_size, Hkv, D]; block_tables: [B, max_blocks];
    cu_seqlens_q: [B+1]; seqlens_k: [B]. Returns [T, H, D]. A quantized cache (uint8 codes,
    ``kv_cache.KVCacheLayout``) comes with its ``k_scales`` / ``v_scales`` and is read back
    through ``dequantize_kv_ref``; with ``key_centres`` its keys were stored centred, and each
    gets its centre back (``kv_cache.key_shifts_ref``, the row of the sequence's first block).
    """
    assert q.dim() == 3 and k_cache.dim() == 4 and k_cache.shape == v_cache.shape
    bits = cache_bits(k_cache, q.shape[-1])
    assert (k_scales is not None) == (v_scales is not None) == bool(bits), "codes and scales go together"
    assert key_centres is None or bits, "key centres belong to a quantized cache: pass them with its scales"
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of kv heads"
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    starts, lens_k = cu_seqlens_q.tolist(), seqlens_k.tolist()
    for b, len_k in enumerate(lens_k):
        qs, qe = starts[b], starts[b + 1]
        len_q = qe - qs
        if len_q == 0:
            continue
        k = gather_kv_ref(k_cache, block_tables[b], len_k)
        v = gather_kv_ref(v_cache, block_tables[b], len_k)
        if bits:
            k = dequantize_kv_ref(k, gather_kv_ref(k_scales, block_tables[b], len_k), bits)
            if key_centres is not None:
                table = key_centres.table
                rows = block_tables[b, :1].long().clamp(max=table.shape[0] - 1).expand(len_k)
                k = k + key_shifts_ref(table, rows, torch.arange(len_k), key_centres.cos_sin)
            v = dequantize_kv_ref(v, gather_kv_ref(v_scales, block_tables[b], len_k), bits)
        qb = q[qs:qe].transpose(0, 1)  # [H, Lq, D]
        kb = k.transpose(0, 1).repeat_interleave(group, dim=0)  # [H, Lk, D]
        vb = v.transpose(0, 1).repeat_interleave(group, dim=0)
        # Query i sits at absolute position len_k - len_q + i and sees keys 0..that position.
        q_pos = torch.arange(len_k - len_q, len_k, device=q.device)
        mask = torch.arange(len_k, device=q.device)[None, :] <= q_pos[:, None]
        ob = F.scaled_dot_product_attention(
            qb.to(torch.float32), kb.to(torch.float32), vb.to(torch.float32),
            attn_mask=mask, scale=scale,
        )
        out[qs:qe] = ob.transpose(0, 1).to(q.dtype)
    return out


# Decode partition (tokens per program) bounds; the size in between is picked to fill the GPU.
DECODE_PARTITION = 512  # used under the interpreter (no GPU to fill)
_MIN_DECODE_PARTITION = 128
_MAX_DECODE_PARTITION = 1024
_LOG2E = 1.4426950408889634
# The quantized decode kernel's TUNE bits (below) and register cap, chosen on an H200 (Llama-2-7B
# layer shapes, batch 256 x 1k keys, bench_kv_quant --variants, kernel time; int8 / int4 us):
# the codes converted in registers by PTX, everything else as before: 1210 / 1129; capped at 128
# registers (4 programs an SM instead of 3, or 2 for int4; the spills stay out of the loop):
# 1005 / 864; the key codes' conversion after the shared-memory round trip (only the values are
# staged as fp16 for the transposed operand), which needs that cap: 816 / 747.
_DECODE_TUNE = 53
_DECODE_MAXNREG = 128
# One query a kv head (MHA: Llama-2-7B) walks a quantized cache on the CUDA cores (_decode_simt_kernel),
# one warp a program, key tiles of _SIMT_BLOCK_N; groups use the tensor cores (_decode_quant).
# H200, Llama-2-7B layer, int8, batch 256 x 1k keys: 532 us against 813 (one warp, 32-key tiles;
# 16 keys: 626, 64: 586; 2 warps: 1,018, 4 warps: 1,114, their key reductions crossing warps
# through shared memory).
_SIMT_BLOCK_N = 32
# One-warp programs: enough of them to fill an SM (the 4-warp kernels need 2).
_SIMT_PROGRAMS_PER_SM = 8


@jit
def _fold_tile(s, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """One online-softmax step: fold log2-scaled scores s [M, N] over values v [N, D] into (m, l, acc)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@jit
def _kv_offsets(
    bt_row, n, n_mask, kv_head,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_sb, stride_ss, stride_sh,
    BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr,
):
    """Element offsets of one kv head's keys, values and (quantized caches) scales at key
    positions ``n``, read through the sequence's block table row ``bt_row``. MASKED: positions
    where ``n_mask`` is false read block 0; without it every position must lie inside the
    sequence (no mask: the common, faster case). The loads stay in the kernels, each where its
    value is first needed (the key before the dot, the value after it), the order the loops
    were tuned with."""
    if MASKED:
        block = tl.load(bt_row + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    else:
        block = tl.load(bt_row + n // BLOCK_SIZE).to(tl.int64)
    slot = n % BLOCK_SIZE
    k_off = block * stride_kb + slot * stride_ks + kv_head * stride_kh
    v_off = block * stride_vb + slot * stride_vs + kv_head * stride_vh
    s_off = block * stride_sb + slot * stride_ss + kv_head * stride_sh
    return k_off, v_off, s_off


@jit
def _load_codes(ptr, off, d, mask, ROWS_ARE_KEYS: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr,
                BITS: tl.constexpr):
    """A quantized cache's codes at element offsets ``off`` [N], as uint8 values [D, N] (keys,
    for q @ k) or [N, D] (values): int8 one byte per dim; int4 dim ``d`` in byte ``d % (D / 2)``,
    low nibble for the first half of the dims, high for the second (``kv_cache.py``)."""
    if BITS == 4:
        HALF: tl.constexpr = HEAD_DIM // 2
        byte = d % HALF
        shift = (d // HALF * 4).to(tl.uint8)
    else:
        byte = d
    if ROWS_ARE_KEYS:
        if MASKED:
            c = tl.load(ptr + off[None, :] + byte[:, None], mask=mask[None, :], other=0)
        else:
            c = tl.load(ptr + off[None, :] + byte[:, None])
        if BITS == 4:
            c = (c >> shift[:, None]) & 0xF
    else:
        if MASKED:
            c = tl.load(ptr + off[:, None] + byte[None, :], mask=mask[:, None], other=0)
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


_asm = tl.constexpr if HAS_TRITON else str  # jitted code reads only constexpr globals

# Codes to 16-bit floats on the GPU, four codes (one 32-bit word) per asm block, by the magic
# number trick: a byte placed under the fp16 exponent of 1024 (0x64) reads as 1024 + c, one byte
# permute per two codes. The *_BIASED forms stop there (the kernel subtracts 1024 x the dot's
# other operand's sum once instead); the others subtract 1024 with one packed instruction. Not
# runnable under the interpreter: the launcher passes FAST=False there, and the portable twin
# (_codes_as) runs instead.
def _u8_to_f16(biased: bool) -> str:
    # Unbiased: one packed subtraction of 1024 per two codes more.
    regs, setup, sub = ("k", "", "") if biased else (
        "k, m", "mov.b32 m, 0x64006400;\n", "sub.f16x2 $0, $0, m;\nsub.f16x2 $1, $1, m;\n")
    return f"""{{
.reg .b32 {regs};
mov.b32 k, 0x64646464;
{setup}prmt.b32 $0, $2, k, 0x4140;
prmt.b32 $1, $2, k, 0x4342;
{sub}}}"""


_U8_TO_F16_BIASED = _asm(_u8_to_f16(biased=True))
_U8_TO_F16 = _asm(_u8_to_f16(biased=False))
# bf16 has too few mantissa bits for a byte under one exponent: 2**23 + c in fp32, then packed.
_U8_TO_BF16 = _asm("""{
.reg .b32 k, f0, f1, f2, f3;
mov.b32 k, 0x4B000000;
prmt.b32 f0, $2, k, 0x7440;
prmt.b32 f1, $2, k, 0x7441;
prmt.b32 f2, $2, k, 0x7442;
prmt.b32 f3, $2, k, 0x7443;
sub.f32 f0, f0, 0f4B000000;
sub.f32 f1, f1, 0f4B000000;
sub.f32 f2, f2, 0f4B000000;
sub.f32 f3, f3, 0f4B000000;
cvt.rn.bf16x2.f32 $0, f1, f0;
cvt.rn.bf16x2.f32 $1, f3, f2;
}""")
# int4: $0,$1 the low nibbles, $2,$3 the high ones; each byte's two nibbles spread into the two
# halves of a word first. fp16: the low nibble under 0x6400 is 1024 + n; the high one, masked in
# place, 1024 + 16 n, which one fma brings to 1024 + n (biased) or n.
def _u4_to_f16(biased: bool) -> str:
    # The high nibbles' fma lands on 1024 + n (biased) or n; unbiased, the low ones lose 1024 too.
    sub = "" if biased else "sub.f16x2 $0, $0, k;\nsub.f16x2 $1, $1, k;\n"
    return f"""{{
.reg .b32 z, t0, t1, k, s, o;
mov.b32 z, 0;
mov.b32 k, 0x64006400;
mov.b32 s, 0x2C002C00;
mov.b32 o, {'0x63806380' if biased else '0xD400D400'};
prmt.b32 t0, $4, z, 0x4140;
prmt.b32 t1, $4, z, 0x4342;
lop3.b32 $0, t0, 0x000F000F, k, 0xEA;
lop3.b32 $1, t1, 0x000F000F, k, 0xEA;
lop3.b32 $2, t0, 0x00F000F0, k, 0xEA;
lop3.b32 $3, t1, 0x00F000F0, k, 0xEA;
{sub}fma.rn.f16x2 $2, $2, s, o;
fma.rn.f16x2 $3, $3, s, o;
}}"""


_U4_TO_F16_BIASED = _asm(_u4_to_f16(biased=True))
_U4_TO_F16 = _asm(_u4_to_f16(biased=False))
# bf16: 128 + n under 0x4300 (exact for n < 128), the high nibbles shifted down first.
_U4_TO_BF16 = _asm("""{
.reg .b32 z, t0, t1, u0, u1, k, one, o;
mov.b32 z, 0;
mov.b32 k, 0x43004300;
mov.b32 one, 0x3F803F80;
mov.b32 o, 0xC300C300;
prmt.b32 t0, $4, z, 0x4140;
prmt.b32 t1, $4, z, 0x4342;
shr.b32 u0, t0, 4;
shr.b32 u1, t1, 4;
lop3.b32 $0, t0, 0x000F000F, k, 0xEA;
lop3.b32 $1, t1, 0x000F000F, k, 0xEA;
lop3.b32 $2, u0, 0x000F000F, k, 0xEA;
lop3.b32 $3, u1, 0x000F000F, k, 0xEA;
fma.rn.bf16x2 $0, $0, one, o;
fma.rn.bf16x2 $1, $1, one, o;
fma.rn.bf16x2 $2, $2, one, o;
fma.rn.bf16x2 $3, $3, one, o;
}""")
# Codes to fp32 for the CUDA-core decode kernel (_decode_simt_kernel): a byte placed under the fp32
# exponent of 2**23 (0x4B000000) reads as 2**23 + c, taken back by one subtraction (a plain
# int-to-float conversion runs at a quarter of the rate). Four codes per 32-bit word; int4: the
# word's low nibbles and high nibbles, masked apart first.
def _bytes_to_f32(src: str, first: int) -> str:
    # The four bytes of register src into outputs $first.. $first+3, each 2**23 + c, then c.
    permutes = "".join(f"prmt.b32 ${first + i}, {src}, k, 0x744{i};\n" for i in range(4))
    return permutes + "".join(f"sub.f32 ${first + i}, ${first + i}, 0f4B000000;\n" for i in range(4))


_U8_TO_F32 = _asm("{\n.reg .b32 k;\nmov.b32 k, 0x4B000000;\n" + _bytes_to_f32("$4", 0) + "}")
_U4_TO_F32 = _asm("{\n.reg .b32 k, lo, hi;\nmov.b32 k, 0x4B000000;\nand.b32 lo, $8, 0x0F0F0F0F;\n"
                  "shr.u32 hi, $8, 4;\nand.b32 hi, hi, 0x0F0F0F0F;\n"
                  + _bytes_to_f32("lo", 0) + _bytes_to_f32("hi", 4) + "}")


# Bits of the quantized decode kernel's TUNE: variants it can be compiled in, all computing the
# same attention (tested), timed with bench_kv_quant --variants; _DECODE_TUNE is the chosen set.
TUNE_K_HOIST = 1  # key codes (PTX): Triton may convert them after their shared-memory round trip
TUNE_V_HOIST = 2  # value codes: likewise (slow: the value operand is transposed, read bytewise)
TUNE_FOLD = 4  # fp16: codes read as 1024 + c, the 1024 folded into the softmax terms
TUNE_SCALE_AHEAD = 8  # each tile's scales loaded one tile ahead by hand
TUNE_PAIR = 16  # (scale, zero) read as one 32-bit word (PTX; Triton then pipelines those loads)
TUNE_LAZY = 32  # row sums kept per key column, summed once at the end


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
def _decode_quant_tile(
    q_lo, q_hi, qsum, k_lo, k_hi, v_lo, v_hi, ksc, kz, vsc, vz, n_mask, m_i, l_i, acc_lo, acc_hi, z_acc, centre,
    BIASED: tl.constexpr, LAZY: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
    CENTRED: tl.constexpr,
):
    """One key tile of a quantized cache (codes as loaded by ``_code_halves``, scales and zeros
    [N]) folded into the running softmax. The codes enter the dots as they are (small integers,
    exact in fp16/bf16), split in two halves of the head dim (an int4 byte holds one dim of each),
    and the per-key scale and zero come after: ``q . (c s + z) = s (q . c) + z sum(q)`` and
    ``p @ (c s + z) = (p s) @ c + sum(p z)``, so no dequantized key or value is ever made.
    ``z_acc`` gathers the values' zero terms, added to every dim at the end. LAZY: ``l_i`` and
    ``z_acc`` are [M, N] (one partial sum per key column, summed over the columns once, after
    the last tile: two cross-warp reductions a tile fewer); else [M].
    ``ksc`` comes times the log2 softmax scale, and ``qsum`` is sum(q) times it too; BIASED (codes
    read as 1024 + c) it is the pair (that, -1024 sum(q)): ``s q.(c + 1024) - 1024 s sum(q)``.
    CENTRED: ``centre`` [M, N] holds the keys' centres' scores (``_centre_scores``)."""
    dt: tl.constexpr = q_lo.dtype
    s = tl.dot(q_lo, k_lo, input_precision=DOT_PRECISION)
    s = tl.dot(q_hi, k_hi, s, input_precision=DOT_PRECISION)
    if BIASED:
        qs, qb = qsum
        s = (s + qb[:, None]) * ksc[None, :] + qs[:, None] * kz[None, :]
    else:
        s = s * ksc[None, :] + qsum[:, None] * kz[None, :]
    if CENTRED:
        s += centre
    if MASKED:
        s = tl.where(n_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    ps = (p * vsc[None, :]).to(dt)
    z = p * vz[None, :]
    if BIASED:  # p @ (c + 1024) carries 1024 sum(p s) on every dim: taken back with the zeros
        z = z - 1024.0 * ps.to(tl.float32)
    if LAZY:
        l_i = l_i * alpha[:, None] + p
        z_acc = z_acc * alpha[:, None] + z
    else:
        l_i = l_i * alpha + tl.sum(p, 1)
        z_acc = z_acc * alpha + tl.sum(z, 1)
    acc_lo = tl.dot(ps, v_lo, acc_lo * alpha[:, None], input_precision=DOT_PRECISION)
    acc_hi = tl.dot(ps, v_hi, acc_hi * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc_lo, acc_hi, z_acc


@jit
def _decode_quant_rows(k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, n0, tok, n_mask, kv_head,
                       stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                       stride_sb, stride_ss, stride_sh,
                       BLOCK_SIZE: tl.constexpr, IN_BLOCK: tl.constexpr, MASKED: tl.constexpr):
    """Pointers to the rows of key positions ``n0 + tok`` (codes of k and v, their scales) for one
    kv head. IN_BLOCK: the tile lies inside one cache block, whose number is read once (a scalar)
    and the rows sit at fixed offsets from its start; else each position reads its own block."""
    if IN_BLOCK:
        block = tl.load(bt_row + n0 // BLOCK_SIZE).to(tl.int64)
        slot = n0 % BLOCK_SIZE
        k_rows = (k_ptr + (block * stride_kb + slot * stride_ks + kv_head * stride_kh)) + tok * stride_ks
        v_rows = (v_ptr + (block * stride_vb + slot * stride_vs + kv_head * stride_vh)) + tok * stride_vs
        s_off = block * stride_sb + slot * stride_ss + kv_head * stride_sh
        return k_rows, v_rows, (ks_ptr + s_off) + tok * stride_ss, (vs_ptr + s_off) + tok * stride_ss
    else:
        k_off, v_off, s_off = _kv_offsets(bt_row, n0 + tok, n_mask, kv_head, stride_kb, stride_ks, stride_kh,
                                          stride_vb, stride_vs, stride_vh, stride_sb, stride_ss, stride_sh,
                                          BLOCK_SIZE, MASKED)
        return k_ptr + k_off, v_ptr + v_off, ks_ptr + s_off, vs_ptr + s_off


@jit
def _scores(q, k_ptr, ks_ptr, k_off, s_off, d, n_mask, qsum, qk_scale,
            HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, BITS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """log2-scaled scores q @ k [M, N] of the keys at offsets ``k_off``. A quantized cache's codes
    enter the dot as they are (small integers, exact in fp16/bf16) and the per-key scale and zero
    come after: ``q . (c * s + z) = s * (q . c) + z * sum(q)``, so no dequantized key is ever made."""
    if BITS:
        c = _load_codes(k_ptr, k_off, d, n_mask, True, HEAD_DIM, MASKED, BITS)
        s = tl.dot(q, _codes_as(c, q.dtype), input_precision=DOT_PRECISION)
        scale, zero = _scale_zero(ks_ptr, s_off, n_mask, MASKED)
        s = s * scale[None, :] + qsum[:, None] * zero[None, :]
    elif MASKED:
        k_t = tl.load(k_ptr + k_off[None, :] + d[:, None], mask=n_mask[None, :], other=0.0)  # [D, N]
        s = tl.dot(q, k_t, input_precision=DOT_PRECISION)
    else:
        k_t = tl.load(k_ptr + k_off[None, :] + d[:, None])  # [D, N]
        s = tl.dot(q, k_t, input_precision=DOT_PRECISION)
    return s * qk_scale


@jit
def _fold_values(s, v_ptr, vs_ptr, v_off, s_off, d, n_mask, m_i, l_i, acc, q_dtype: tl.constexpr,
                 HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, BITS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Load the values at offsets ``v_off`` and fold scores ``s`` over them (``_fold_tile``). A
    quantized cache's codes enter the dot as they are, the per-value scale folded into the
    probabilities and the zero added as one row sum: ``p @ (c * s + z) = (p * s) @ c + sum(p * z)``."""
    if BITS:
        c = _load_codes(v_ptr, v_off, d, n_mask, False, HEAD_DIM, MASKED, BITS)
        scale, zero = _scale_zero(vs_ptr, s_off, n_mask, MASKED)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        pv = tl.dot((p * scale[None, :]).to(q_dtype), _codes_as(c, q_dtype), input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv + tl.sum(p * zero[None, :], 1)[:, None]
        return m_new, l_i, acc
    elif MASKED:
        v = tl.load(v_ptr + v_off[:, None] + d[None, :], mask=n_mask[:, None], other=0.0)  # [N, D]
        return _fold_tile(s, v, m_i, l_i, acc, DOT_PRECISION)
    else:
        v = tl.load(v_ptr + v_off[:, None] + d[None, :])  # [N, D]
        return _fold_tile(s, v, m_i, l_i, acc, DOT_PRECISION)


@jit
def _tile_step(
    q, qsum, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, n, n_mask, visible, kv_head, d, m_i, l_i, acc, qk_scale,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_sb, stride_ss, stride_sh,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, BITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, centre=0.0, CENTRED: tl.constexpr = False,
):
    """One key tile: load the keys, score, mask (MASKED: the tile may run past the sequence,
    ``n_mask``, and is seen only where ``visible``), load the values, fold into the running
    softmax. ``qsum``: the rows' sums of q, for a quantized cache's zeros; CENTRED: ``centre``
    [M, N] the keys' centres' scores (``_centre_scores_dot``)."""
    k_off, v_off, s_off = _kv_offsets(bt_row, n, n_mask, kv_head, stride_kb, stride_ks, stride_kh,
                                      stride_vb, stride_vs, stride_vh, stride_sb, stride_ss, stride_sh,
                                      BLOCK_SIZE, MASKED)
    s = _scores(q, k_ptr, ks_ptr, k_off, s_off, d, n_mask, qsum, qk_scale, HEAD_DIM, MASKED, BITS, DOT_PRECISION)
    if CENTRED:
        s += centre * qk_scale
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
    return _fold_values(s, v_ptr, vs_ptr, v_off, s_off, d, n_mask, m_i, l_i, acc, q.dtype,
                        HEAD_DIM, MASKED, BITS, DOT_PRECISION)


@jit
def _decode_quant(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, row, heads, g_mask, kv_head, start, end,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_sb, stride_ss, stride_sh, qk_scale,
    qm_ptr, c_ptr, cs_ptr, stride_qmt, stride_qmh, stride_c_row, stride_c_h, last_row, stride_cs, max_pos,
    GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    BITS: tl.constexpr, FAST: tl.constexpr, TUNE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    CENTRED: tl.constexpr, GROUP_C: tl.constexpr,
):
    """The decode kernel's walk over keys ``[start, end)`` of a quantized cache: returns (m, l,
    acc of the low half of the dims, acc of the high half, the values' zero terms). Whole tiles
    go unmasked and the last, partial one masked; a tile inside one cache block (block size a
    multiple of BLOCK_N) reads the block table once."""
    HALF: tl.constexpr = HEAD_DIM // 2
    IN_BLOCK: tl.constexpr = BLOCK_SIZE % BLOCK_N == 0
    K_PURE: tl.constexpr = (TUNE & 1) != 0
    V_PURE: tl.constexpr = (TUNE & 2) != 0
    BIASED: tl.constexpr = (TUNE & 4) != 0
    AHEAD: tl.constexpr = (TUNE & 8) != 0 and IN_BLOCK
    PAIR: tl.constexpr = (TUNE & 16) != 0
    LAZY: tl.constexpr = (TUNE & 32) != 0
    j = tl.arange(0, HALF)
    tok = tl.arange(0, BLOCK_N)
    q_rows = q_ptr + row * stride_qt + heads[:, None] * stride_qh
    # Padding rows (g >= GROUP) load zeros: their scores are finite and their results never stored.
    q_lo = tl.load(q_rows + j[None, :], mask=g_mask[:, None], other=0.0)
    q_hi = tl.load(q_rows + HALF + j[None, :], mask=g_mask[:, None], other=0.0)
    dt: tl.constexpr = q_lo.dtype
    q_total = tl.sum(q_lo.to(tl.float32), 1) + tl.sum(q_hi.to(tl.float32), 1)
    if BIASED:
        qsum = (q_total * qk_scale, -1024.0 * q_total)
    else:
        qsum = q_total * qk_scale  # for the keys' zeros

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    if LAZY:
        l_i = tl.zeros([GROUP_PAD, BLOCK_N], tl.float32)
        z_acc = tl.zeros([GROUP_PAD, BLOCK_N], tl.float32)
    else:
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        z_acc = tl.zeros([GROUP_PAD], tl.float32)
    acc_lo = tl.zeros([GROUP_PAD, HALF], tl.float32)
    acc_hi = tl.zeros([GROUP_PAD, HALF], tl.float32)
    if CENTRED:
        ca, cb = _centre_coeffs(qm_ptr + row * stride_qmt + heads[:, None] * stride_qmh, g_mask[:, None],
                                _centre_row(bt_row, c_ptr, stride_c_row, last_row) + kv_head * stride_c_h, j,
                                qk_scale, HALF)
    full_end = start + (end - start) // BLOCK_N * BLOCK_N
    if AHEAD:
        _, _, ks_rows, vs_rows = _decode_quant_rows(
            k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, start, tok, tok, kv_head, stride_kb, stride_ks, stride_kh,
            stride_vb, stride_vs, stride_vh, stride_sb, stride_ss, stride_sh, BLOCK_SIZE, IN_BLOCK, False)
        ksc, kz = _scale_zero_rows(ks_rows, tok, False, PAIR)
        vsc, vz = _scale_zero_rows(vs_rows, tok, False, PAIR)
    for n0 in range(start, full_end, BLOCK_N):
        k_rows, v_rows, ks_rows, vs_rows = _decode_quant_rows(
            k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, n0, tok, tok, kv_head, stride_kb, stride_ks, stride_kh,
            stride_vb, stride_vs, stride_vh, stride_sb, stride_ss, stride_sh, BLOCK_SIZE, IN_BLOCK, False)
        k_lo, k_hi = _code_halves(k_rows[None, :] + j[:, None], tok, HALF, BITS, dt, False, FAST, K_PURE, BIASED)
        v_lo, v_hi = _code_halves(v_rows[:, None] + j[None, :], tok, HALF, BITS, dt, False, FAST, V_PURE, BIASED)
        if AHEAD:
            # The next whole tile's scales (the last tile's again at the end: no mask needed).
            _, _, ks_next, vs_next = _decode_quant_rows(
                k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, tl.minimum(n0 + BLOCK_N, full_end - BLOCK_N), tok, tok,
                kv_head, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_sb, stride_ss,
                stride_sh, BLOCK_SIZE, IN_BLOCK, False)
            ksc_n, kz_n = _scale_zero_rows(ks_next, tok, False, PAIR)
            vsc_n, vz_n = _scale_zero_rows(vs_next, tok, False, PAIR)
        else:
            ksc, kz = _scale_zero_rows(ks_rows, tok, False, PAIR)
            vsc, vz = _scale_zero_rows(vs_rows, tok, False, PAIR)
        if CENTRED:
            centre = _centre_scores(ca, cb, cs_ptr, stride_cs, n0, max_pos, j, HALF, BLOCK_N, GROUP_C)
        else:
            centre = 0.0  # (set in the loop: a loop-carried value keeps one type)
        m_i, l_i, acc_lo, acc_hi, z_acc = _decode_quant_tile(
            q_lo, q_hi, qsum, k_lo, k_hi, v_lo, v_hi, ksc * qk_scale, kz, vsc, vz, tok, m_i, l_i, acc_lo, acc_hi,
            z_acc, centre, BIASED, LAZY, False, DOT_PRECISION, CENTRED)
        if AHEAD:
            ksc, kz, vsc, vz = ksc_n, kz_n, vsc_n, vz_n
    if full_end < end:
        # The first key of a partition is inside the sequence, so m_i is finite after any tile.
        n_mask = full_end + tok < end
        k_rows, v_rows, ks_rows, vs_rows = _decode_quant_rows(
            k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, full_end, tok, n_mask, kv_head, stride_kb, stride_ks, stride_kh,
            stride_vb, stride_vs, stride_vh, stride_sb, stride_ss, stride_sh, BLOCK_SIZE, IN_BLOCK, True)
        k_lo, k_hi = _code_halves(k_rows[None, :] + j[:, None], n_mask[None, :], HALF, BITS, dt, True, FAST,
                                  K_PURE, BIASED)
        v_lo, v_hi = _code_halves(v_rows[:, None] + j[None, :], n_mask[:, None], HALF, BITS, dt, True, FAST,
                                  V_PURE, BIASED)
        ksc, kz = _scale_zero_rows(ks_rows, n_mask, True, PAIR)
        vsc, vz = _scale_zero_rows(vs_rows, n_mask, True, PAIR)
        if CENTRED:
            centre = _centre_scores(ca, cb, cs_ptr, stride_cs, full_end, max_pos, j, HALF, BLOCK_N, GROUP_C)
        else:
            centre = 0.0
        m_i, l_i, acc_lo, acc_hi, z_acc = _decode_quant_tile(
            q_lo, q_hi, qsum, k_lo, k_hi, v_lo, v_hi, ksc * qk_scale, kz, vsc, vz, n_mask, m_i, l_i, acc_lo,
            acc_hi, z_acc, centre, BIASED, LAZY, True, DOT_PRECISION, CENTRED)
    if LAZY:
        l_i = tl.sum(l_i, 1)
        z_acc = tl.sum(z_acc, 1)
    return m_i, l_i, acc_lo, acc_hi, z_acc


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


@jit
def _centre_coeffs(qm_rows, q_mask, m_ptr, j, qk_scale, HALF: tl.constexpr):
    """For centred keys (``kv_cache.KeyCentring``): a key at centre position p gets back the score
    ``q . R(p) m`` of its sequence's mean key ``m`` (``m_ptr``, fp16) turned there, with ``q`` the
    query before the key basis (rows ``qm_rows`` [R, 1] pointers, dims ``j`` [HALF]). Pairwise,
    that is ``sum(a cos(p w) + b sin(p w))`` with ``a = q1 m1 + q2 m2`` and ``b = q2 m1 - q1 m2``
    over the dim pairs (j, HALF + j): a and b [R, HALF], log2-scaled, once a program, then one
    rotary table row a group of keys (``_centre_scores``)."""
    q1 = tl.load(qm_rows + j[None, :], mask=q_mask, other=0.0).to(tl.float32) * qk_scale
    q2 = tl.load(qm_rows + HALF + j[None, :], mask=q_mask, other=0.0).to(tl.float32) * qk_scale
    m1 = tl.load(m_ptr + j).to(tl.float32)[None, :]
    m2 = tl.load(m_ptr + HALF + j).to(tl.float32)[None, :]
    return q1 * m1 + q2 * m2, q2 * m1 - q1 * m2


@jit
def _centre_scores(a, b, cs_ptr, stride_cs, n0, max_pos, j, HALF: tl.constexpr, BLOCK_N: tl.constexpr,
                   GROUP: tl.constexpr):
    """The centres' scores [R, BLOCK_N] of keys ``n0 .. n0 + BLOCK_N`` (``_centre_coeffs``): one
    value a group of GROUP keys (n0 a multiple of min(BLOCK_N, GROUP): tiles never straddle)."""
    col = tl.arange(0, BLOCK_N)
    out = tl.zeros([a.shape[0], BLOCK_N], tl.float32)
    for g in tl.static_range(max(BLOCK_N // GROUP, 1)):
        p = centre_position(n0 + g * GROUP, max_pos, GROUP)  # int32: positions stay far below 2**31 / D
        cos = tl.load(cs_ptr + p * stride_cs + j).to(tl.float32)[None, :]
        sin = tl.load(cs_ptr + p * stride_cs + HALF + j).to(tl.float32)[None, :]
        score = tl.sum(a * cos + b * sin, 1)
        out = tl.where((col // GROUP == g)[None, :], score[:, None], out)
    return out


@jit
def _centre_scores_dot(qm_lo, qm_hi, m1, m2, cs_ptr, stride_cs, n, max_pos, j, HALF: tl.constexpr,
                       GROUP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The centres' scores [M, N] of keys at positions ``n`` [N] for queries given before the key
    basis as halves ``qm_lo``, ``qm_hi`` [M, HALF] (``_centre_coeffs``), on the tensor cores: the
    sequence's mean key (halves m1, m2 [HALF], float32) turned to each key's centre position
    makes an extra [D, N] key tile in q's dtype. For the prefill kernel, whose query tiles are
    too large for ``_centre_coeffs``' [M, HALF] pairs in registers."""
    p = centre_position(n.to(tl.int64), max_pos, GROUP)
    u1, u2 = turn(m1[:, None], m2[:, None], cs_ptr, p[None, :], stride_cs, j[:, None], HALF)  # [HALF, N]
    return tl.dot(qm_hi, u2.to(qm_lo.dtype), tl.dot(qm_lo, u1.to(qm_lo.dtype), input_precision=DOT_PRECISION),
                  input_precision=DOT_PRECISION)


@jit
def _centre_row(bt_row, c_ptr, stride_c_row, last_row):
    """The centre row of a sequence (its first block's, or the zero row past the table)."""
    return c_ptr + tl.minimum(tl.load(bt_row).to(tl.int64), last_row) * stride_c_row


@jit
def _decode_simt_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, cu_q_ptr, seqlens_k_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    qm_ptr, c_ptr, cs_ptr,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_sb, stride_ss, stride_sh,
    stride_bt, stride_ot, stride_oh, stride_pob, stride_poh, stride_pop, stride_plb, stride_plh,
    stride_qmt, stride_qmh, stride_c_row, stride_c_h, last_row, stride_cs, max_pos,
    qk_scale, min_part,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    BITS: tl.constexpr, FAST: tl.constexpr, PAIR: tl.constexpr, CENTRED: tl.constexpr, GROUP_C: tl.constexpr,
):
    """Decode attention over a quantized cache on the CUDA cores, for one query a kv head (MHA):
    the decode kernel's partitions and results (``_decode_kernel``), one warp a program, grid
    ``(head, sequence, partition)``. The codes become fp32 in registers (``_U8_TO_F32``) and the
    dots are elementwise products summed inside the warp: no shared memory, no barrier, no query
    padded to 16 rows as the tensor-core walk (``_decode_quant``) needs. The per-key scale and
    zero come after the products: ``q . (c s + z) = s (q . c) + z sum(q)`` and ``p @ (c s + z)
    = (p s) @ c + sum(p z)``. int8 reads whole rows; int4 a row of bytes, whose low and high
    nibbles are the two halves of the dims (``kv_cache.py``'s layout). Keys and values share
    strides (the launcher checks). Mind the code layouts Triton picks: with the codes loaded
    inside the converting function, every lane held every key's score (32 exp2 a lane instead of
    one) and the kernel ran 1.5x slower (SASS checked offline: ``MUFU.EX2`` count)."""
    head = tl.program_id(0)
    seq = tl.program_id(1)
    part = tl.program_id(2)
    seqlen = tl.load(seqlens_k_ptr + seq)
    part_len = tl.maximum(tl.cdiv(tl.cdiv(seqlen, tl.num_programs(2)), BLOCK_N) * BLOCK_N, min_part)
    start = part * part_len
    if start >= seqlen:
        return
    end = tl.minimum(start + part_len, seqlen)
    row = tl.load(cu_q_ptr + seq).to(tl.int64)
    IN_BLOCK: tl.constexpr = BLOCK_SIZE % BLOCK_N == 0
    COLS: tl.constexpr = HEAD_DIM // 2 if BITS == 4 else HEAD_DIM
    c = tl.arange(0, COLS)
    tok = tl.arange(0, BLOCK_N)
    q_row = q_ptr + row * stride_qt + head * stride_qh + c
    q_a = tl.load(q_row).to(tl.float32) * qk_scale  # times the log2 softmax scale
    if BITS == 4:
        q_b = tl.load(q_row + COLS).to(tl.float32) * qk_scale
        qsum = tl.sum(q_a, 0) + tl.sum(q_b, 0)
    else:
        qsum = tl.sum(q_a, 0)
    m_i = float("-inf")
    l_i = 0.0
    z_i = 0.0
    acc_a = tl.zeros([COLS], tl.float32)
    acc_b = tl.zeros([COLS], tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    if CENTRED:
        HALF: tl.constexpr = HEAD_DIM // 2
        jc = tl.arange(0, HALF)
        ca, cb = _centre_coeffs((qm_ptr + row * stride_qmt + head * stride_qmh) + tl.zeros([1, 1], tl.int64),
                                jc[None, :] < HALF, _centre_row(bt_row, c_ptr, stride_c_row, last_row)
                                + head * stride_c_h, jc, qk_scale, HALF)
    for n0 in range(start, end, BLOCK_N):
        n_mask = n0 + tok < end
        if IN_BLOCK:  # the tile inside one cache block: its number read once
            block = tl.load(bt_row + n0 // BLOCK_SIZE).to(tl.int64)
            slot = n0 % BLOCK_SIZE
            rows = block * stride_kb + slot * stride_ks + head * stride_kh + tok * stride_ks
            s_rows = block * stride_sb + slot * stride_ss + head * stride_sh + tok * stride_ss
        else:
            rows, _, s_rows = _kv_offsets(bt_row, n0 + tok, n_mask, head, stride_kb, stride_ks, stride_kh,
                                          stride_kb, stride_ks, stride_kh, stride_sb, stride_ss, stride_sh,
                                          BLOCK_SIZE, True)
        # (Codes loaded here, before the scales, and converted by a function of the loaded
        # values: loaded inside the converting function, the loop got the slow layouts.)
        kc = tl.load(k_ptr + rows[:, None] + c[None, :], mask=n_mask[:, None], other=0)
        ksc, kz = _scale_zero_rows(ks_ptr + s_rows, n_mask, True, PAIR)
        if BITS == 4:
            k_a, k_b = _u4_f32(kc, FAST)
            s = tl.sum(k_a * q_a[None, :], 1) + tl.sum(k_b * q_b[None, :], 1)
        else:
            s = tl.sum(_u8_f32(kc, FAST) * q_a[None, :], 1)
        s = s * ksc + qsum * kz
        if CENTRED:
            s += tl.sum(_centre_scores(ca, cb, cs_ptr, stride_cs, n0, max_pos, jc, HALF, BLOCK_N, GROUP_C), 0)
        s = tl.where(n_mask, s, float("-inf"))
        # The first key of a partition is inside the sequence, so m_i is finite after any tile.
        m_new = tl.maximum(m_i, tl.max(s, 0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new)
        vc = tl.load(v_ptr + rows[:, None] + c[None, :], mask=n_mask[:, None], other=0)
        vsc, vz = _scale_zero_rows(vs_ptr + s_rows, n_mask, True, PAIR)
        l_i = l_i * alpha + tl.sum(p, 0)
        z_i = z_i * alpha + tl.sum(p * vz, 0)
        pv = (p * vsc)[:, None]
        if BITS == 4:
            v_a, v_b = _u4_f32(vc, FAST)
            acc_b = acc_b * alpha + tl.sum(pv * v_b, 0)
        else:
            v_a = _u8_f32(vc, FAST)
        acc_a = acc_a * alpha + tl.sum(pv * v_a, 0)
        m_i = m_new
    o_a = (acc_a + z_i) / l_i
    o_b = (acc_b + z_i) / l_i
    if SPLIT and part_len < seqlen:
        po = part_out_ptr + seq * stride_pob + head * stride_poh + part * stride_pop + c
        tl.store(po, o_a)
        if BITS == 4:
            tl.store(po + COLS, o_b)
        tl.store(part_lse_ptr + seq * stride_plb + head * stride_plh + part, m_i + tl.log2(l_i))
    else:
        dst = out_ptr + row * stride_ot + head * stride_oh + c
        tl.store(dst, o_a.to(out_ptr.dtype.element_ty))
        if BITS == 4:
            tl.store(dst + COLS, o_b.to(out_ptr.dtype.element_ty))


@jit
def _decode_store(o, m_i, l_i, cols, out_ptr, part_out_ptr, part_lse_ptr, row, seq, part, heads, g_mask,
                  stride_ot, stride_oh, stride_pob, stride_poh, stride_pop, stride_plb, stride_plh,
                  SPLIT: tl.constexpr, part_len, seqlen, WITH_LSE: tl.constexpr):
    """Write normalized output columns ``cols`` of this program's heads: to the output, or, when
    the sequence is split over several partitions, to the partial results with (WITH_LSE) the
    log2-sum-exp the merge kernel weighs them by. (A sequence that one partition covers is final
    here: the merge kernel skips it.)"""
    if SPLIT and part_len < seqlen:
        po = part_out_ptr + seq * stride_pob + heads[:, None] * stride_poh + part * stride_pop + cols[None, :]
        tl.store(po, o, mask=g_mask[:, None])
        if WITH_LSE:
            pl = part_lse_ptr + seq * stride_plb + heads * stride_plh + part
            tl.store(pl, m_i + tl.log2(l_i), mask=g_mask)
    else:
        dst = out_ptr + row * stride_ot + heads[:, None] * stride_oh + cols[None, :]
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])


@jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, cu_q_ptr, seqlens_k_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_sb, stride_ss, stride_sh,
    stride_bt, stride_ot, stride_oh,
    stride_pob, stride_poh, stride_pop,
    stride_plb, stride_plh,
    qm_ptr, c_ptr, cs_ptr, stride_qmt, stride_qmh, stride_c_row, stride_c_h, last_row, stride_cs, max_pos,
    qk_scale, min_part,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, BITS: tl.constexpr, FAST: tl.constexpr, TUNE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, CENTRED: tl.constexpr, GROUP_C: tl.constexpr,
):
    kv_head = tl.program_id(0)
    seq = tl.program_id(1)
    part = tl.program_id(2)
    num_parts = tl.num_programs(2)
    seqlen = tl.load(seqlens_k_ptr + seq)
    # This sequence's own slice length (the module docstring); the reduce kernel repeats it.
    part_len = tl.maximum(tl.cdiv(tl.cdiv(seqlen, num_parts), BLOCK_N) * BLOCK_N, min_part)
    start = part * part_len
    # Past the end of a short sequence (slices are whole key tiles): nothing to do.
    if start >= seqlen:
        return
    end = tl.minimum(start + part_len, seqlen)
    row = tl.load(cu_q_ptr + seq).to(tl.int64)

    g = tl.arange(0, GROUP_PAD)
    g_mask = g < GROUP
    heads = kv_head * GROUP + g
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    if BITS:
        m_i, l_i, acc_lo, acc_hi, z_acc = _decode_quant(
            q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, row, heads, g_mask, kv_head, start, end,
            stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            stride_sb, stride_ss, stride_sh, qk_scale,
            qm_ptr, c_ptr, cs_ptr, stride_qmt, stride_qmh, stride_c_row, stride_c_h, last_row, stride_cs, max_pos,
            GROUP_PAD, HEAD_DIM, BLOCK_SIZE, BLOCK_N, BITS, FAST, TUNE, DOT_PRECISION, CENTRED, GROUP_C)
        j = tl.arange(0, HEAD_DIM // 2)
        _decode_store((acc_lo + z_acc[:, None]) / l_i[:, None], m_i, l_i, j, out_ptr, part_out_ptr, part_lse_ptr,
                      row, seq, part, heads, g_mask, stride_ot, stride_oh, stride_pob, stride_poh, stride_pop,
                      stride_plb, stride_plh, SPLIT, part_len, seqlen, True)
        _decode_store((acc_hi + z_acc[:, None]) / l_i[:, None], m_i, l_i, HEAD_DIM // 2 + j, out_ptr, part_out_ptr,
                      part_lse_ptr, row, seq, part, heads, g_mask, stride_ot, stride_oh, stride_pob, stride_poh,
                      stride_pop, stride_plb, stride_plh, SPLIT, part_len, seqlen, False)
    else:
        d = tl.arange(0, HEAD_DIM)
        # Padding rows (g >= GROUP) load zeros: their scores are finite and their results never stored.
        q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=g_mask[:, None],
                    other=0.0)
        qsum = tl.sum(q.to(tl.float32), 1)  # unused by the 16-bit cache's _tile_step
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_mask = n < end
            # The first tile always holds a valid key (start < seqlen), so m_i is finite from then on.
            m_i, l_i, acc = _tile_step(q, qsum, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, n, n_mask, n_mask[None, :],
                                       kv_head, d, m_i, l_i, acc, qk_scale, stride_kb, stride_ks, stride_kh,
                                       stride_vb, stride_vs, stride_vh, stride_sb, stride_ss, stride_sh,
                                       BLOCK_SIZE, HEAD_DIM, True, BITS, DOT_PRECISION)
        _decode_store(acc / l_i[:, None], m_i, l_i, d, out_ptr, part_out_ptr, part_lse_ptr, row, seq, part, heads,
                      g_mask, stride_ot, stride_oh, stride_pob, stride_poh, stride_pop, stride_plb, stride_plh,
                      SPLIT, part_len, seqlen, True)


@jit
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, cu_q_ptr, seqlens_k_ptr, out_ptr,
    stride_pob, stride_poh, stride_pop,
    stride_plb, stride_plh,
    stride_ot, stride_oh,
    grid_parts, min_part, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr,
):
    # Grid: (H, B). Merge a sequence's partitions: out = sum_p w_p o_p / sum_p w_p, w_p = 2^(lse_p - max).
    head = tl.program_id(0)
    seq = tl.program_id(1)
    seqlen = tl.load(seqlens_k_ptr + seq)
    part_len = tl.maximum(tl.cdiv(tl.cdiv(seqlen, grid_parts), BLOCK_N) * BLOCK_N, min_part)  # as in _decode_kernel
    num_parts = tl.cdiv(seqlen, part_len)
    if num_parts == 1:  # the decode kernel wrote this sequence's output itself
        return
    p = tl.arange(0, BLOCK_P)
    d = tl.arange(0, HEAD_DIM)
    lse_row = part_lse_ptr + seq * stride_plb + head * stride_plh
    out_row = part_out_ptr + seq * stride_pob + head * stride_poh

    m = tl.full([BLOCK_P], float("-inf"), tl.float32)
    for p0 in range(0, num_parts, BLOCK_P):
        lse = tl.load(lse_row + p0 + p, mask=p0 + p < num_parts, other=float("-inf"))
        m = tl.maximum(m, lse)
    m_max = tl.max(m, 0)

    acc = tl.zeros([BLOCK_P, HEAD_DIM], tl.float32)
    w_sum = tl.zeros([BLOCK_P], tl.float32)
    for p0 in range(0, num_parts, BLOCK_P):
        p_mask = p0 + p < num_parts
        lse = tl.load(lse_row + p0 + p, mask=p_mask, other=float("-inf"))
        w = tl.where(p_mask, tl.exp2(lse - m_max), 0.0)
        o = tl.load(out_row + (p0 + p)[:, None] * stride_pop + d[None, :], mask=p_mask[:, None], other=0.0)
        acc += w[:, None] * o
        w_sum += w
    o = tl.sum(acc, 0) / tl.sum(w_sum, 0)
    row = tl.load(cu_q_ptr + seq).to(tl.int64)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + d, o.to(out_ptr.dtype.element_ty))


@jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, cu_q_ptr, seqlens_k_ptr, out_ptr,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_sb, stride_ss, stride_sh,
    stride_bt, stride_ot, stride_oh,
    qm_ptr, c_ptr, cs_ptr, stride_qmt, stride_qmh, stride_c_row, stride_c_h, last_row, stride_cs, max_pos,
    qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    CENTRED: tl.constexpr, GROUP_C: tl.constexpr,
):
    # Later query tiles see more keys: hand them the lowest program ids so they start first.
    m_tile = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    if m_tile * BLOCK_M >= q_len:
        return
    seqlen = tl.load(seqlens_k_ptr + seq)
    # Query i of this sequence sits at absolute position ctx + i and sees keys 0..ctx + i.
    ctx = seqlen - q_len
    kv_head = head // GROUP

    m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = m < q_len
    pos = ctx + m
    rows = (q_start + m).to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + d[None, :], mask=m_mask[:, None], other=0.0)
    qsum = tl.sum(q.to(tl.float32), 1)  # for a quantized cache's zeros (_scores)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    if CENTRED:  # the queries before the key basis and the sequence's mean key (_centre_scores_dot)
        HALF: tl.constexpr = HEAD_DIM // 2
        jc = tl.arange(0, HALF)
        qm_rows = qm_ptr + rows[:, None] * stride_qmt + head * stride_qmh
        qm_lo = tl.load(qm_rows + jc[None, :], mask=m_mask[:, None], other=0.0)
        qm_hi = tl.load(qm_rows + HALF + jc[None, :], mask=m_mask[:, None], other=0.0)
        m_row = _centre_row(bt_row, c_ptr, stride_c_row, last_row) + kv_head * stride_c_h
        cm1 = tl.load(m_row + jc).to(tl.float32)
        cm2 = tl.load(m_row + HALF + jc).to(tl.float32)
    # Keys past the tile's last query position are masked for every row: stop before them.
    kv_end = tl.minimum(seqlen, ctx + (m_tile + 1) * BLOCK_M)
    # Key tiles that end at or before the tile's first query position are visible to every row
    # and lie inside the sequence: they need no mask at all (most tiles of a long prompt).
    full_end = tl.minimum((ctx + m_tile * BLOCK_M + 1) // BLOCK_N * BLOCK_N, kv_end)
    for n0 in range(0, full_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        if CENTRED:
            centre = _centre_scores_dot(qm_lo, qm_hi, cm1, cm2, cs_ptr, stride_cs, n, max_pos, jc, HALF, GROUP_C,
                                        DOT_PRECISION)
        else:
            centre = 0.0  # (set in the loop: a loop-carried value keeps one type)
        m_i, l_i, acc = _tile_step(q, qsum, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, n, n, n,  # no mask
                                   kv_head, d, m_i, l_i, acc, qk_scale, stride_kb, stride_ks, stride_kh,
                                   stride_vb, stride_vs, stride_vh, stride_sb, stride_ss, stride_sh,
                                   BLOCK_SIZE, HEAD_DIM, False, BITS, DOT_PRECISION, centre, CENTRED)
    # The diagonal tiles: causal mask and the end of the sequence.
    for n0 in range(full_end, kv_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < kv_end
        # Key 0 is visible to every row (pos >= 0), so each row's max is finite after the first tile
        # and fully masked later tiles contribute exp2(-inf) = 0, never NaN.
        visible = (n[None, :] <= pos[:, None]) & n_mask[None, :]
        if CENTRED:
            centre = _centre_scores_dot(qm_lo, qm_hi, cm1, cm2, cs_ptr, stride_cs, n, max_pos, jc, HALF, GROUP_C,
                                        DOT_PRECISION)
        else:
            centre = 0.0  # (set in the loop: a loop-carried value keeps one type)
        m_i, l_i, acc = _tile_step(q, qsum, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, n, n_mask, visible,
                                   kv_head, d, m_i, l_i, acc, qk_scale, stride_kb, stride_ks, stride_kh,
                                   stride_vb, stride_vs, stride_vh, stride_sb, stride_ss, stride_sh,
                                   BLOCK_SIZE, HEAD_DIM, True, BITS, DOT_PRECISION, centre, CENTRED)

    o = acc / l_i[:, None]
    dst = out_ptr + rows[:, None] * stride_ot + head * stride_oh + d[None, :]
    tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None])


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _fill_target(device: torch.device, per_sm: int = 2) -> int:
    """Decode programs that fill the GPU: ``per_sm`` (two 4-warp programs) per SM."""
    return per_sm * _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def _decode_partition(device: torch.device, num_seqs: int, num_kv_heads: int, max_seqlen_k: int,
                      per_sm: int = 2) -> int:
    """Tokens per decode program: the largest power of two that still gives ~2 programs per SM.

    Large batches fill the GPU with few partitions per sequence (one: no merge kernel at all);
    batch 1 with a long context splits it into many. Bounded to [128, 1024]: one program walking
    more than ~1k keys alone is latency-bound, which matters when one long sequence shares a batch
    with short ones (H100, bf16, D=128: 255 x 100 tokens + 1 x 32k took 246 us with 4096-token
    partitions), while splitting a batch that already fills the GPU costs only ~3-5%.
    """
    if device.type != "cuda":  # the interpreter: nothing to fill
        return DECODE_PARTITION
    target = _fill_target(device, per_sm)
    per_seq = cdiv(target, num_seqs * num_kv_heads)
    partition = 1 << (max(max_seqlen_k // per_seq, 1).bit_length() - 1)  # round down to a power of two
    return min(max(partition, _MIN_DECODE_PARTITION), _MAX_DECODE_PARTITION)


def _fast_codes(q: torch.Tensor) -> bool:
    """Whether the decode kernel may convert codes with inline PTX: compiled (not interpreted) fp16/bf16."""
    return not TRITON_INTERPRETED and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def _check_inputs(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor, seqlens_k: torch.Tensor,
    k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None,
) -> str | None:
    """Why the Triton kernels cannot take these inputs, or None when they can."""
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        return "q must be [T, H, D] and the caches [num_blocks, block_size, Hkv, D]"
    head_dim = q.shape[-1]
    if k_scales is not None:
        if k_cache.dtype != torch.uint8 or v_cache.dtype != torch.uint8 or q.dtype not in FLOAT_DTYPES:
            return f"a quantized cache holds uint8 codes, not {k_cache.dtype}; q must be fp16/bf16/fp32"
        if k_cache.shape[-1] not in (head_dim, head_dim // 2):
            return f"codes of width {k_cache.shape[-1]} do not hold head_dim {head_dim}"
        if (v_scales is None or k_scales.shape != (*k_cache.shape[:3], 2) or v_scales.shape != k_scales.shape
                or k_scales.stride() != v_scales.stride() or k_scales.stride(-1) != 1
                or k_scales.dtype != SCALE_DTYPE or v_scales.dtype != SCALE_DTYPE):
            return "scales must be fp16 [num_blocks, block_size, Hkv, 2], alike for k and v"
    elif q.dtype not in FLOAT_DTYPES or not q.dtype == k_cache.dtype == v_cache.dtype:
        return f"q/cache dtypes {q.dtype}/{k_cache.dtype}/{v_cache.dtype} must match and be fp16/bf16/fp32"
    elif k_cache.shape[-1] != head_dim:
        return f"cache head_dim {k_cache.shape[-1]} != q's {head_dim}"
    if not is_pow2(head_dim) or not 16 <= head_dim <= 256:
        return f"head_dim {head_dim} must be a power of two in [16, 256]"
    if q.shape[1] % k_cache.shape[2]:
        return f"{q.shape[1]} query heads are not a multiple of {k_cache.shape[2]} kv heads"
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        return "caches need a unit stride along head_dim"
    if block_tables.dim() != 2 or block_tables.dtype not in (torch.int32, torch.int64):
        return "block_tables must be a 2-D int32/int64 tensor"
    if cu_seqlens_q.shape[0] != seqlens_k.shape[0] + 1 or block_tables.shape[0] < seqlens_k.shape[0]:
        return "cu_seqlens_q must be [B+1], seqlens_k [B] and block_tables [>=B, max_blocks]"
    return None


def paged_attention_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, seqlens_k: torch.Tensor, scale: float,
    max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
    *,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    decode_partition: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    fast_codes: bool | None = None,
    tune: int | None = None,
    maxnreg: int | None = None,
    simt: bool | None = None,
    key_centres: KeyCentres | None = None,
) -> torch.Tensor:
    """Triton launcher for :func:`paged_attention_ref` (same arguments and result).

    ``max_seqlen_q`` picks the kernel (1: decode) and sizes the prefill grid; ``max_seqlen_k``
    sizes the decode grid. Either is read from the device (a sync) when not given; a value given
    must be at least the true maximum. ``decode_partition``, ``block_m`` and ``block_n`` override
    the tile choices (tests use small ones to cross more tile and partition boundaries);
    ``num_warps`` / ``num_stages`` the launch of whichever kernel runs (for tuning). A quantized
    cache comes with ``k_scales`` / ``v_scales`` (``paged_attention_ref``); the decode kernel turns
    its codes into fp16/bf16 with inline PTX unless ``fast_codes=False`` (or the interpreter runs,
    or q is fp32), which selects the portable conversion (both are tested). ``tune`` (TUNE_* bits)
    and ``maxnreg`` override the quantized decode kernel's variant and register cap (for tuning);
    ``simt`` its walk: the CUDA cores (the default for one query a kv head) or the tensor cores.
    """
    problem = _check_inputs(q, k_cache, v_cache, block_tables, cu_seqlens_q, seqlens_k, k_scales, v_scales)
    assert problem is None, problem
    devices = {t.device for t in (q, k_cache, v_cache, block_tables, cu_seqlens_q, seqlens_k)}
    assert len(devices) == 1, f"tensors on several devices: {devices}"
    assert not cu_seqlens_q.dtype.is_floating_point and not seqlens_k.dtype.is_floating_point

    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    num_seqs = seqlens_k.shape[0]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    qk_scale = float(scale) * _LOG2E
    # fp32 inputs would default to TF32 tensor-core products on the GPU: keep them exact.
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    bits = cache_bits(k_cache, head_dim) if k_scales is not None else 0
    ks, vs = (k_scales, v_scales) if bits else (k_cache, v_cache)  # unused pointers when unquantized
    s_strides = (k_scales.stride(0), k_scales.stride(1), k_scales.stride(2)) if bits else (0, 0, 0)
    common = (
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *s_strides,
        block_tables.stride(0), out.stride(0), out.stride(1),
    )
    centred = key_centres is not None
    if centred:  # the centres' pointers (kv_cache.KeyCentres), then their strides and bounds
        table, cs, qm = key_centres.table, key_centres.cos_sin, key_centres.queries
        assert bits and qm is not None and qm.shape == q.shape and qm.stride(-1) == 1, \
            "centred keys: a quantized cache and the queries before the key basis"
        assert table.shape[1:] == (2, num_kv_heads, head_dim) and table.stride(-1) == 1 and cs.stride(-1) == 1
        c_ptrs = (qm, table, cs)
        c_args = (qm.stride(0), qm.stride(1), table.stride(0), table.stride(2), table.shape[0] - 1,
                  cs.stride(0), cs.shape[0])
    else:
        c_ptrs, c_args = (q, q, q), (0, 0, 0, 0, 0, 0, 1)

    # (A batch whose sequences bring at most one query but some none goes to the prefill kernel.)
    if max_seqlen_q == 1 and num_tokens == num_seqs:
        if max_seqlen_k is None:
            max_seqlen_k = int(seqlens_k.max())
        simt = bool(bits) and group == 1 and k_cache.stride() == v_cache.stride() if simt is None else simt
        assert not simt or (bits and group == 1 and k_cache.stride() == v_cache.stride()), \
            "the CUDA-core walk takes a quantized cache, one query a kv head, keys and values alike strided"
        per_sm = _SIMT_PROGRAMS_PER_SM if simt else 2
        partition = decode_partition or _decode_partition(q.device, num_seqs, num_kv_heads, max_seqlen_k, per_sm)
        bn = block_n or min(_SIMT_BLOCK_N if simt else 64 if head_dim <= 128 else 32, next_pow2(partition))
        assert partition % bn == 0, "the decode partition must be a multiple of its key tile"
        num_parts = max(cdiv(max_seqlen_k, partition), 1)
        split = num_parts > 1
        # Short sequences spread over the partitions (down to one key tile per program) unless
        # the batch fills the GPU by itself; then each keeps partition-sized slices.
        min_part = partition
        if decode_partition or (q.device.type == "cuda" and num_seqs * num_kv_heads < _fill_target(q.device, per_sm)):
            min_part = bn
        if split:
            part_out = torch.empty(num_seqs, num_heads, num_parts, head_dim, dtype=torch.float32, device=q.device)
            part_lse = torch.empty(num_seqs, num_heads, num_parts, dtype=torch.float32, device=q.device)
        else:
            part_out = part_lse = out  # unused (SPLIT=False); any valid pointer will do
        po_strides = (part_out.stride(0), part_out.stride(1), part_out.stride(2)) if split else (0, 0, 0)
        pl_strides = (part_lse.stride(0), part_lse.stride(1)) if split else (0, 0)
        fast = bool(bits) and (_fast_codes(q) if fast_codes is None else fast_codes)
        assert not (fast and (TRITON_INTERPRETED or q.dtype == torch.float32)), "fast_codes: compiled fp16/bf16 only"
        tn = _DECODE_TUNE if tune is None else tune
        if q.dtype != torch.float16:
            tn &= ~TUNE_FOLD  # the biased codes (1024 + c) are an fp16 trick
        if tn & TUNE_PAIR and not (fast and k_scales.data_ptr() % 4 == 0 and all(st % 2 == 0 for st in s_strides)):
            tn &= ~TUNE_PAIR  # a (scale, zero) pair must be one aligned 32-bit word
        extra = {"num_stages": num_stages} if num_stages else {}
        if maxnreg or (bits and not simt):
            extra["maxnreg"] = maxnreg or _DECODE_MAXNREG
        if simt:
            _decode_simt_kernel[(num_kv_heads, num_seqs, num_parts)](
                q, k_cache, v_cache, ks, vs, block_tables, cu_seqlens_q, seqlens_k, out, part_out, part_lse,
                *c_ptrs,
                q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *s_strides,
                block_tables.stride(0), out.stride(0), out.stride(1), *po_strides, *pl_strides, *c_args,
                qk_scale, min_part,
                HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_N=bn, SPLIT=split, BITS=bits, FAST=fast,
                PAIR=bool(tn & TUNE_PAIR), CENTRED=centred, GROUP_C=CENTRE_GROUP, num_warps=num_warps or 1,
                **extra,
            )
        else:
            # Partitions last: the programs past a short sequence's end (the grid is sized for
            # max_seqlen_k) are scheduled after the real ones (H200, int8, batch 256 x 1k keys,
            # grid for 4k: 822 against 1,287 us for the CUDA-core walk, 795 against 810 here).
            _decode_kernel[(num_kv_heads, num_seqs, num_parts)](
                q, k_cache, v_cache, ks, vs, block_tables, cu_seqlens_q, seqlens_k, out, part_out, part_lse,
                *common, *po_strides, *pl_strides, *c_ptrs, *c_args, qk_scale, min_part,
                GROUP=group, GROUP_PAD=max(16, next_pow2(group)), HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
                BLOCK_N=bn, SPLIT=split, BITS=bits, FAST=fast, TUNE=tn if bits else 0, DOT_PRECISION=precision,
                CENTRED=centred, GROUP_C=CENTRE_GROUP, num_warps=num_warps or 4, **extra,
            )
        if split:
            _decode_reduce_kernel[(num_heads, num_seqs)](
                part_out, part_lse, cu_seqlens_q, seqlens_k, out,
                *po_strides, *pl_strides, out.stride(0), out.stride(1), num_parts, min_part,
                HEAD_DIM=head_dim, BLOCK_N=bn, BLOCK_P=min(next_pow2(num_parts), 16), num_warps=4,
            )
        return out

    bm = block_m or (64 if max_seqlen_q >= 64 else max(16, next_pow2(max_seqlen_q)))
    bn = block_n or (64 if head_dim <= 128 else 32)
    _prefill_kernel[(cdiv(max_seqlen_q, bm), num_heads, num_seqs)](
        q, k_cache, v_cache, ks, vs, block_tables, cu_seqlens_q, seqlens_k, out,
        *common, *c_ptrs, *c_args, qk_scale,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_M=bm, BLOCK_N=bn, BITS=bits,
        CENTRED=centred, GROUP_C=CENTRE_GROUP,
        # Two stages measured best on an H100 (bf16, D=64 and 128) for 64x64 tiles and 4 warps.
        DOT_PRECISION=precision, num_warps=num_warps or (4 if bm <= 64 else 8), num_stages=num_stages or 2,
    )
    return out


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, seqlens_k: torch.Tensor, scale: float,
    *,
    max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
    k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None,
    key_centres: KeyCentres | None = None,
) -> torch.Tensor:
    """Attention of q [T, H, D] over the paged caches: Triton on CUDA, else the reference.

    Pass ``max_seqlen_q`` / ``max_seqlen_k`` (from ``AttentionMetadata``) when known: without them
    the Triton path reads the maxima from the device, a host sync per call. Values passed must be
    at least the true maxima (an upper bound such as the model's max length is fine, and is what a
    CUDA-graph capture should pass so the launch grid stays fixed). A quantized cache (uint8
    codes) comes with ``k_scales`` / ``v_scales``; its keys and values are dequantized in registers,
    and with ``key_centres`` when its keys were stored centred (``kv_cache.KeyCentring``).
    """
    if triton_takes("paged_attention", (q, k_cache, v_cache), _check_inputs,
                    q, k_cache, v_cache, block_tables, cu_seqlens_q, seqlens_k, k_scales, v_scales):
        return paged_attention_triton(
            q, k_cache, v_cache, block_tables, cu_seqlens_q, seqlens_k, scale,
            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, k_scales=k_scales, v_scales=v_scales,
            key_centres=key_centres,
        )
    return paged_attention_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, seqlens_k, scale, k_scales, v_scales,
                               key_centres)
