"""Writing new keys and values into the paged KV cache, quantized or not (``quant_policy``).

Two entry points: ``store_kv`` writes already-rotated keys (uncentred: a centre needs positions);
``rotate_and_store_kv`` applies the rotary embedding to q and k and writes k and v in the same
kernel (one launch per layer fewer than rotary then store: at batch 1 each launch is latency, and
a long prefill is launched kernel by kernel, so launches cost host time too). Its rotation is
``rotary.py``'s own.

**Quantized caches** (LMDeploy's ``quant_policy`` 8 and 4: online, per token and per KV head,
asymmetric, no calibration). Each head vector ``x[0..D)`` of a key or value is stored as codes
``q = round((x - zero) / scale)`` in ``[0, 2**bits - 1]`` with ``zero = min(x)`` and ``scale =
(max(x) - min(x)) / (2**bits - 1)``, both rounded to fp16 *before* the codes are computed (so the
only error is the codes' rounding), and read back as ``q * scale + zero``:

* int8 (``quant_policy=8``): codes uint8 ``[..., D]``, one byte per value;
* int4 (``quant_policy=4``): codes uint8 ``[..., D // 2]``, byte ``j`` holds dims ``j`` (low
  nibble) and ``j + D // 2`` (high nibble): the two halves the rotary kernel computes apart, and
  two halves the attention kernels can read with one load and a shift;
* beside them a ``[..., 2]`` fp16 tensor per cache: (scale, zero) of each token's head.

**Keys are stored in a rotated basis** (QuaRot's observation): a few channels of a head's keys
carry most of their magnitude, so a per-vector range set by them leaves few levels for the rest.
Before quantization each key head is multiplied by an orthonormal ``B = key_basis(D)`` (a
normalized Hadamard matrix), which spreads those channels over all dims; queries are multiplied
by the same ``B`` in the same kernel (the rotary one), so ``(q B) . (k B) = q . k`` and the
attention kernels need no change. Values are stored as they are: rotating them measured no gain
(SmolLM2-135M, int4, 6k tokens: perplexity +13.7% plain, +5.3% keys rotated, +5.3% both). int8
keys are rotated too: unrotated, perplexity rose +0.07% instead of +0.01% and 6 of 11 greedy chat
answers stayed identical instead of 9 (44k tokens, ``benchmarks.kv_quant_quality``), though the
basis costs the rotary kernel two [heads, D] x [D, D] products a token (H200, Llama-2-7B,
batch-1 decode: 13 us a layer against 5 unrotated and 3.6 for the 16-bit cache's kernel).

**Keys are centred per sequence.** The keys of a head share a large offset (on SmolLM2-135M their
mean over tokens holds 44-63 % of their energy), and each per-vector range must span it. A
sequence's keys are stored minus a centre, and attention gives it back. Softmax ignores a constant
added to every score of a query, so a constant centre ``c`` needs nothing back: ``q . (k - c)``
differs from ``q . k`` by the same ``q . c`` for every key. But the offset is in the keys *before*
the rotary embedding, which turns it by each key's position: a constant fitted to the first chunk
fits later keys less and less (its mid-frequency dim pairs turn away). So the centre of a key at
position t is ``B R(p) m + e`` (``key_shifts_ref``):

* ``m``: the mean of the sequence's first chunk's keys before the rotary embedding, at positions
  1 .. ``CENTRE_TOKENS`` - 1; ``R(p)`` the rotary embedding at ``p``, the middle of the key's group
  of ``CENTRE_GROUP`` positions (one turned centre per 16 keys: attention adds its score once a
  group); ``B`` the key basis;
* ``e``: a constant in the key basis, set so that the key at position 0 (the attention sink, which
  every later query weighs heavily) is stored exactly. Being constant, it cancels in the softmax.

Attention adds back ``q . B R(p) m = (q B^T) . R(p) m``: the rotary kernel also writes the queries
before the key basis (``KeyCentres.queries``), and the attention kernels add per key group
``sum(a cos(p w) + b sin(p w))`` over the dim pairs, with ``a``, ``b`` from that query and ``m``
(``_centre_coeffs``). Only int4 does this (``turned_centres``): int8 keeps ``m`` zero and folds the
mean of the first chunk's keys as rotated into ``e``, a constant, which needs nothing back (its
error is small enough without, and the added scores cost ~10 % of ShareGPT throughput when both
policies took them). Two rules keep it exact: every key of a sequence is stored with the same row,
and the row is fixed before the first key is. It is computed when a sequence's first chunk is
written (``key_centres_ref``) and lives in a per-layer table at the row of the sequence's first
block (``KeyCentring``): a sequence that reuses cached blocks reuses that first block, hence its
centre. The table has rows for the first R blocks only, which the block manager hands out as first
blocks while any is free (``KVCacheLayout.reserved_head_blocks``: R = 2 x max_batch_size, as a row
for every block cost 1.5 % of int8's capacity and 3.4 % of int4's); a sequence that starts
elsewhere is stored uncentred.
Dev corpus (licence texts, SmolLM2-135M, int4): perplexity +9.0 % uncentred, +4.8 % with a constant
centre and the sink exact, +3.4 % turned; int8 greedy answers to 20 dev prompts: 13 identical
uncentred, 17 centred.

``kv_layout.KVCacheLayout`` is the one place that says which tensors a policy allocates and how many bytes
a token costs; the attention kernels tell the policy from the cache tensors (``cache_bits``).

This module holds the two store entry points and their kernels; the pieces they share with the
attention kernels live beside it, one concern a module: ``kv_layout`` (what a policy stores),
``kv_quant`` (quantize / dequantize), ``kv_basis`` (the key basis) and ``kv_centres`` (the key
centres).
"""

