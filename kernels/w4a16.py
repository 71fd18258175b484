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

Reading 4-bit codes without shifts or conversions. Column ``2j + h`` of a word is nibble ``j``
of its half ``h`` (bits ``16h + 4j``), so with ``hi = word >> 16`` (one shift per word) every
column is one AND-OR away from a float: ``bits(2**23 + c * 16**j) = 0x4B000000 | (half &
0xF << 4j)``, exact since ``c * 16**j < 2**16``. Two such values subtract to ``(q - z) * 16**j``
exactly, and ``16**-j`` is folded into the scale. This avoids both the slow int-to-float
conversion instruction and per-column shifts; the kernels never reorder the packed data.

* **M == 1** (batch-1 decode): a GEMV. A program takes 8 * BLOCK_P columns (16-byte loads, 32
  columns a thread) and a range of rows; per group it accumulates ``x * q * 16**j`` in a
  register tile (one fused multiply-add per weight, no reduction in the loop) and folds in the
  zeros and scales once, when the group ends (``sum x (q - z) = sum x q - z sum x``). The
  packed weights are read once, no dense weight is written, the next step's loads are issued
  before this step's arithmetic. N tiles alone are too few for 132 SMs (4096 columns are 16
  tiles of 256), so K is split as well and a second small kernel adds the per-split partial
  sums in a fixed order (deterministic, unlike atomics).
* **2 <= M < DEQUANT_MIN_ROWS** (batched decode): a tiled GEMM with ``tl.dot``; the weight tile
  stays as 8 column planes (column C of each word), each with its own dot and accumulator,
  which unpacks with constant masks and no register shuffling; the tensor cores multiply the
  exact integers ``(q - z) * 16**j`` and the scales are applied to each K tile's fp32 product.
  Split over K too when the output tiles are fewer than the SMs.
