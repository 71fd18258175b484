"""The attention launcher and dispatcher: checks the inputs, picks the kernel (decode, quantized
decode on the tensor or the CUDA cores, prefill), sizes its grid from ``policy.py`` and launches
it; ``paged_attention`` sends CUDA tensors here and the rest to the reference."""

import torch

from .._triton import FLOAT_DTYPES, TRITON_INTERPRETED, cdiv, kernel_mode, next_pow2, pdl_trigger, triton_takes
from ..kv_centres import KeyCentres
from ..kv_layout import CENTRE_GROUP, SCALE_DTYPE
from ..kv_quant import cache_bits
from .decode import _decode_kernel, _decode_reduce_kernel
from .decode_quant import TUNE_FOLD, TUNE_PAIR, _decode_simt_kernel
from .mla import _check_mla_inputs, is_mla_layout, paged_mla_triton
from .policy import (_DECODE_MAXNREG, _SIMT_BLOCK_N, _SIMT_PROGRAMS_PER_SM, DEFAULT_TUNING, AttentionTuning,
                     _decode_partition, _fast_codes, _fill_target)
from .prefill import _prefill_kernel
from .reference import paged_attention_ref, paged_decode_torch

_LOG2E = 1.4426950408889634


def _check_inputs(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor, seqlens_k: torch.Tensor,
    k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None,
    sliding_window: int | None = None, softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None, key_centres: KeyCentres | None = None,
) -> str | None:
    """Why the Triton kernels cannot take these inputs, or None when they can."""
    if softcap is not None and key_centres is not None:
        # The kernels leave out each centre's constant part (its shift's score q . e, the same for
        # every key of a query: softmax ignores it), which the cap does not ignore.
        return "soft-capping over centred keys is not in the Triton kernels (the reference has it)"
    if sliding_window is not None and not (isinstance(sliding_window, int) and sliding_window >= 1):
        return f"sliding_window {sliding_window!r} must be an int >= 1"
    if softcap is not None and not softcap > 0:
        return f"softcap {softcap!r} must be positive"
    if alibi_slopes is not None and (alibi_slopes.shape != (q.shape[1],) or alibi_slopes.dtype != torch.float32
                                     or alibi_slopes.stride(0) != 1 or alibi_slopes.device != q.device):
        return f"alibi_slopes must be fp32 [{q.shape[1]}] (one a query head), contiguous, on q's device"
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.dim() != 4 or k_cache.shape[:3] != v_cache.shape[:3]:
        return "q must be [T, H, D] and the caches [num_blocks, block_size, Hkv, D]"
    if k_cache.shape[-1] != v_cache.shape[-1]:  # the reference takes them (paged_attention_ref)
        return f"the kernels read values as wide as keys, not {v_cache.shape[-1]} against {k_cache.shape[-1]}"
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
    # A head dim that is not a power of two is padded to one inside the kernels (HEAD_PAD).
    if not 16 <= head_dim <= 256 or (k_scales is not None and head_dim % 2):
        return f"head_dim {head_dim} must be in [16, 256] (and even for a quantized cache)"
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
    key_centres: KeyCentres | None = None,
    tuning: AttentionTuning | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton launcher for :func:`paged_attention_ref` (same arguments and result).

    ``max_seqlen_q`` picks the kernel (1: decode) and sizes the prefill grid; ``max_seqlen_k``
    sizes the decode grid. Either is read from the device (a sync) when not given; a value given
    must be at least the true maximum. ``tuning`` overrides the launch choices (``AttentionTuning``:
    tile sizes, partitions, warps, stages, the quantized decode kernel's variant, register cap and
    walk); None takes them all from ``policy.py``. A quantized cache comes with ``k_scales`` /
    ``v_scales`` (``paged_attention_ref``); the decode kernel turns its codes into fp16/bf16 with
    inline PTX unless ``tuning.fast_codes=False`` (or the interpreter runs, or q is fp32), which
    selects the portable conversion (both are tested). ``sliding_window``, ``softcap`` and
    ``alibi_slopes`` are compile-time switches of the kernels: a layer without them runs the
    kernels compiled without them. With a window, decode reads only the last ``sliding_window``
    keys of each sequence (from the start of the key tile holding the first), and its grid is
    sized for that span instead of ``max_seqlen_k``.
    """
    problem = _check_inputs(q, k_cache, v_cache, block_tables, cu_seqlens_q, seqlens_k, k_scales, v_scales,
                            sliding_window, softcap, alibi_slopes, key_centres)
    assert problem is None, problem
    devices = {t.device for t in (q, k_cache, v_cache, block_tables, cu_seqlens_q, seqlens_k)}
    assert len(devices) == 1, f"tensors on several devices: {devices}"
    assert not cu_seqlens_q.dtype.is_floating_point and not seqlens_k.dtype.is_floating_point
    if tuning is None:
        tuning = DEFAULT_TUNING
    decode_partition, block_m, block_n = tuning.decode_partition, tuning.block_m, tuning.block_n
    num_warps, num_stages, maxnreg, simt = tuning.num_warps, tuning.num_stages, tuning.maxnreg, tuning.simt

    num_tokens, num_heads, head_dim = q.shape
    head_pad = next_pow2(head_dim)  # the kernels' tl.arange width; the dims past head_dim masked
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
    # The layer's score changes (tiles._score_mods): compile-time switches and their values.
    windowed, alibi, capped = sliding_window is not None, alibi_slopes is not None, softcap is not None
    mods = (alibi_slopes if alibi else q, sliding_window or 0, float(softcap) * _LOG2E if capped else 0.0)
    mod_flags = dict(WINDOW=windowed, ALIBI=alibi, SOFTCAP=capped)

    # (A batch whose sequences bring at most one query but some none goes to the prefill kernel.)
    if max_seqlen_q == 1 and num_tokens == num_seqs:
        if max_seqlen_k is None:
            max_seqlen_k = int(seqlens_k.max())
        simt = bool(bits) and group == 1 and k_cache.stride() == v_cache.stride() if simt is None else simt
        assert not simt or (bits and group == 1 and k_cache.stride() == v_cache.stride()), \
            "the CUDA-core walk takes a quantized cache, one query a kv head, keys and values alike strided"
        per_sm = _SIMT_PROGRAMS_PER_SM if simt else 2
        # A window reads at most its own keys (a sequence's span, tiles.decode_slice): the grid
        # and the partition heuristic size for that, not for the longest context.
        span = min(max_seqlen_k, sliding_window) if windowed else max_seqlen_k
        partition = decode_partition or _decode_partition(q.device, num_seqs, num_kv_heads, span, per_sm)
        bn = block_n or min(_SIMT_BLOCK_N if simt else 64 if head_pad <= 128 else 32, next_pow2(partition))
        assert partition % bn == 0, "the decode partition must be a multiple of its key tile"
        if windowed:  # the span starts at a tile boundary: up to bn - 1 keys more
            span = min(max_seqlen_k, sliding_window + bn - 1)
        num_parts = max(cdiv(span, partition), 1)
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
        fast = bool(bits) and (_fast_codes(q) if tuning.fast_codes is None else tuning.fast_codes)
        assert not (fast and (TRITON_INTERPRETED or q.dtype == torch.float32)), "fast_codes: compiled fp16/bf16 only"
        tn = tuning.variant_mask
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
                qk_scale, min_part, *mods,
                HEAD_DIM=head_dim, HEAD_PAD=head_pad, BLOCK_SIZE=block_size, BLOCK_N=bn, SPLIT=split, BITS=bits,
                FAST=fast, PAIR=bool(tn & TUNE_PAIR), CENTRED=centred, GROUP_C=CENTRE_GROUP, num_warps=num_warps or 1,
                **mod_flags, **extra,
            )
        else:
            # Partitions last: the programs past a short sequence's end (the grid is sized for
            # max_seqlen_k) are scheduled after the real ones (H200, int8, batch 256 x 1k keys,
            # grid for 4k: 822 against 1,287 us for the CUDA-core walk, 795 against 810 here).
            _decode_kernel[(num_kv_heads, num_seqs, num_parts)](
                q, k_cache, v_cache, ks, vs, block_tables, cu_seqlens_q, seqlens_k, out, part_out, part_lse,
                *common, *po_strides, *pl_strides, *c_ptrs, *c_args, qk_scale, min_part, *mods,
                GROUP=group, GROUP_PAD=max(16, next_pow2(group)), HEAD_DIM=head_dim, HEAD_PAD=head_pad,
                BLOCK_SIZE=block_size,
                BLOCK_N=bn, SPLIT=split, BITS=bits, FAST=fast, TUNE=tn if bits else 0, DOT_PRECISION=precision,
                CENTRED=centred, GROUP_C=CENTRE_GROUP, num_warps=num_warps or 4, **mod_flags, **extra,
            )
        if split:
            _decode_reduce_kernel[(num_heads, num_seqs)](
                part_out, part_lse, cu_seqlens_q, seqlens_k, out,
                *po_strides, *pl_strides, out.stride(0), out.stride(1), num_parts, min_part, mods[1],
                HEAD_DIM=head_dim, BLOCK_N=bn, BLOCK_P=min(next_pow2(num_parts), 16), WINDOW=windowed,
                HEAD_PAD=head_pad, PDL_TRIGGER=pdl_trigger(out), num_warps=4,
            )
        return out

    bm = block_m or (64 if max_seqlen_q >= 64 else max(16, next_pow2(max_seqlen_q)))
    bn = block_n or (64 if head_pad <= 128 else 32)
    _prefill_kernel[(cdiv(max_seqlen_q, bm), num_heads, num_seqs)](
        q, k_cache, v_cache, ks, vs, block_tables, cu_seqlens_q, seqlens_k, out,
        *common, *c_ptrs, *c_args, qk_scale, *mods,
        GROUP=group, HEAD_DIM=head_dim, HEAD_PAD=head_pad, BLOCK_SIZE=block_size, BLOCK_M=bm, BLOCK_N=bn, BITS=bits,
        CENTRED=centred, GROUP_C=CENTRE_GROUP, **mod_flags,
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
    sliding_window: int | None = None, softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q [T, H, D] over the paged caches: Triton on CUDA, else the reference.
    Returns [T, H, Dv]: the value cache may be narrower than the keys (the reference takes that,
    and the MLA kernels a latent cache's; the dense kernels refuse it).

    Pass ``max_seqlen_q`` / ``max_seqlen_k`` (from ``AttentionMetadata``) when known: without them
    the Triton path reads the maxima from the device, a host sync per call. Values passed must be
    at least the true maxima (an upper bound such as the model's max length is fine, and is what a
    CUDA-graph capture should pass so the launch grid stays fixed). A quantized cache (uint8
    codes) comes with ``k_scales`` / ``v_scales``; its keys and values are dequantized in registers,
    and with ``key_centres`` when its keys were stored centred (``kv_cache.KeyCentring``).
    ``sliding_window``, ``softcap`` and ``alibi_slopes`` are ``paged_attention_ref``'s. A latent
    cache (multi-head latent attention: one kv head, values a view of its rows' first columns)
    runs the MLA kernels (``mla.py``). On the GPU a decode batch the kernels refuse (no window,
    cap, ALiBi or quantized cache) runs ``paged_decode_torch`` instead of the reference: no host
    sync, so a CUDA graph captures it.
    """
    # A latent cache (values narrower than keys: multi-head latent attention) has kernels of its
    # own (mla.py); every other cache the dense ones.
    if is_mla_layout(k_cache, v_cache):
        if triton_takes("paged_attention (latent cache)", (q, k_cache, v_cache), _check_mla_inputs,
                        q, k_cache, v_cache, block_tables, cu_seqlens_q, seqlens_k, k_scales, v_scales,
                        sliding_window, softcap, alibi_slopes, key_centres):
            return paged_mla_triton(q, k_cache, v_cache, block_tables, cu_seqlens_q, seqlens_k, scale,
                                    max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    elif triton_takes("paged_attention", (q, k_cache, v_cache), _check_inputs,
                      q, k_cache, v_cache, block_tables, cu_seqlens_q, seqlens_k, k_scales, v_scales,
                      sliding_window, softcap, alibi_slopes, key_centres):
        return paged_attention_triton(
            q, k_cache, v_cache, block_tables, cu_seqlens_q, seqlens_k, scale,
            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, k_scales=k_scales, v_scales=v_scales,
            key_centres=key_centres, sliding_window=sliding_window, softcap=softcap, alibi_slopes=alibi_slopes,
        )
    plain = k_scales is None and sliding_window is None and softcap is None and alibi_slopes is None
    if (q.is_cuda and plain and kernel_mode() == "auto" and max_seqlen_q == 1 and max_seqlen_k is not None
            and q.shape[0] == seqlens_k.shape[0]):
        # Decode inputs no kernel takes (latent rows of widths mla.py refuses) on the GPU: the
        # reference reads its host lists back from the device (a sync a layer, which no CUDA graph
        # captures). kernels='ref' keeps the reference itself.
        return paged_decode_torch(q, k_cache, v_cache, block_tables, seqlens_k, scale, max_seqlen_k)
    return paged_attention_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, seqlens_k, scale, k_scales, v_scales,
                               key_centres, sliding_window, softcap, alibi_slopes)