# No ``from __future__ import annotations``: Triton reads ``tl.constexpr`` annotations as objects.

import torch

from ._triton import FLOAT_DTYPES, next_pow2, tl, jit, triton_takes
from .kv_basis import _basis_args, _in_key_basis, to_key_basis
from .kv_centres import KeyCentring, _key_centres_triton, centre_position, key_centres_ref, key_shifts_ref, turn
from .kv_layout import CENTRE_GROUP, SCALE_DTYPE, KVCacheLayout, turned_centres
from .kv_quant import _quantize_store, cache_bits, quantize_kv_ref
from .rotary import apply_rotary_ref, load_cos_sin, rotary_launch, rotary_problem, rotate_heads, rotated_halves


def store_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    key_shifts: torch.Tensor | None = None,
) -> None:
    """Scatter k, v [T, Hkv, D] into caches [num_blocks, block_size, Hkv, code_dim] at flat slots [T].

    A slot is ``block_id * block_size + offset``; a negative slot means "do not store" (padding).
    With ``k_scales`` / ``v_scales`` ([num_blocks, block_size, Hkv, 2]) the caches hold codes
    (``KVCacheLayout``) and the vectors are quantized (``quantize_kv_ref``) on the way in, keys
    in the key basis (``to_key_basis``: the caller multiplies its queries alike) and minus
    ``key_shifts`` [T, Hkv, D] (in that basis: ``key_shifts_ref``) when given.
    """
    assert k.shape == v.shape and k.shape[0] == slot_mapping.shape[0]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    bits = cache_bits(k_cache, k.shape[-1])
    assert (k_scales is not None) == (v_scales is not None) == bool(bits), "codes and scales go together"
    assert key_shifts is None or bits, "key centres belong to a quantized cache"
    if bits:
        k = to_key_basis(k.float())
        if key_shifts is not None:
            k = k - key_shifts
    for x, cache, scales in ((k, k_cache, k_scales), (v, v_cache, v_scales)):
        flat = cache.view(-1, *cache.shape[2:])
        if bits:
            x = x[keep]
            codes, sz = quantize_kv_ref(x, bits)
            flat[slots] = codes
            scales.view(-1, *scales.shape[2:])[slots] = sz
        else:
            flat[slots] = x[keep].to(cache.dtype)