* **M >= DEQUANT_MIN_ROWS** (prefill, large batches): a Triton kernel writes the dense weight in
  x's dtype and cuBLAS multiplies, as AutoAWQ and vLLM do for large batches. A transient
  K * N * 2 bytes (180 MB for Llama-2-7B's gate_up) is allocated per call.

Measured on one H200 (``benchmarks/bench_w4a16.py``, Llama-2-7B projections, group 128): at
M = 1 the GEMV takes 10-30 µs per projection, 1.4-1.6x faster than fp16 cuBLAS but only ~35% of
HBM bandwidth: it is bound by unpacking (~4.3 instructions per weight in the SASS, of which
AND-OR, FADD, FFMA are the useful three), not by memory. The fused GEMM roughly matches fp16 at
M = 16 and loses from ~48 rows on, where the dense-weight path takes over (~0.5x fp16 at 256
rows, ~1x at 2048). A K tile never straddles two groups (``BLOCK_K`` and the GEMV's row step
divide ``group_size``, or one group covers K). Launch choices are in ``gemv_config`` /
``gemm_config`` / ``split_k``.
"""

# No ``from __future__ import annotations``: Triton reads ``tl.constexpr`` annotations as objects.

from dataclasses import dataclass

import torch

from ._triton import TRITON_INTERPRETED, cdiv, grouped_tile, jit, next_pow2, row_and_cols, sm_count, tl, triton_takes

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""Nibble ``i`` (bits ``4i .. 4i+3``) of a packed int32 holds column ``AWQ_PACK_ORDER[i]`` of its 8."""
AWQ_NIBBLE_OF_COLUMN = (0, 4, 1, 5, 2, 6, 3, 7)
"""Column ``j`` of a packed int32's 8 sits at nibble ``AWQ_NIBBLE_OF_COLUMN[j]`` (the inverse)."""
PACK = 8  # 4-bit values per int32
TRITON_DTYPES = (torch.float16, torch.bfloat16)
# From this many rows on, the Triton path writes the dense weight and lets cuBLAS multiply: the
# fused kernel unpacks the weight once per 16-row tile, a cost that grows with M, while the dense
# write and read cost a fixed ~K * N * 4 bytes. On an H200 (Llama-2-7B qkv and down, group 128)
# the fused kernel took 39/29 µs at 16 rows and 54 µs (qkv) at 32, the dense path ~67 µs at
# 16..128 rows; at 64 rows fused 71-84 µs against 66-69.
DEQUANT_MIN_ROWS = 48


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


@jit
def _plane(q, q_hi, z, z_hi, C: tl.constexpr, DT: tl.constexpr):
    """Column C of every word of a [BLOCK_K, BLOCK_P] tile as ``(q - z) * 16**j`` in DT (exact:
    at most 4 significant bits, below 65504), where column C is nibble ``j = C // 2`` of the
    low (C even) or high (C odd) 16 bits: one AND-OR per weight reads it in place."""
    J4: tl.constexpr = 4 * (C >> 1)
    if C & 1:
        d = ((q_hi & (0xF << J4)) | 0x4B000000).to(tl.float32, bitcast=True)
        d -= ((z_hi & (0xF << J4)) | 0x4B000000).to(tl.float32, bitcast=True)[None, :]
    else:
        d = ((q & (0xF << J4)) | 0x4B000000).to(tl.float32, bitcast=True)
        d -= ((z & (0xF << J4)) | 0x4B000000).to(tl.float32, bitcast=True)[None, :]
    return d.to(DT)


@jit
def _plane_scales(s_ptr, g, N, rp, p_mask, C: tl.constexpr):
    """The scales of column C of each word, times ``16**-j`` (undoing _plane's in-place read)."""
    J4: tl.constexpr = 4 * (C >> 1)
    return tl.load(s_ptr + g * N + rp * 8 + C, mask=p_mask, other=0.0).to(tl.float32) * (1.0 / (1 << J4))


@jit
def _plane_dot(a, q, q_hi, z, z_hi, s_ptr, g, N, rp, p_mask, acc, C: tl.constexpr, DOT_IN_F32: tl.constexpr):
    """``acc + (a @ plane C) * scales``: the tensor cores multiply the exact small integers; the
    group's scales are applied to the tile's fp32 product (all of a K tile lies in one group)."""
    d = _plane(q, q_hi, z, z_hi, C, a.dtype)
    if DOT_IN_F32:  # the interpreter's bf16 tl.dot is wrong; same operands, in fp32
        prod = tl.dot(a.to(tl.float32), d.to(tl.float32))
    else:
        prod = tl.dot(a, d)
    return acc + prod * _plane_scales(s_ptr, g, N, rp, p_mask, C)[None, :]


@jit
def _store_planes(ptr, rm, stride, rp, mask, a0, a1, a2, a3, a4, a5, a6, a7):
    """Write the 8 column planes back to their interleaved columns ``8 * word + C``."""
    o = ptr + rm.to(tl.int64)[:, None] * stride + rp[None, :] * 8
    ty = ptr.dtype.element_ty
    tl.store(o, a0.to(ty), mask=mask)
    tl.store(o + 1, a1.to(ty), mask=mask)
    tl.store(o + 2, a2.to(ty), mask=mask)
    tl.store(o + 3, a3.to(ty), mask=mask)
    tl.store(o + 4, a4.to(ty), mask=mask)
    tl.store(o + 5, a5.to(ty), mask=mask)
    tl.store(o + 6, a6.to(ty), mask=mask)
    tl.store(o + 7, a7.to(ty), mask=mask)


@jit
def _gemm_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, b_ptr, out_ptr, part_ptr,
    M, N, NP, K, K_SPLIT, stride_xm, stride_om,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_IN_F32: tl.constexpr,
):
    # Grid: (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N), splits), output tiles in GROUP_M-row bands so
    # that programs running together share weight tiles in L2. A K tile lies in one group
    # (BLOCK_K divides GROUP, or GROUP >= K), and K_SPLIT is a multiple of BLOCK_K.
    #
    # The weight tile is kept as 8 column planes (column C of each of BLOCK_N / 8 words), each
    # with its own tl.dot and accumulator: unpacking a plane is one AND-OR per weight with
    # constant masks and no register shuffling (interleaving the planes into natural column
    # order costs more instructions than the unpacking itself), and the planes are stored to
    # their interleaved columns once at the end. The tensor cores get (q - z) * 16**j exactly;
    # the scales multiply each K tile's fp32 product instead of every weight.
    BLOCK_P: tl.constexpr = BLOCK_N // 8
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = rm < M
    rp = pid_n * BLOCK_P + tl.arange(0, BLOCK_P)
    p_mask = rp < NP
    pid_s = tl.program_id(1)
    k_lo = pid_s * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    kk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    acc0 = tl.zeros([BLOCK_M, BLOCK_P], tl.float32)
    acc1 = tl.zeros([BLOCK_M, BLOCK_P], tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_P], tl.float32)
    acc3 = tl.zeros([BLOCK_M, BLOCK_P], tl.float32)
    acc4 = tl.zeros([BLOCK_M, BLOCK_P], tl.float32)
    acc5 = tl.zeros([BLOCK_M, BLOCK_P], tl.float32)
    acc6 = tl.zeros([BLOCK_M, BLOCK_P], tl.float32)
    acc7 = tl.zeros([BLOCK_M, BLOCK_P], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + kk
        k_mask = k < K
        a = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        q = tl.load(qw_ptr + k.to(tl.int64)[:, None] * NP + rp[None, :],
                    mask=k_mask[:, None] & p_mask[None, :], other=0)
        g = k0 // GROUP
        z = tl.load(qz_ptr + g * NP + rp, mask=p_mask, other=0)
        q_hi = q >> 16
        z_hi = z >> 16
        acc0 = _plane_dot(a, q, q_hi, z, z_hi, s_ptr, g, N, rp, p_mask, acc0, 0, DOT_IN_F32)
        acc1 = _plane_dot(a, q, q_hi, z, z_hi, s_ptr, g, N, rp, p_mask, acc1, 1, DOT_IN_F32)
        acc2 = _plane_dot(a, q, q_hi, z, z_hi, s_ptr, g, N, rp, p_mask, acc2, 2, DOT_IN_F32)
        acc3 = _plane_dot(a, q, q_hi, z, z_hi, s_ptr, g, N, rp, p_mask, acc3, 3, DOT_IN_F32)
        acc4 = _plane_dot(a, q, q_hi, z, z_hi, s_ptr, g, N, rp, p_mask, acc4, 4, DOT_IN_F32)
        acc5 = _plane_dot(a, q, q_hi, z, z_hi, s_ptr, g, N, rp, p_mask, acc5, 5, DOT_IN_F32)
        acc6 = _plane_dot(a, q, q_hi, z, z_hi, s_ptr, g, N, rp, p_mask, acc6, 6, DOT_IN_F32)
        acc7 = _plane_dot(a, q, q_hi, z, z_hi, s_ptr, g, N, rp, p_mask, acc7, 7, DOT_IN_F32)
    mask = m_mask[:, None] & p_mask[None, :]
    if SPLIT:
        part = part_ptr + pid_s.to(tl.int64) * M * N
        _store_planes(part, rm, N, rp, mask, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7)
    else:
        if HAS_BIAS:
            bias = b_ptr + rp * 8
            acc0 += tl.load(bias, mask=p_mask, other=0.0).to(tl.float32)[None, :]
            acc1 += tl.load(bias + 1, mask=p_mask, other=0.0).to(tl.float32)[None, :]
            acc2 += tl.load(bias + 2, mask=p_mask, other=0.0).to(tl.float32)[None, :]
            acc3 += tl.load(bias + 3, mask=p_mask, other=0.0).to(tl.float32)[None, :]
            acc4 += tl.load(bias + 4, mask=p_mask, other=0.0).to(tl.float32)[None, :]
            acc5 += tl.load(bias + 5, mask=p_mask, other=0.0).to(tl.float32)[None, :]
            acc6 += tl.load(bias + 6, mask=p_mask, other=0.0).to(tl.float32)[None, :]
            acc7 += tl.load(bias + 7, mask=p_mask, other=0.0).to(tl.float32)[None, :]
        _store_planes(out_ptr, rm, stride_om, rp, mask, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7)


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


def gemv_config(n: int, k: int) -> GemvConfig:
    """The M == 1 tile for an [K, N] layer.

    One warp per program, 32 packed words (128-byte rows: whole cache lines, every DRAM sector
    fetched is used) of 4 rows a tile: 16-byte loads, 32 columns a thread, 8 such loads in
    flight per thread (this step's 4 tiles and the next). At ~96 registers about 20 warps fit an
    SM; the K splits aim at 12 programs per SM (12 and 16 measured within 10% of each other on
    an H200, 12 ahead on 3 of the 4 Llama-2-7B projections; 2- and 4-warp programs were slower).
    """
    return GemvConfig(block_p=32, block_r=4, num_warps=1, programs_per_sm=12)


def gemm_config(m: int, n: int, k: int) -> GemmConfig:
    """The M >= 2 tile for ``m`` rows of an [K, N] layer.

    Below ``DEQUANT_MIN_ROWS`` rows the product is bound by reading and unpacking the weights:
    16-row tiles (tl.dot's minimum; mma.sync on Hopper) even for 32 rows, since a weight tile
    unpacked once per 16 rows costs less than the idle half of a 32-row MMA; 256 columns (32
    words: 128-byte rows of packed weights, 8 column planes of 32) and 128-row K tiles at 3
    stages (measured best on an H200 among 10 tiles, for 16 and 32 rows). From 64 rows on the
    layer takes the dense-weight path; if forced through this kernel, 64-row tiles (warp-group
    MMA) were the best measured.
    """
    if m < max(DEQUANT_MIN_ROWS, 33):
        return GemmConfig(16, 256, 128, num_warps=4, num_stages=3)
    return GemmConfig(64, 128, 128, num_warps=4, num_stages=3)


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
    if m == 1:
        cfg = gemv or gemv_config(n, k)
        step = 4 * cfg.block_r
        if group_size < k and group_size % step:  # a step must lie in one group: 16-row steps
            cfg, step = GemvConfig(32, 4, 1, cfg.programs_per_sm), 16
        tiles = cdiv(n // PACK, cfg.block_p)
        s, k_split = split_k(tiles, k, step, cfg.programs_per_sm * sms, splits)
        part = torch.empty(s, 1, n, dtype=torch.float32, device=x.device) if s > 1 else out
        _gemv_kernel[(tiles, s)](
            x2, qweight, qzeros, scales, b, out, part, k, n, n // PACK, k_split,
            GROUP=group_size, BLOCK_P=cfg.block_p, BLOCK_R=cfg.block_r,
            SPLIT=s > 1, HAS_BIAS=bias is not None, num_warps=cfg.num_warps,
        )
    else:
        cfg = gemm or gemm_config(m, n, k)
        assert cfg.block_n >= 128 or TRITON_INTERPRETED, "tl.dot needs 16 words (128 columns) per plane"
        bk = tile_k(cfg.block_k, group_size, k)
        tiles = cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)
        s, k_split = split_k(tiles, k, bk, cfg.programs_per_sm * sms, splits, min_units=4)
        part = torch.empty(s, m, n, dtype=torch.float32, device=x.device) if s > 1 else out
        _gemm_kernel[(tiles, s)](
            x2, qweight, qzeros, scales, b, out, part, m, n, n // PACK, k, k_split, x2.stride(0), out.stride(0),
            GROUP=group_size, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=bk, GROUP_M=cfg.group_m,
            SPLIT=s > 1, HAS_BIAS=bias is not None, DOT_IN_F32=TRITON_INTERPRETED and x.dtype == torch.bfloat16,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
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

