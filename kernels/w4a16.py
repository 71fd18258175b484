"""W4A16 matrix products on AWQ checkpoints: 4-bit weights, fp16/bf16 activations, ``y = x @ W``.

Weights stay in AutoAWQ's "GEMM" layout, exactly as its checkpoints store them, so loading
needs no repacking:

* ``qweight`` int32 [K, N // 8]: row ``k`` packs 8 consecutive output columns per int32;
* ``qzeros``  int32 [G, N // 8]: the 4-bit zero points, packed the same way;
* ``scales``  fp16  [G, N];  ``G = ceil(K / group_size)`` (the last group may be shorter);
* ``w[k, n] = (q[k, n] - z[k // group_size, n]) * s[k // group_size, n]``.

Inside an int32 the 8 columns are interleaved: the nibble at bit offset ``4 * i`` holds column
``AWQ_PACK_ORDER[i]`` of the 8, so column ``j`` sits at nibble ``AWQ_NIBBLE_OF_COLUMN[j]``. Read
from AutoAWQ (github.com/casper-hansen/AutoAWQ, commit 88e4c76, May 2025):
``awq/modules/linear/gemm.py`` ``WQLinear_GEMM.from_linear`` packs
``qweight[:, col] |= intweight[:, col * 8 + order_map[i]] << (i * 4)`` with
``order_map = [0, 2, 4, 6, 1, 3, 5, 7]``, and ``qzeros`` with the same loop;
``awq/utils/packing_utils.py`` undoes it: ``unpack_awq`` shifts by 0, 4, ..., 28 (nibble order)
and ``reverse_awq_order`` picks nibble ``AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7][j]`` for
column ``j``; ``dequantize_gemm`` is ``(iweight - izeros) * scales`` with the group rows repeated.
(The interleave puts columns ``2j`` and ``2j + 1`` in nibbles ``j`` and ``j + 4``, i.e. in the two
16-bit halves of the word, for CUDA kernels that convert two at a time.) AutoAWQ requires
``K % group_size == 0``; here a shorter last group is allowed too.

Reading 4-bit codes without conversions. Column ``2j + h`` of a word is nibble ``j`` of its
half ``h``, so one AND-OR (LOP3) of ``word`` or ``word >> 8`` with ``0x000F000F`` or
``0x00F000F0`` and ``0x64006400`` gives two fp16 values ``1024 + c`` (or ``1024 + 16 c``) at
once, the "magic number" read of the codes (FasterTransformer, LMDeploy). One fp16x2 fused
multiply-add (PTX ``fma.rn.f16x2``, via ``tl.inline_asm_elementwise``) then makes ``q - z`` of
both exactly (``v * 1 - (1024 + z)`` or ``v / 16 - (64 + z)``). fp16 activations use this path
(the half2 kernels); bf16 ones the older fp32 form: with ``hi = word >> 16`` every column is
``bits(2**23 + c * 16**j) = 0x4B000000 | (half & 0xF << 4j)``, and two such values subtract to
``(q - z) * 16**j`` exactly, ``16**-j`` folded into the scale. Under Triton's interpreter (no
inline assembly) the fp16x2 arithmetic is emulated through fp32 with the same roundings.

* **M == 1** (batch-1 decode): a GEMV. A program takes 8 * BLOCK_P columns and a range of rows;
  the next step's loads are issued before this step's arithmetic. fp16: per two weights one
  LOP3 and two HFMA2 (``q - z``, then ``x * (q - z)`` into an fp16 chain of 8 rows a thread),
  each chain added into fp32 times the group's scales (``_gemv_f16_kernel``). bf16: ``x * q *
  16**j`` summed in fp32 and the zeros folded in per group (``sum x (q - z) = sum x q - z sum
  x``, ``_gemv_kernel``). N tiles alone are too few for 132 SMs, so K is split as well; the
  fp16 kernel adds the per-split partial sums in the last program of each column tile to
  arrive (a counter per tile, no second launch), the bf16 one in a second small kernel; both
  in a fixed order (deterministic, unlike atomics).
* **2 <= M < DEQUANT_MIN_ROWS** (batched decode): a tiled GEMM; each K tile of packed weights
  is dequantized in registers to x's dtype (fp16: ``q - z`` and the scale product both HFMA2,
  the planes joined into natural column order) and fed to one ``tl.dot`` accumulating in fp32.
  Split over K too when the output tiles are fewer than the SMs. Up to 32 rows (and for wide or
  deep layers at 64) the operands are swapped (``_gemm_swap_kernel``, ``out^T = W^T x^T``): the
  weight columns fill the warp-group MMA's 64-row side and the few rows its narrow side.
* **M >= DEQUANT_MIN_ROWS** (prefill, large batches): a Triton kernel writes the dense weight in
  x's dtype and cuBLAS multiplies, as AutoAWQ and vLLM do for large batches. A transient
  K * N * 2 bytes (180 MB for Llama-2-7B's gate_up) is allocated per call.

Measured on one H200 (``benchmarks/bench_w4a16.py``, Llama-2-7B projections, group 128, fp16,
commit bcd5b31 against e884025 in the same call; ``docs/benchmarks.md`` has the table): at M = 1
the GEMV takes 8.9-23 µs per projection (qkv 14.7, o_proj 8.9, was 10.0, gate_up 23.1, was
28.1, down 15.2), 1.6-2.0x fp16 cuBLAS but only ~40-50% of HBM bandwidth. Its loop is ~3.5
SASS instructions per weight, and a one-warp program keeps one step of loads in flight. The
fused GEMM matches or beats fp16 at 16 rows (0.9-1.25x) and at 32 rows reaches 0.9-1.1x.
At 64 rows it reaches 0.6-0.8x: each K step's dequantized tile goes through shared memory
into the MMA's operand, and the step's MMA is waited on before the next dequantization. From
128 rows the dense-weight path (~0.5x fp16 at 128-256 rows) is used. A K tile never straddles
two groups (``BLOCK_K`` and the GEMV's row step divide ``group_size``, or one group covers K).
Launch choices are in ``gemv_config`` / ``gemv_splits`` / ``gemm_config`` / ``split_k``.
"""

# No ``from __future__ import annotations``: Triton reads ``tl.constexpr`` annotations as objects.

from dataclasses import dataclass, replace