@jit
def _cache_slot(slot_ptr, t, num_kv_heads, BLOCK_SIZE: tl.constexpr):
    """Token ``t``'s cache block, its offset in that block, and how many of its heads to store."""
    slot = tl.load(slot_ptr + t).to(tl.int64)
    # Padding tokens carry slot -1: they store no head at all (a masked no-op, not a branch).
    heads = tl.where(slot >= 0, num_kv_heads, 0)
    return slot // BLOCK_SIZE, slot % BLOCK_SIZE, heads


@jit
def _store_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, slot_ptr, b_ptr, b_scale,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kc_blk, stride_kc_slot, stride_kc_h,
    stride_vc_blk, stride_vc_slot, stride_vc_h,
    stride_s_blk, stride_s_slot, stride_s_h,
    num_kv_heads,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BITS: tl.constexpr, DOT_PRECISION: tl.constexpr, SYLVESTER: tl.constexpr,
):
    # Grid: (T,); one program copies (or quantizes) all kv heads of one token (a few KiB: enough
    # per program).
    t = tl.program_id(0).to(tl.int64)
    blk, off, heads = _cache_slot(slot_ptr, t, num_kv_heads, BLOCK_SIZE)
    kc = kc_ptr + blk * stride_kc_blk + off * stride_kc_slot
    vc = vc_ptr + blk * stride_vc_blk + off * stride_vc_slot
    if BITS:
        # Halves of the head (BLOCK_D covers HEAD_DIM // 2 here), as the quantizer takes them;
        # keys in the key basis (the module doc).
        HALF: tl.constexpr = HEAD_DIM // 2
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)
        mask = (h < heads) & (d[None, :] < HALF)
        ks = k_ptr + t * stride_kt + h * stride_kh + d[None, :]
        vs = v_ptr + t * stride_vt + h * stride_vh + d[None, :]
        sz = blk * stride_s_blk + off * stride_s_slot
        k1, k2 = _in_key_basis(tl.load(ks, mask=mask, other=0.0), tl.load(ks + HALF, mask=mask, other=0.0),
                               b_ptr, b_scale, HEAD_DIM, HALF, BLOCK_D, DOT_PRECISION, SYLVESTER)
        _quantize_store(k1, k2, mask, kc, ks_ptr + sz, stride_kc_h, stride_s_h, d, HALF, BLOCK_H, BITS)
        _quantize_store(tl.load(vs, mask=mask, other=0.0), tl.load(vs + HALF, mask=mask, other=0.0), mask,
                        vc, vs_ptr + sz, stride_vc_h, stride_s_h, d, HALF, BLOCK_H, BITS)
    else:
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < heads) & (d < HEAD_DIM)
        k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask, other=0.0)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask, other=0.0)
        tl.store(kc + h * stride_kc_h + d, k.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc + h * stride_vc_h + d, v.to(vc_ptr.dtype.element_ty), mask=mask)


def _cache_problem(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None,
) -> str | None:
    """Why the cache kernels cannot store k and v into these caches, or None when they can."""
    quantized = k_scales is not None
    cache_ok = (all(t.dtype == torch.uint8 for t in (k_cache, v_cache)) if quantized
                else all(t.dtype in FLOAT_DTYPES for t in (k_cache, v_cache)))
    supported = (
        k.dim() == 3 and k_cache.dim() == 4 and k.dtype in FLOAT_DTYPES and v.dtype in FLOAT_DTYPES and cache_ok
        and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
        and (not quantized or (k_scales.stride(-1) == 1 and k_scales.stride() == v_scales.stride()))
    )
    return None if supported else f"cache {tuple(k_cache.shape)} {k_cache.dtype}"


def _check_cache_store(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None, centring: KeyCentring | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The launchers' checks on what is stored where; returns k and v with a unit stride along
    head_dim, and the cache's bits (0: unquantized)."""
    assert k.dim() == 3 and k.shape == v.shape and k.shape[0] == slot_mapping.shape[0], "k, v: [T, Hkv, D]"
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, "caches: [num_blocks, block_size, Hkv, D]"
    assert k.dtype in FLOAT_DTYPES and v.dtype in FLOAT_DTYPES, f"unsupported dtypes {k.dtype}, {v.dtype}"
    bits = cache_bits(k_cache, k.shape[-1])
    layout = KVCacheLayout(bits, k.shape[-1])
    assert k_cache.shape[2:] == (k.shape[1], layout.code_dim), \
        f"cache heads/dim {tuple(k_cache.shape[2:])} do not hold k {tuple(k.shape[1:])}"
    if bits:
        assert k_scales is not None and v_scales is not None, "a quantized cache needs its scales"
        assert k_scales.shape == v_scales.shape == (*k_cache.shape[:3], 2), "scales: [num_blocks, block_size, Hkv, 2]"
        assert k_scales.dtype == v_scales.dtype == SCALE_DTYPE and k_scales.stride() == v_scales.stride()
        assert k_scales.stride(-1) == 1, "scales need a unit stride along their last dimension"
        if centring is not None:
            table = centring.table
            assert table.shape[1:] == (2, k.shape[1], k.shape[2]) and table.dtype == SCALE_DTYPE, \
                "key centres: fp16 [rows + 1, 2, Hkv, D]"
            assert table.stride(-1) == 1 and centring.index.shape == slot_mapping.shape, "one centre row a token"
            assert centring.new is None or (centring.new.dim() == 2 and centring.new.shape[1] == 3
                                            and centring.new.dtype == torch.int32 and centring.new.is_contiguous())
    else:
        assert k_scales is None and v_scales is None, "scales given for an unquantized cache"
        assert centring is None, "key centres given for an unquantized cache"
        assert k_cache.dtype in FLOAT_DTYPES and v_cache.dtype in FLOAT_DTYPES, "unsupported cache dtype"
    assert not slot_mapping.dtype.is_floating_point, "slot_mapping must be integers"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "caches need a unit stride along head_dim"
    return k if k.stride(-1) == 1 else k.contiguous(), v if v.stride(-1) == 1 else v.contiguous(), bits


def _scale_args(k_cache: torch.Tensor, k_scales: torch.Tensor | None, v_scales: torch.Tensor | None) -> tuple:
    """The scale pointers and strides a kernel takes (the caches and zeros when unquantized)."""
    if k_scales is None:
        return k_cache, k_cache, (0, 0, 0)
    return k_scales, v_scales, (k_scales.stride(0), k_scales.stride(1), k_scales.stride(2))


def store_kv_triton(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None,
) -> None:
    """Triton launcher for :func:`store_kv_ref`; k/v may be strided views (e.g. of a fused qkv)."""
    devices = {t.device for t in (k, v, k_cache, v_cache, slot_mapping)}
    assert len(devices) == 1, f"tensors on several devices: {devices}"
    k, v, bits = _check_cache_store(k, v, k_cache, v_cache, slot_mapping, k_scales, v_scales)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    ks, vs, s_strides = _scale_args(k_cache, k_scales, v_scales)
    basis, b_scale, precision, sylvester = _basis_args(head_dim, k.device, k.dtype) if bits else (k, 1.0, "ieee", False)
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, ks, vs, slot_mapping, basis, b_scale,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *s_strides, num_kv_heads,
        # A quantized store multiplies keys by the basis with tl.dot: at least 16 rows and columns.
        BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim,
        BLOCK_H=max(16, next_pow2(num_kv_heads)) if bits else next_pow2(num_kv_heads),
        BLOCK_D=max(16, next_pow2(head_dim // 2)) if bits else next_pow2(head_dim),
        BITS=bits, DOT_PRECISION=precision, SYLVESTER=sylvester, num_warps=4,
    )


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None,
) -> None:
    """Scatter k, v [T, Hkv, D] into the paged caches at ``slot_mapping`` [T] (negative: skip),
    quantized when the caches hold codes (with ``k_scales`` / ``v_scales``: the module doc; keys
    that arrive rotated are stored uncentred, as their centre needs their positions).

    Triton on CUDA, else the reference.
    """
    args = (k, v, k_cache, v_cache, slot_mapping, k_scales, v_scales)
    if triton_takes("store_kv", (k, v, k_cache, v_cache), _cache_problem, k, v, k_cache, v_cache, k_scales, v_scales):
        store_kv_triton(*args)
    else:
        store_kv_ref(*args)


def rotate_and_store_kv_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None, centring: KeyCentring | None = None,
    model_queries: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate q [T, H, D] and k [T, Hkv, D] (``apply_rotary_ref``), store rotated k and v at
    ``slot_mapping`` (``store_kv_ref``, keys centred with ``centring``: ``key_shifts_ref``);
    returns the rotated q, for a quantized cache in the key basis (``to_key_basis``), and writes
    it before that basis into ``model_queries`` when given (``KeyCentres.queries``). The inputs
    are left untouched."""
    assert model_queries is None or centring is not None, \
        "the queries before the key basis are written for centred keys (KeyCentres)"
    q_rot, k_rot = apply_rotary_ref(q, k, positions, cos_sin_cache)
    if model_queries is not None:
        model_queries.copy_(q_rot)
    shifts = None
    if centring is not None:
        assert k_scales is not None, "key centres belong to a quantized cache"
        if centring.new is not None:
            key_centres_ref(k, positions, centring.new, centring.table, cache_bits(k_cache, k.shape[-1]),
                            cos_sin_cache)
        shifts = key_shifts_ref(centring.table, centring.index, positions, cos_sin_cache)
    store_kv_ref(k_rot, v, k_cache, v_cache, slot_mapping, k_scales, v_scales, shifts)
    return q_rot if k_scales is None else to_key_basis(q_rot)


@jit
def _rotate_and_store_kv_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cs_ptr, slot_ptr, q_out_ptr, qm_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr,
    b_ptr, b_scale, c_ptr, ci_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_qot, stride_qoh, stride_qmt, stride_qmh, stride_cs,
    stride_kc_blk, stride_kc_slot, stride_kc_h,
    stride_vc_blk, stride_vc_slot, stride_vc_h,
    stride_s_blk, stride_s_slot, stride_s_h,
    stride_ci, stride_c_row, stride_c_kind, stride_c_h, last_row, max_pos,
    num_q_heads, num_kv_heads,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BITS: tl.constexpr, DOT_PRECISION: tl.constexpr, SYLVESTER: tl.constexpr,
    CENTRED: tl.constexpr, GROUP: tl.constexpr, TURNED: tl.constexpr, MODEL_QUERIES: tl.constexpr,
):
    # Grid: (T, 3); program (t, part) handles every head of token t's queries (part 0), keys (1)
    # or values (2). The rotated key goes straight to its cache slot (rounded to k's dtype first),
    # quantized there for a quantized cache (in the key basis, as q is then): the key is never
    # written in 16 bits. Three programs a token rather than one: at batch 1 the kernel is one
    # chain of dependent steps (load, rotate, basis product, reductions, store), and the three
    # chains then run side by side on three SMs.
    t = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    if part == 0:
        d, d_mask, cos, sin = load_cos_sin(pos_ptr, cs_ptr, t, stride_cs, HALF, BLOCK_HALF)
        if BITS:
            q1, q2, qmask = rotated_halves(q_ptr + t * stride_qt, stride_qh, num_q_heads, d, d_mask, cos, sin,
                                           HALF, BLOCK_HQ)
            if MODEL_QUERIES:  # the queries before the key basis too, for the centres' scores (KeyCentres)
                qm = qm_ptr + t * stride_qmt + tl.arange(0, BLOCK_HQ)[:, None] * stride_qmh + d[None, :]
                tl.store(qm, q1.to(qm_ptr.dtype.element_ty), mask=qmask)
                tl.store(qm + HALF, q2.to(qm_ptr.dtype.element_ty), mask=qmask)
            q1, q2 = _in_key_basis(q1, q2, b_ptr, b_scale, 2 * HALF, HALF, BLOCK_HALF, DOT_PRECISION, SYLVESTER)
            qo = q_out_ptr + t * stride_qot + tl.arange(0, BLOCK_HQ)[:, None] * stride_qoh + d[None, :]
            tl.store(qo, q1.to(q_out_ptr.dtype.element_ty), mask=qmask)
            tl.store(qo + HALF, q2.to(q_out_ptr.dtype.element_ty), mask=qmask)
        else:
            rotate_heads(q_ptr + t * stride_qt, q_out_ptr + t * stride_qot, stride_qh, stride_qoh, num_q_heads,
                         d, d_mask, cos, sin, HALF, BLOCK_HQ)
    else:
        blk, off, heads = _cache_slot(slot_ptr, t, num_kv_heads, BLOCK_SIZE)
        sz = blk * stride_s_blk + off * stride_s_slot
        if part == 1:
            d, d_mask, cos, sin = load_cos_sin(pos_ptr, cs_ptr, t, stride_cs, HALF, BLOCK_HALF)
            kc = kc_ptr + blk * stride_kc_blk + off * stride_kc_slot
            if BITS:
                k1, k2, kmask = rotated_halves(k_ptr + t * stride_kt, stride_kh, heads, d, d_mask, cos, sin,
                                               HALF, BLOCK_HK)
                if CENTRED:
                    row = tl.minimum(tl.load(ci_ptr + t * stride_ci).to(tl.int64), last_row)
                    c_row = c_ptr + row * stride_c_row + tl.arange(0, BLOCK_HK)[:, None] * stride_c_h
                if CENTRED and TURNED:
                    # Minus the sequence's mean key turned to this key's centre position, before the
                    # key basis; minus the shift e after it (KeyCentring; key_shifts_ref).
                    p = centre_position(tl.load(pos_ptr + t).to(tl.int64), max_pos, GROUP)
                    u1, u2 = turn(tl.load(c_row + d[None, :], mask=kmask, other=0.0).to(tl.float32),
                                  tl.load(c_row + HALF + d[None, :], mask=kmask, other=0.0).to(tl.float32),
                                  cs_ptr, p, stride_cs, d[None, :], HALF)
                    ty = k_ptr.dtype.element_ty
                    k1 = (k1.to(tl.float32) - u1).to(ty)
                    k2 = (k2.to(tl.float32) - u2).to(ty)
                k1, k2 = _in_key_basis(k1, k2, b_ptr, b_scale, 2 * HALF, HALF, BLOCK_HALF, DOT_PRECISION,
                                       SYLVESTER)
                if CENTRED:
                    e_row = c_row + stride_c_kind + d[None, :]
                    k1 = k1 - tl.load(e_row, mask=kmask, other=0.0).to(tl.float32)
                    k2 = k2 - tl.load(e_row + HALF, mask=kmask, other=0.0).to(tl.float32)
                _quantize_store(k1, k2, kmask, kc, ks_ptr + sz, stride_kc_h, stride_s_h, d, HALF, BLOCK_HK, BITS)
            else:
                rotate_heads(k_ptr + t * stride_kt, kc, stride_kh, stride_kc_h, heads, d, d_mask, cos, sin,
                             HALF, BLOCK_HK)
        else:
            d = tl.arange(0, BLOCK_HALF)
            hk = tl.arange(0, BLOCK_HK)
            mask = (hk[:, None] < heads) & (d[None, :] < HALF)
            vsrc = v_ptr + t * stride_vt + hk[:, None] * stride_vh + d[None, :]
            vc = vc_ptr + blk * stride_vc_blk + off * stride_vc_slot
            v1, v2 = tl.load(vsrc, mask=mask, other=0.0), tl.load(vsrc + HALF, mask=mask, other=0.0)
            if BITS:
                _quantize_store(v1, v2, mask, vc, vs_ptr + sz, stride_vc_h, stride_s_h, d, HALF, BLOCK_HK, BITS)
            else:
                vdst = vc + hk[:, None] * stride_vc_h + d[None, :]
                tl.store(vdst, v1.to(vc_ptr.dtype.element_ty), mask=mask)
                tl.store(vdst + HALF, v2.to(vc_ptr.dtype.element_ty), mask=mask)


def rotate_and_store_kv_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None, centring: KeyCentring | None = None,
    model_queries: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton launcher for :func:`rotate_and_store_kv_ref`; q/k/v may be strided views of a fused qkv."""
    q, k, cs, constexprs, num_warps = rotary_launch(q, k, positions, cos_sin_cache)
    k, v, bits = _check_cache_store(k, v, k_cache, v_cache, slot_mapping, k_scales, v_scales, centring)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    ks, vs, s_strides = _scale_args(k_cache, k_scales, v_scales)
    basis, b_scale, precision, sylvester = (_basis_args(q.shape[-1], q.device, q.dtype) if bits
                                            else (q, 1.0, "ieee", False))
    if bits:  # the basis products are tl.dot: at least 16 rows (heads) and columns
        half, block_half, block_hq, block_hk = constexprs
        constexprs = (half, max(16, block_half), max(16, block_hq), max(16, block_hk))
    centred = centring is not None
    assert model_queries is None or (centred and model_queries.shape == q.shape and model_queries.stride(-1) == 1), \
        "the queries before the key basis are written for centred keys (KeyCentres)"
    if q.shape[0]:
        if centred:
            _key_centres_triton(k, positions, cs, centring, bits)
            table, index = centring.table, centring.index
            c_args = (index.stride(0), table.stride(0), table.stride(1), table.stride(2), table.shape[0] - 1)
            qm = q_out if model_queries is None else model_queries
        else:
            table, index, c_args, qm = k_cache, k_cache, (0, 0, 0, 0, 0), q_out
        _rotate_and_store_kv_kernel[(q.shape[0], 3)](
            q, k, v, positions, cs, slot_mapping, q_out, qm, k_cache, v_cache, ks, vs, basis, b_scale, table, index,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            q_out.stride(0), q_out.stride(1), qm.stride(0), qm.stride(1), cs.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            *s_strides, *c_args, cs.shape[0], q.shape[1], k.shape[1], *constexprs, BLOCK_SIZE=k_cache.shape[1],
            BITS=bits, DOT_PRECISION=precision, SYLVESTER=sylvester, CENTRED=centred, GROUP=CENTRE_GROUP,
            TURNED=turned_centres(bits), MODEL_QUERIES=model_queries is not None, num_warps=num_warps,
        )
    return q_out


def _rotate_and_store_problem(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, k_scales: torch.Tensor | None, v_scales: torch.Tensor | None,
) -> str | None:
    return rotary_problem(q, k, cos_sin_cache) or _cache_problem(k, v, k_cache, v_cache, k_scales, v_scales)


def rotate_and_store_kv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None, centring: KeyCentring | None = None,
    model_queries: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate q and k by ``positions``, write rotated k and v into the paged caches at
    ``slot_mapping`` (negative: skip), quantized when the caches hold codes (keys centred with
    ``centring``); returns the rotated q (for a quantized cache, in the key basis:
    ``to_key_basis``), and writes it before that basis into ``model_queries`` when given.
    Triton on CUDA, else the reference."""
    args = (q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scales, v_scales, centring,
            model_queries)
    if triton_takes("rotate_and_store_kv", (q, k, v, k_cache, v_cache), _rotate_and_store_problem,
                    q, k, v, cos_sin_cache, k_cache, v_cache, k_scales, v_scales):
        return rotate_and_store_kv_triton(*args)
    return rotate_and_store_kv_ref(*args)