import torch

from ._triton import HAS_TRITON, TRITON_INTERPRETED, cdiv, grouped_tile, jit, next_pow2, row_and_cols, sm_count, tl, triton_takes

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""Nibble ``i`` (bits ``4i .. 4i+3``) of a packed int32 holds column ``AWQ_PACK_ORDER[i]`` of its 8."""
AWQ_NIBBLE_OF_COLUMN = (0, 4, 1, 5, 2, 6, 3, 7)
"""Column ``j`` of a packed int32's 8 sits at nibble ``AWQ_NIBBLE_OF_COLUMN[j]`` (the inverse)."""
PACK = 8  # 4-bit values per int32
TRITON_DTYPES = (torch.float16, torch.bfloat16)
# From this many rows on, the Triton path writes the dense weight and lets cuBLAS multiply: the
# fused kernel dequantizes the weight once per 64-row tile, a cost that grows with M, while the
# dense write and read cost a fixed ~K * N * 4 bytes. On an H200 (Llama-2-7B, group 128) the fused
# kernel took 37-71 µs at 64 rows against the dense path's 67-120 µs, and 106-112 µs (qkv, down)
# at 256 rows against 77.
DEQUANT_MIN_ROWS = 128


# ------------------------------------------------------------------------------------- reference


def awq_pack(intweight: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit integers [R, N] (values 0..15, N a multiple of 8) into AWQ's int32 [R, N // 8]."""
    if intweight.dim() != 2:
        raise ValueError(f"awq_pack takes a 2-D [rows, N] tensor, got shape {tuple(intweight.shape)}")
    rows, n = intweight.shape
    if n % PACK:
        raise ValueError(f"N = {n} is not a multiple of 8: AWQ packs 8 four-bit columns per int32")
    if intweight.is_floating_point() or intweight.is_complex():
        raise ValueError(f"awq_pack takes integers, got {intweight.dtype}")
    w = intweight.to(torch.int64)
    if w.numel() and (int(w.min()) < 0 or int(w.max()) > 15):
        raise ValueError(f"4-bit values must lie in 0..15, got {int(w.min())}..{int(w.max())}")
    nibbles = w.view(rows, n // PACK, PACK)[:, :, list(AWQ_PACK_ORDER)]  # nibble i <- column ORDER[i]
    shifts = torch.arange(0, 32, 4, device=w.device, dtype=torch.int64)
    packed = (nibbles << shifts).sum(-1)  # 0 .. 2**32 - 1
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """Unpack AWQ's int32 [R, C] into the 4-bit integers [R, 8 * C] (uint8, natural column order)."""
    if packed.dim() != 2 or packed.dtype != torch.int32:
        raise ValueError(f"awq_unpack takes a 2-D int32 tensor, got {packed.dtype} {tuple(packed.shape)}")
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # [R, C, 8] in nibble order
    cols = nibbles[:, :, list(AWQ_NIBBLE_OF_COLUMN)]  # column j <- nibble NIBBLE_OF_COLUMN[j]
    return cols.reshape(packed.shape[0], -1).to(torch.uint8)


def check_awq_shapes(
    k: int, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
    bias: torch.Tensor | None = None,
) -> tuple[int, int]:
    """Validate an AWQ triple for ``K = k`` input features; return ``(N, group_size)`` with
    ``group_size = -1`` (one group, AutoAWQ's per-channel setting) resolved to ``K``."""
    if scales.dim() != 2:
        raise ValueError(f"scales must be [G, N], got shape {tuple(scales.shape)}")
    n = scales.shape[1]
    if n % PACK:
        raise ValueError(f"N = {n} is not a multiple of 8: AWQ packs 8 four-bit columns per int32")
    if group_size == -1:
        group_size = k
    if group_size <= 0:
        raise ValueError(f"group_size must be positive (or -1 for one group), got {group_size}")
    groups = cdiv(k, group_size)
    if qweight.dtype != torch.int32 or tuple(qweight.shape) != (k, n // PACK):
        raise ValueError(f"qweight must be int32 [K, N // 8] = [{k}, {n // PACK}], "
                         f"got {qweight.dtype} {tuple(qweight.shape)}")
    if qzeros.dtype != torch.int32 or tuple(qzeros.shape) != (groups, n // PACK):
        raise ValueError(f"qzeros must be int32 [ceil(K / group_size), N // 8] = [{groups}, {n // PACK}], "
                         f"got {qzeros.dtype} {tuple(qzeros.shape)}")
    if scales.shape[0] != groups:
        raise ValueError(f"scales must be [ceil(K / group_size), N] = [{groups}, {n}] for K = {k}, "
                         f"group_size = {group_size}, got {tuple(scales.shape)}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must be [N] = [{n}], got {tuple(bias.shape)}")
    return n, group_size


def dequantize_awq_ref(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The dense weight [K, N] = (q - z) * s of an AWQ triple (computed in fp32, where it is exact)."""
    k = qweight.shape[0]
    _, group_size = check_awq_shapes(k, qweight, qzeros, scales, group_size)
    group_of_row = torch.arange(k, device=qweight.device) // group_size
    q = awq_unpack(qweight).float()
    z = awq_unpack(qzeros).float()[group_of_row]
    s = scales.float()[group_of_row]
    return ((q - z) * s).to(dtype)


def w4a16_matmul_ref(
    x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x [..., K] @ W + bias`` -> [..., N] in x's dtype, computed in fp32 from the dense weight."""
    w = dequantize_awq_ref(qweight, qzeros, scales, group_size)
    out = x.float() @ w
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


# ----------------------------------------------------------------------------------------- Triton


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


@jit
def _gemv_rows(x_ptr, qw_ptr, k, k_hi, NP, p, p_mask):
    """Packed words [BLOCK_R, BLOCK_P] and x values [BLOCK_R] of rows ``k`` (zero from ``k_hi``)."""
    k_mask = k < k_hi
    x = tl.load(x_ptr + k, mask=k_mask, other=0.0)
    q = tl.load(qw_ptr + k.to(tl.int64)[:, None] * NP + p[None, :], mask=k_mask[:, None] & p_mask[None, :], other=0)
    return q, x


@jit
def _gemv_rows_2d(x_ptr, qw_ptr, k, k_hi, NP, p, p_mask):
    """As ``_gemv_rows`` with x as a column [BLOCK_R, 1]: loaded in the words' layout, so that
    broadcasting it over the columns needs no exchange through shared memory."""
    k_mask = (k < k_hi)[:, None]
    x = tl.load(x_ptr + k[:, None], mask=k_mask, other=0.0)
    q = tl.load(qw_ptr + k.to(tl.int64)[:, None] * NP + p[None, :], mask=k_mask & p_mask[None, :], other=0)
    return q, x


@jit
def _gemv_accumulate(gacc, xsum, q, x, masks):
    """``gacc += x * q * 16**j`` (q read in place, see _codes) and ``xsum += x``, element-wise."""
    x = x.to(tl.float32)
    return gacc + (_codes(_spread(q), masks[None, :]) - 8388608.0) * x[:, None], xsum + x


@jit
def _gemv_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, b_ptr, out_ptr, part_ptr,
    K, N, NP, K_SPLIT,
    GROUP: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_R: tl.constexpr,
    SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    # Grid: (cdiv(N / 8, BLOCK_P), splits). A program: 8 * BLOCK_P columns (NP = N / 8 packed
    # words, an argument so that Triton sees its divisibility and vectorizes the masked loads),
    # rows [pid_s * K_SPLIT, (pid_s + 1) * K_SPLIT) in steps of 4 * BLOCK_R rows (K_SPLIT is a
    # multiple of the step, and the step divides GROUP or GROUP >= K: a step lies in one group).
    #
    # Per group, sum x * (q - z) = sum x * q - z * sum x: each step adds x * q into a
    # [BLOCK_R, 8 * BLOCK_P] register tile, one fused multiply-add per weight and no reduction;
    # the zeros and scales enter once per group, when it ends. Triton gives each thread 16 bytes
    # (4 words, 32 columns) of a row and spreads BLOCK_R rows over the threads.
    #
    # Memory latency: Triton does not software-pipeline loads that feed no tl.dot, and ptxas,
    # saving registers, issues a load only after the previous tile's arithmetic (one latency per
    # tile). So the four row tiles of the next step are loaded, by hand, before this step's
    # arithmetic: 8 loads of 16 bytes in flight per thread at ~100 registers.
    pid_n = tl.program_id(0)
    p = pid_n * BLOCK_P + tl.arange(0, BLOCK_P)
    p_mask = p < NP
    cols = pid_n * (8 * BLOCK_P) + tl.arange(0, 8 * BLOCK_P)
    c_mask = cols < N
    masks, units = _column_consts(8 * BLOCK_P)
    r = tl.arange(0, BLOCK_R)
    pid_s = tl.program_id(1)
    k_lo = pid_s * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    q0, x0 = _gemv_rows(x_ptr, qw_ptr, k_lo + r, k_hi, NP, p, p_mask)
    q1, x1 = _gemv_rows(x_ptr, qw_ptr, k_lo + BLOCK_R + r, k_hi, NP, p, p_mask)
    q2, x2 = _gemv_rows(x_ptr, qw_ptr, k_lo + 2 * BLOCK_R + r, k_hi, NP, p, p_mask)
    q3, x3 = _gemv_rows(x_ptr, qw_ptr, k_lo + 3 * BLOCK_R + r, k_hi, NP, p, p_mask)
    gacc = tl.zeros([BLOCK_R, 8 * BLOCK_P], tl.float32)
    xsum = tl.zeros([BLOCK_R], tl.float32)
    out = tl.zeros([8 * BLOCK_P], tl.float32)
    for k0 in range(k_lo, k_hi, 4 * BLOCK_R):
        c0, y0, c1, y1, c2, y2, c3, y3 = q0, x0, q1, x1, q2, x2, q3, x3
        nxt = k0 + 4 * BLOCK_R
        q0, x0 = _gemv_rows(x_ptr, qw_ptr, nxt + r, k_hi, NP, p, p_mask)
        q1, x1 = _gemv_rows(x_ptr, qw_ptr, nxt + BLOCK_R + r, k_hi, NP, p, p_mask)
        q2, x2 = _gemv_rows(x_ptr, qw_ptr, nxt + 2 * BLOCK_R + r, k_hi, NP, p, p_mask)
        q3, x3 = _gemv_rows(x_ptr, qw_ptr, nxt + 3 * BLOCK_R + r, k_hi, NP, p, p_mask)
        gacc, xsum = _gemv_accumulate(gacc, xsum, c0, y0, masks)
        gacc, xsum = _gemv_accumulate(gacc, xsum, c1, y1, masks)
        gacc, xsum = _gemv_accumulate(gacc, xsum, c2, y2, masks)
        gacc, xsum = _gemv_accumulate(gacc, xsum, c3, y3, masks)
        if (nxt % GROUP == 0) | (nxt >= k_hi):  # this step ends a group (or the range)
            g = k0 // GROUP
            zc = _codes(_spread(tl.load(qz_ptr + g * NP + p, mask=p_mask, other=0)), masks) - 8388608.0
            su = tl.load(s_ptr + g * N + cols, mask=c_mask, other=0.0).to(tl.float32) * units
            out += (tl.sum(gacc, axis=0) - zc * tl.sum(xsum, axis=0)) * su  # masked columns: s = 0
            gacc = tl.zeros([BLOCK_R, 8 * BLOCK_P], tl.float32)
            xsum = tl.zeros([BLOCK_R], tl.float32)
    if SPLIT:
        tl.store(part_ptr + pid_s * N + cols, out, mask=c_mask)
    else:
        if HAS_BIAS:
            out += tl.load(b_ptr + cols, mask=c_mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + cols, out.to(out_ptr.dtype.element_ty), mask=c_mask)


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


@jit
def _gemv_f16_tile(a0, a1, a2, a3, q, x, nz0, nz1, nz2, nz3, ASM: tl.constexpr):
    """Add one row tile's ``x * (q - z)`` to the fp16 chains ``a0..a3`` (half2 planes [R, P]):
    per two weights one LOP3 and two HFMA2."""
    xb = x.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    x2 = xb | (xb << 16)  # x[k] in both halves, [R, 1]
    d0, d1, d2, d3 = _centered(q, nz0, nz1, nz2, nz3, ASM)
    return _hfma2(x2, d0, a0, ASM), _hfma2(x2, d1, a1, ASM), _hfma2(x2, d2, a2, ASM), _hfma2(x2, d3, a3, ASM)


@jit
def _group_consts(qz_ptr, s_ptr, g, N, NP, p, p_mask, R: tl.constexpr, ASM: tl.constexpr):
    """Group ``g``'s negated zero planes (``_neg_zeros``) and its 8 scales per word (column c of
    word p, fp32), each broadcast to the [R, P] tiles: so the loop carries them in the tiles'
    own layout, and any layout exchange happens here, once per group, not once per tile."""
    nz0, nz1, nz2, nz3 = _neg_zeros(tl.load(qz_ptr + g * NP + p, mask=p_mask, other=0), ASM)
    s = s_ptr + g * N + p * 8
    return (_rows(nz0, R), _rows(nz1, R), _rows(nz2, R), _rows(nz3, R),
            _rows(tl.load(s, mask=p_mask, other=0.0).to(tl.float32), R),
            _rows(tl.load(s + 1, mask=p_mask, other=0.0).to(tl.float32), R),
            _rows(tl.load(s + 2, mask=p_mask, other=0.0).to(tl.float32), R),
            _rows(tl.load(s + 3, mask=p_mask, other=0.0).to(tl.float32), R),
            _rows(tl.load(s + 4, mask=p_mask, other=0.0).to(tl.float32), R),
            _rows(tl.load(s + 5, mask=p_mask, other=0.0).to(tl.float32), R),
            _rows(tl.load(s + 6, mask=p_mask, other=0.0).to(tl.float32), R),
            _rows(tl.load(s + 7, mask=p_mask, other=0.0).to(tl.float32), R))


@jit
def _rows(v, R: tl.constexpr):
    """A vector [P] repeated as R rows [R, P]."""
    return tl.broadcast_to(v[None, :], (R, v.shape[0]))


@jit
def _store8(ptr, p, mask, t0, t1, t2, t3, t4, t5, t6, t7):
    """Write 8 per-word vectors [P] to their interleaved columns ``8 * p + c``."""
    o = ptr + p * 8
    ty = ptr.dtype.element_ty
    tl.store(o, t0.to(ty), mask=mask)
    tl.store(o + 1, t1.to(ty), mask=mask)
    tl.store(o + 2, t2.to(ty), mask=mask)
    tl.store(o + 3, t3.to(ty), mask=mask)
    tl.store(o + 4, t4.to(ty), mask=mask)
    tl.store(o + 5, t5.to(ty), mask=mask)
    tl.store(o + 6, t6.to(ty), mask=mask)
    tl.store(o + 7, t7.to(ty), mask=mask)


@jit
def _reduce_last(part_ptr, lock_ptr, b_ptr, out_ptr, tile, N, SPLITS, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Split-K without a second kernel: every program of column tile ``tile`` has written its fp32
    partial row [N] (in ``part_ptr``, one row per split); the last to arrive adds them in split
    order (deterministic), writes the output and re-arms the tile's counter for the next launch.
    The partials are read 8 splits per load: a loop of one load per split would wait out one L2
    latency per split, in the one program that every column tile finishes with."""
    tl.debug_barrier()  # all threads' partial stores precede the (release) atomic below
    arrived = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLITS - 1:
        cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        c_mask = cols < N
        acc = tl.zeros([BLOCK_N], tl.float32)
        for s0 in range(0, SPLITS, 8):  # .cg: read from L2, where the other SMs' stores are
            s = s0 + tl.arange(0, 8)
            part = tl.load(part_ptr + s[:, None] * N + cols[None, :], mask=(s < SPLITS)[:, None] & c_mask[None, :],
                           other=0.0, cache_modifier=".cg")
            acc += tl.sum(part, axis=0)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=c_mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + cols, acc.to(out_ptr.dtype.element_ty), mask=c_mask)
        tl.atomic_xchg(lock_ptr + tile, 0, sem="relaxed", scope="gpu")


@jit
def _gemv_f16_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, b_ptr, out_ptr, part_ptr, lock_ptr,
    K, N, NP, K_SPLIT, SPLITS,
    GROUP: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_R: tl.constexpr, CHAIN: tl.constexpr,
    SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, ASM: tl.constexpr,
):
    # The fp16 GEMV. Grid and row steps as _gemv_kernel's (a step is 4 tiles of BLOCK_R rows and
    # lies in one group). Per two weights: one AND-OR, one HFMA2 for q - z (exact), one HFMA2
    # into an fp16 chain of x * (q - z); a chain holds CHAIN steps (4 * CHAIN rows a thread)
    # before it is added, times the group's scales, into fp32: short chains keep the fp16
    # rounding near the output's own (8 rows: ~4.5e-4 rms relative on randn x, against ~2e-4
    # for rounding the output alone), and the conversion costs 2 instructions per 8 weights.
    pid_n = tl.program_id(0)
    p = pid_n * BLOCK_P + tl.arange(0, BLOCK_P)
    p_mask = p < NP
    r = tl.arange(0, BLOCK_R)
    pid_s = tl.program_id(1)
    k_lo = pid_s * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    STEP: tl.constexpr = 4 * BLOCK_R
    q0, x0 = _gemv_rows_2d(x_ptr, qw_ptr, k_lo + r, k_hi, NP, p, p_mask)
    q1, x1 = _gemv_rows_2d(x_ptr, qw_ptr, k_lo + BLOCK_R + r, k_hi, NP, p, p_mask)
    q2, x2 = _gemv_rows_2d(x_ptr, qw_ptr, k_lo + 2 * BLOCK_R + r, k_hi, NP, p, p_mask)
    q3, x3 = _gemv_rows_2d(x_ptr, qw_ptr, k_lo + 3 * BLOCK_R + r, k_hi, NP, p, p_mask)
    nz0, nz1, nz2, nz3, s0, s1, s2, s3, s4, s5, s6, s7 = _group_consts(
        qz_ptr, s_ptr, k_lo // GROUP, N, NP, p, p_mask, BLOCK_R, ASM)
    a0 = tl.zeros([BLOCK_R, BLOCK_P], tl.int32)  # half2 +0.0
    a1 = tl.zeros([BLOCK_R, BLOCK_P], tl.int32)
    a2 = tl.zeros([BLOCK_R, BLOCK_P], tl.int32)
    a3 = tl.zeros([BLOCK_R, BLOCK_P], tl.int32)
    o0 = tl.zeros([BLOCK_R, BLOCK_P], tl.float32)
    o1 = tl.zeros([BLOCK_R, BLOCK_P], tl.float32)
    o2 = tl.zeros([BLOCK_R, BLOCK_P], tl.float32)
    o3 = tl.zeros([BLOCK_R, BLOCK_P], tl.float32)
    o4 = tl.zeros([BLOCK_R, BLOCK_P], tl.float32)
    o5 = tl.zeros([BLOCK_R, BLOCK_P], tl.float32)
    o6 = tl.zeros([BLOCK_R, BLOCK_P], tl.float32)
    o7 = tl.zeros([BLOCK_R, BLOCK_P], tl.float32)
    for k0 in range(k_lo, k_hi, STEP):
        c0, y0, c1, y1, c2, y2, c3, y3 = q0, x0, q1, x1, q2, x2, q3, x3
        nxt = k0 + STEP
        q0, x0 = _gemv_rows_2d(x_ptr, qw_ptr, nxt + r, k_hi, NP, p, p_mask)
        q1, x1 = _gemv_rows_2d(x_ptr, qw_ptr, nxt + BLOCK_R + r, k_hi, NP, p, p_mask)
        q2, x2 = _gemv_rows_2d(x_ptr, qw_ptr, nxt + 2 * BLOCK_R + r, k_hi, NP, p, p_mask)
        q3, x3 = _gemv_rows_2d(x_ptr, qw_ptr, nxt + 3 * BLOCK_R + r, k_hi, NP, p, p_mask)
        a0, a1, a2, a3 = _gemv_f16_tile(a0, a1, a2, a3, c0, y0, nz0, nz1, nz2, nz3, ASM)
        a0, a1, a2, a3 = _gemv_f16_tile(a0, a1, a2, a3, c1, y1, nz0, nz1, nz2, nz3, ASM)
        a0, a1, a2, a3 = _gemv_f16_tile(a0, a1, a2, a3, c2, y2, nz0, nz1, nz2, nz3, ASM)
        a0, a1, a2, a3 = _gemv_f16_tile(a0, a1, a2, a3, c3, y3, nz0, nz1, nz2, nz3, ASM)
        group_end = (nxt % GROUP == 0) | (nxt >= k_hi)
        if group_end | ((nxt - k_lo) % (CHAIN * STEP) == 0):  # close the fp16 chains
            o0 += _half(a0, 0) * s0
            o1 += _half(a0, 1) * s1
            o2 += _half(a1, 0) * s2
            o3 += _half(a1, 1) * s3
            o4 += _half(a2, 0) * s4
            o5 += _half(a2, 1) * s5
            o6 += _half(a3, 0) * s6
            o7 += _half(a3, 1) * s7
            a0 = tl.zeros([BLOCK_R, BLOCK_P], tl.int32)
            a1 = tl.zeros([BLOCK_R, BLOCK_P], tl.int32)
            a2 = tl.zeros([BLOCK_R, BLOCK_P], tl.int32)
            a3 = tl.zeros([BLOCK_R, BLOCK_P], tl.int32)
            if group_end & (nxt < k_hi):
                nz0, nz1, nz2, nz3, s0, s1, s2, s3, s4, s5, s6, s7 = _group_consts(
                    qz_ptr, s_ptr, nxt // GROUP, N, NP, p, p_mask, BLOCK_R, ASM)
    t0, t1, t2, t3 = tl.sum(o0, axis=0), tl.sum(o1, axis=0), tl.sum(o2, axis=0), tl.sum(o3, axis=0)
    t4, t5, t6, t7 = tl.sum(o4, axis=0), tl.sum(o5, axis=0), tl.sum(o6, axis=0), tl.sum(o7, axis=0)
    if SPLIT:
        _store8(part_ptr + pid_s * N, p, p_mask, t0, t1, t2, t3, t4, t5, t6, t7)
        _reduce_last(part_ptr, lock_ptr, b_ptr, out_ptr, pid_n, N, SPLITS, 8 * BLOCK_P, HAS_BIAS)
    else:
        if HAS_BIAS:
            bias = b_ptr + p * 8
            t0 += tl.load(bias, mask=p_mask, other=0.0).to(tl.float32)
            t1 += tl.load(bias + 1, mask=p_mask, other=0.0).to(tl.float32)
            t2 += tl.load(bias + 2, mask=p_mask, other=0.0).to(tl.float32)
            t3 += tl.load(bias + 3, mask=p_mask, other=0.0).to(tl.float32)
            t4 += tl.load(bias + 4, mask=p_mask, other=0.0).to(tl.float32)
            t5 += tl.load(bias + 5, mask=p_mask, other=0.0).to(tl.float32)
            t6 += tl.load(bias + 6, mask=p_mask, other=0.0).to(tl.float32)
            t7 += tl.load(bias + 7, mask=p_mask, other=0.0).to(tl.float32)
        _store8(out_ptr, p, p_mask, t0, t1, t2, t3, t4, t5, t6, t7)


@jit
def _dequant_tile(q, z, s_ptr, g, N, rp, p_mask, DT: tl.constexpr, ASM: tl.constexpr):
    """The weight tile [BK, 8 * BP] in natural column order and dtype DT from packed words
    q [BK, BP] and zero words z [1, BP] of group g: (q - z) exact as half2 planes (one LOP3 and one
    HFMA2 per two weights), then the scales: fp16 as one more HFMA2 (the half2 scales are
    (col 2j, col 2j + 1) pairs, one int32 of scales viewed as int32), bf16 through fp32."""
    nz0, nz1, nz2, nz3 = _neg_zeros(z, ASM)
    d0, d1, d2, d3 = _centered(q, nz0, nz1, nz2, nz3, ASM)
    if DT == tl.float16:
        s = s_ptr + g * (N // 2) + rp[None, :] * 4  # int32 view: word 4p + j = scales of columns 8p + 2j, +1
        pm = p_mask[None, :]
        zero = tl.zeros(q.shape, tl.int32)
        d0 = _hfma2(d0, tl.load(s, mask=pm, other=0), zero, ASM)
        d1 = _hfma2(d1, tl.load(s + 1, mask=pm, other=0), zero, ASM)
        d2 = _hfma2(d2, tl.load(s + 2, mask=pm, other=0), zero, ASM)
        d3 = _hfma2(d3, tl.load(s + 3, mask=pm, other=0), zero, ASM)
    # join: [BK, BP, 2, 2] whose (u, v) is plane 2u + v, then each half2 split into (lo, hi):
    # [BK, BP, 2, 2, 2] flattens to column 8p + 2j + h.
    planes = tl.join(tl.join(d0, d2), tl.join(d1, d3))
    halves = tl.join(planes.to(tl.int16), (planes >> 16).to(tl.int16))
    w = tl.reshape(halves, [q.shape[0], 8 * q.shape[1]]).to(tl.float16, bitcast=True)
    if DT == tl.float16:
        return w
    else:
        cols = rp[:, None] * 8 + tl.arange(0, 8)[None, :]
        s = tl.load(s_ptr + g * N + cols, mask=p_mask[:, None], other=0.0).to(tl.float32)
        return (w.to(tl.float32) * tl.reshape(s, [8 * q.shape[1]])[None, :]).to(DT)


@jit
def _weight_tile(qw_ptr, qz_ptr, s_ptr, k, k_mask, g, NP, N, rp, p_mask, DT: tl.constexpr, ASM: tl.constexpr):
    """Rows ``k`` (in group ``g``) x packed columns ``rp`` of the weight, loaded and dequantized
    (``_dequant_tile``): the GEMM kernels' B tile, before either lays it out for its dot."""
    q = tl.load(qw_ptr + k.to(tl.int64)[:, None] * NP + rp[None, :], mask=k_mask[:, None] & p_mask[None, :], other=0)
    z = tl.load(qz_ptr + g * NP + rp[None, :], mask=p_mask[None, :], other=0)
    return _dequant_tile(q, z, s_ptr, g, N, rp, p_mask, DT, ASM)


@jit
def _gemm_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, b_ptr, out_ptr, part_ptr,
    M, N, NP, K, K_SPLIT, stride_xm, stride_om,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_IN_F32: tl.constexpr,
    ASM: tl.constexpr,
):
    # Grid: (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N), splits), output tiles in GROUP_M-row bands so
    # that programs running together share weight tiles in L2. A K tile lies in one group
    # (BLOCK_K divides GROUP, or GROUP >= K), and K_SPLIT is a multiple of BLOCK_K. Each K tile
    # of packed weights is dequantized in registers (``_dequant_tile``) and multiplied by one
    # tl.dot accumulating in fp32.
    BLOCK_P: tl.constexpr = BLOCK_N // 8
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = rm < M
    rp = pid_n * BLOCK_P + tl.arange(0, BLOCK_P)
    p_mask = rp < NP
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    pid_s = tl.program_id(1)
    k_lo = pid_s * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    kk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + kk
        k_mask = k < K
        a = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = _weight_tile(qw_ptr, qz_ptr, s_ptr, k, k_mask, k0 // GROUP, NP, N, rp, p_mask, a.dtype, ASM)
        if DOT_IN_F32:  # the interpreter's bf16 tl.dot is wrong; same operands, in fp32
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32))
        else:
            acc = tl.dot(a, w, acc)
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT:
        part = part_ptr + pid_s.to(tl.int64) * M * N
        tl.store(part + rm.to(tl.int64)[:, None] * N + rn[None, :], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=mask)


@jit
def _gemm_swap_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, b_ptr, out_ptr, part_ptr,
    M, N, NP, K, K_SPLIT, stride_xm, stride_om,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_IN_F32: tl.constexpr, ASM: tl.constexpr,
):
    # _gemm_kernel with the operands swapped: out^T [BLOCK_N, BLOCK_M] = W^T @ x^T. The weight
    # columns are the MMA's 64-row side and the few activation rows its narrow side (warp-group
    # MMA takes 8..256 there), so 16 or 32 rows need no padding to 64, and the dequantized tile
    # is operand A, which the warp-group MMA may read from registers (x^T, operand B, is what
    # goes through shared memory). Grid: (cdiv(N, BLOCK_N), splits, cdiv(M, BLOCK_M)).
    BLOCK_P: tl.constexpr = BLOCK_N // 8
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = rm < M
    rp = pid_n * BLOCK_P + tl.arange(0, BLOCK_P)
    p_mask = rp < NP
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    k_lo = pid_s * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    kk = tl.arange(0, BLOCK_K)
    x_cols = x_ptr + rm.to(tl.int64)[None, :] * stride_xm
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + kk
        k_mask = k < K
        a = tl.load(x_cols + k[:, None], mask=k_mask[:, None] & m_mask[None, :], other=0.0)
        w = tl.trans(_weight_tile(qw_ptr, qz_ptr, s_ptr, k, k_mask, k0 // GROUP, NP, N, rp, p_mask, a.dtype, ASM))
        if DOT_IN_F32:  # the interpreter's bf16 tl.dot is wrong; same operands, in fp32
            acc += tl.dot(w.to(tl.float32), a.to(tl.float32))
        else:
            acc = tl.dot(w, a, acc)
    mask = n_mask[:, None] & m_mask[None, :]
    if SPLIT:
        part = part_ptr + pid_s.to(tl.int64) * M * N
        tl.store(part + rm.to(tl.int64)[None, :] * N + rn[:, None], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + rm.to(tl.int64)[None, :] * stride_om + rn[:, None], acc.to(out_ptr.dtype.element_ty),
                 mask=mask)


@jit
def _splitk_reduce_kernel(
    part_ptr, b_ptr, out_ptr, M, N, S, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK: tl.constexpr,
):
    # Grid: (M, cdiv(N, BLOCK)). Adds the S partial rows [S, M, N] of one output row, in order.
    row, cols = row_and_cols(BLOCK)
    mask = cols < N
    acc = tl.zeros([BLOCK], tl.float32)
    for s0 in range(0, S, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        offs = (s.to(tl.int64)[:, None] * M + row) * N + cols[None, :]
        acc += tl.sum(tl.load(part_ptr + offs, mask=(s < S)[:, None] & mask[None, :], other=0.0), axis=0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


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


@dataclass(frozen=True)
class GemvConfig:
    """Launch choices of the M == 1 kernel: packed words (8 columns each) per program, rows per
    tile (spread over the threads; a step is 4 tiles), warps, and how many programs to aim for
    per SM when choosing the K splits."""

    block_p: int
    block_r: int
    num_warps: int
    programs_per_sm: int = 16
    chain: int = 2  # fp16 kernel: steps summed in fp16 before fp32 (see _gemv_f16_kernel)


@dataclass(frozen=True)
class GemmConfig:
    """Launch choices of the M >= 2 kernel."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    programs_per_sm: int = 2
    swap: bool = False  # _gemm_swap_kernel (weight columns on the MMA's 64-row side)


def gemv_config(n: int, k: int) -> GemvConfig:
    """The M == 1 tile for an [K, N] layer.

    One warp per program, 32 packed words (128-byte rows: whole cache lines, every DRAM sector
    fetched is used) of 4 rows a tile: 16-byte loads, 32 columns a thread, 8 such loads in
    flight per thread (this step's 4 tiles and the next). At ~96 registers about 20 warps fit an
    SM; the K splits aim at about 10 programs per SM in whole groups (``gemv_splits``; 2- and
    4-warp programs were slower on an H200).
    """
    return GemvConfig(block_p=16, block_r=8, num_warps=1, programs_per_sm=10, chain=2)


def gemm_config(m: int, n: int, k: int) -> GemmConfig:
    """The M >= 2 tile for ``m`` rows of an [K, N] layer.

    Below ``DEQUANT_MIN_ROWS`` rows the product is bound by reading and unpacking the weights.
    Measured on an H200 (Llama-2-7B projections, group 128, ``benchmarks/bench_w4a16.py`` with
    explicit splits): up to 32 rows the swapped kernel (``_gemm_swap_kernel``: weight columns on
    the warp-group MMA's 64-row side, the rows on its narrow side, no padding of 16 rows to 64)
    beat the 16-row ``mma.sync`` tiles of ``_gemm_kernel`` by 5-25% (o_proj 15.1 -> 13.0 µs,
    down 30.5 -> 22.9 at 16 rows), with 128-column tiles and about 3 programs per SM for the
    narrow layers and 64-column tiles, one program per SM, for the wide ones at 32 rows. At 64
    rows the swapped kernel won only for gate_up (71 -> 66 µs, 64-column tiles) and down (40 ->
    37, 128 x 64 tiles, split K); qkv and o_proj keep ``_gemm_kernel``'s 64 x 64 tiles.
    """
    if m <= 16:
        return GemmConfig(16, 128, 128, num_warps=4, num_stages=3, programs_per_sm=3, swap=True)
    if m <= 32:
        if n >= 8192:
            return GemmConfig(32, 64, 128, num_warps=4, num_stages=4, programs_per_sm=1, swap=True)
        return GemmConfig(32, 128, 128, num_warps=4, num_stages=3, programs_per_sm=3, swap=True)
    if n >= 16384:
        return GemmConfig(64, 64, 128, num_warps=4, num_stages=4, programs_per_sm=1, swap=True)
    if k >= 8192:
        return GemmConfig(64, 128, 64, num_warps=4, num_stages=3, programs_per_sm=3, swap=True)
    return GemmConfig(64, 64, 128, num_warps=4, num_stages=4, programs_per_sm=1)


def gemv_splits(tiles: int, k: int, group_size: int, step: int, programs: int) -> int | None:
    """K splits of the M == 1 kernel: whole groups per split (a split that cuts a group reloads
    its zeros and scales), as many as bring the programs nearest to ``programs``. ``None`` (let
    ``split_k`` count rows) when there is one group or a step does not divide it.

    On an H200 the best measured split of each Llama-2-7B projection was whole groups at ~8-12
    programs per SM: qkv 2 groups (16 splits, 14.1 µs), o_proj 1 (32, 9.0), gate_up 4 (8, 22.4),
    down 2 (43, 14.9); the previous row-count rule (12 programs per SM in 32-row steps) cut
    groups and took 14.4, 10.2, 28.1 and 15.3 µs."""
    if group_size >= k or group_size % step:
        return None
    groups = cdiv(k, group_size)
    per_split = max(1, round(groups * tiles / programs))
    return cdiv(groups, per_split)


def tile_k(block_k: int, group_size: int, k: int) -> int:
    """The K tile: at most ``block_k`` (and not far past K), a divisor of ``group_size`` when there
    are several groups, and at least 16 (tl.dot's minimum)."""
    bk = max(16, min(block_k, next_pow2(k)))
    if group_size < k:
        while group_size % bk:
            bk //= 2
    return bk


def split_k(
    tiles: int, k: int, unit: int, programs: int, splits: int | None = None, min_units: int = 1,
) -> tuple[int, int]:
    """``(splits, rows per split)`` for ``tiles`` output tiles: about ``programs`` programs in all
    (or ``splits`` when given), each split a whole number of ``unit`` rows (by default at least
    ``min_units`` of them)."""
    units = cdiv(k, unit)
    if splits is None:
        splits = min(cdiv(programs, tiles), units // min_units)
    k_split = cdiv(units, max(1, min(splits, units))) * unit
    return cdiv(k, k_split), k_split


_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _split_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed int32 arrival counters, one per column tile, for ``_reduce_last`` (each launch leaves
    them zero again). One buffer per device and stream: launches on one stream never overlap."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < tiles:
        buf = torch.zeros(max(tiles, 1024), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


def dequantize_awq_triton(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
    dtype: torch.dtype = torch.float16,
) -> torch.Tensor:
    """Triton launcher for :func:`dequantize_awq_ref` (fp16/bf16 output): the dense weight for
    a cuBLAS product when many rows share it (see ``DEQUANT_MIN_ROWS``)."""
    k = qweight.shape[0]
    n, group_size = check_awq_shapes(k, qweight, qzeros, scales, group_size)
    assert dtype in TRITON_DTYPES, f"unsupported dtype {dtype}"
    out = torch.empty(k, n, dtype=dtype, device=qweight.device)
    bk, bp = tile_k(32, group_size, k), 16
    _dequant_kernel[(cdiv(k, bk), cdiv(n // PACK, bp))](
        qweight.contiguous(), qzeros.contiguous(), scales.contiguous(), out, k, n, n // PACK,
        GROUP=group_size, BLOCK_K=bk, BLOCK_P=bp, num_warps=4,
    )
    return out


def w4a16_matmul_triton(
    x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
    bias: torch.Tensor | None = None, *, gemv: GemvConfig | None = None, gemm: GemmConfig | None = None,
    splits: int | None = None, dequant: bool | None = None,
) -> torch.Tensor:
    """Triton launcher for :func:`w4a16_matmul_ref`. The keyword arguments are for tuning and
    tests: the tile choices of either kernel, the number of K splits (default: fill the SMs), and
    whether M >= 2 rows take the dense-weight path (default: from ``DEQUANT_MIN_ROWS`` rows)."""
    k = x.shape[-1]
    n, group_size = check_awq_shapes(k, qweight, qzeros, scales, group_size, bias)
    assert x.dtype in TRITON_DTYPES, f"unsupported dtype {x.dtype}"
    assert group_size % 16 == 0 or group_size >= k, f"group_size {group_size}: K tiles need a multiple of 16"
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    qweight, qzeros, scales = qweight.contiguous(), qzeros.contiguous(), scales.contiguous()
    m = x2.shape[0]
    if m >= 2 and (dequant if dequant is not None else m >= DEQUANT_MIN_ROWS):
        w = dequantize_awq_triton(qweight, qzeros, scales, group_size, x.dtype)
        out = torch.matmul(x2, w) if bias is None else torch.addmm(bias.to(x.dtype), x2, w)
        return out.view(*x.shape[:-1], n)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*x.shape[:-1], n)
    sms = sm_count(x.device)  # the interpreter: 1 (tests set splits themselves)
    b = bias if bias is not None else scales  # a placeholder pointer when there is no bias
    asm = not TRITON_INTERPRETED
    if m == 1 and gemm is None:
        cfg = gemv or gemv_config(n, k)
        step = 4 * cfg.block_r
        if group_size < k and group_size % step:  # a step must lie in one group: 16-row steps
            cfg, step = replace(cfg, block_r=4), 16
        tiles = cdiv(n // PACK, cfg.block_p)
        if splits is None:
            splits = gemv_splits(tiles, k, group_size, step, cfg.programs_per_sm * sms)
        s, k_split = split_k(tiles, k, step, cfg.programs_per_sm * sms, splits)
        part = torch.empty(s, 1, n, dtype=torch.float32, device=x.device) if s > 1 else out
        if x.dtype == torch.float16:
            _gemv_f16_kernel[(tiles, s)](
                x2, qweight, qzeros, scales, b, out, part, _split_counters(x.device, tiles), k, n, n // PACK,
                k_split, s, GROUP=group_size, BLOCK_P=cfg.block_p, BLOCK_R=cfg.block_r, CHAIN=cfg.chain,
                SPLIT=s > 1, HAS_BIAS=bias is not None, ASM=asm, num_warps=cfg.num_warps,
            )
            return out.view(*x.shape[:-1], n)  # split or not, the kernel wrote the output
        _gemv_kernel[(tiles, s)](
            x2, qweight, qzeros, scales, b, out, part, k, n, n // PACK, k_split,
            GROUP=group_size, BLOCK_P=cfg.block_p, BLOCK_R=cfg.block_r,
            SPLIT=s > 1, HAS_BIAS=bias is not None, num_warps=cfg.num_warps,
        )
    else:
        cfg = gemm or gemm_config(m, n, k)
        assert cfg.block_n >= 64 or TRITON_INTERPRETED, "tl.dot tiles need at least 64 columns here"
        bk = tile_k(cfg.block_k, group_size, k)
        tiles = cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)
        s, k_split = split_k(tiles, k, bk, cfg.programs_per_sm * sms, splits, min_units=4)
        part = torch.empty(s, m, n, dtype=torch.float32, device=x.device) if s > 1 else out
        # fp16: the scales as int32 pairs (one half2 load per two columns, see _dequant_tile).
        s_arg = scales.view(torch.int32) if x.dtype == torch.float16 else scales
        dot_in_f32 = TRITON_INTERPRETED and x.dtype == torch.bfloat16
        if cfg.swap:
            _gemm_swap_kernel[(cdiv(n, cfg.block_n), s, cdiv(m, cfg.block_m))](
                x2, qweight, qzeros, s_arg, b, out, part, m, n, n // PACK, k, k_split, x2.stride(0), out.stride(0),
                GROUP=group_size, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=bk,
                SPLIT=s > 1, HAS_BIAS=bias is not None, DOT_IN_F32=dot_in_f32,
                ASM=asm, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            )
        else:
            _gemm_kernel[(tiles, s)](
                x2, qweight, qzeros, s_arg, b, out, part, m, n, n // PACK, k, k_split, x2.stride(0), out.stride(0),
                GROUP=group_size, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=bk, GROUP_M=cfg.group_m,
                SPLIT=s > 1, HAS_BIAS=bias is not None, DOT_IN_F32=dot_in_f32,
                ASM=asm, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            )
    if s > 1:
        block = 64
        _splitk_reduce_kernel[(m, cdiv(n, block))](
            part, b, out, m, n, s, out.stride(0),
            HAS_BIAS=bias is not None, BLOCK_S=min(next_pow2(s), 64), BLOCK=block, num_warps=4,
        )
    return out.view(*x.shape[:-1], n)


def _problem(x: torch.Tensor, group_size: int) -> str | None:
    k = x.shape[-1]
    if x.dtype not in TRITON_DTYPES:
        return f"x dtype {x.dtype} (fp16 or bf16 only)"
    if group_size != -1 and group_size < k and group_size % 16:
        return f"group_size {group_size} is not a multiple of 16"
    return None


def w4a16_matmul(
    x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x [..., K] @ W + bias`` -> [..., N] in x's dtype for an AWQ-packed W (see the module doc):
    Triton on CUDA, else :func:`w4a16_matmul_ref`. Bad shapes raise ValueError on either path."""
    check_awq_shapes(x.shape[-1], qweight, qzeros, scales, group_size, bias)
    if triton_takes("w4a16_matmul", (x, qweight, qzeros, scales), _problem, x, group_size):
        return w4a16_matmul_triton(x, qweight, qzeros, scales, group_size, bias)
    return w4a16_matmul_ref(x, qweight, qzeros, scales, group_size, bias)

