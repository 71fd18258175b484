"""Launch policy of the attention kernels: the tuning knobs a caller may set (``AttentionTuning``,
one frozen value the benchmarks pass in; the engine passes none and gets the defaults) and the
heuristics that fill the rest from the problem and the GPU (decode partitions, programs an SM)."""

import functools
from dataclasses import dataclass

import torch

from .._triton import TRITON_INTERPRETED, cdiv
from .decode_quant import TUNE_FOLD, TUNE_K_HOIST, TUNE_LAZY, TUNE_PAIR, TUNE_SCALE_AHEAD, TUNE_V_HOIST

# Decode partition (tokens per program) bounds; the size in between is picked to fill the GPU.
DECODE_PARTITION = 512  # used under the interpreter (no GPU to fill)
_MIN_DECODE_PARTITION = 128
_MAX_DECODE_PARTITION = 1024
# The quantized decode kernel's register cap (AttentionTuning's variant flags say why).
_DECODE_MAXNREG = 128
# One query a kv head (MHA: Llama-2-7B) walks a quantized cache on the CUDA cores (_decode_simt_kernel),
# one warp a program, key tiles of _SIMT_BLOCK_N; groups use the tensor cores (_decode_quant).
# H200, Llama-2-7B layer, int8, batch 256 x 1k keys: 532 us against 813 (one warp, 32-key tiles;
# 16 keys: 626, 64: 586; 2 warps: 1,018, 4 warps: 1,114, their key reductions crossing warps
# through shared memory).
_SIMT_BLOCK_N = 32
# One-warp programs: enough of them to fill an SM (the 4-warp kernels need 2).
_SIMT_PROGRAMS_PER_SM = 8

VARIANT_BITS = {"k_hoist": TUNE_K_HOIST, "v_hoist": TUNE_V_HOIST, "fold": TUNE_FOLD,
                "scale_ahead": TUNE_SCALE_AHEAD, "pair": TUNE_PAIR, "lazy": TUNE_LAZY}
"""``AttentionTuning``'s variant flags and the bit of the quantized decode kernel's TUNE each sets."""


@dataclass(frozen=True)
class AttentionTuning:
    """Overrides of the attention launcher's choices (``paged_attention_triton``): None keeps the
    launcher's own. Tests use small tiles and partitions to cross more boundaries; benchmarks
    time launch variants. The flags after ``simt`` are the quantized decode kernel's variants
    (``decode_quant.py``'s TUNE bits), all computing the same attention (tested).

    The default flags and register cap were chosen on an H200 (Llama-2-7B layer shapes, batch
    256 x 1k keys, bench_kv_quant --variants, kernel time; int8 / int4 us): the codes converted in
    registers by PTX, everything else as before: 1210 / 1129; capped at 128 registers (4 programs
    an SM instead of 3, or 2 for int4; the spills stay out of the loop): 1005 / 864; the key
    codes' conversion after the shared-memory round trip (``k_hoist``: only the values are staged
    as fp16 for the transposed operand), which needs that cap: 816 / 747.
    """

    decode_partition: int | None = None  # keys a decode program walks (min_part follows it)
    block_m: int | None = None  # prefill query tile (mla.py: heads a decode program, (token, head) rows a prefill one)
    block_n: int | None = None  # key tile (decode and prefill)
    num_warps: int | None = None  # of whichever kernel runs
    num_stages: int | None = None
    maxnreg: int | None = None  # register cap (the quantized decode kernels)
    fast_codes: bool | None = None  # codes converted by inline PTX (None: when compiled fp16/bf16)
    simt: bool | None = None  # quantized decode on the CUDA cores (None: for one query a kv head)
    k_hoist: bool = True  # key codes (PTX): Triton may convert them after their shared-memory round trip
    v_hoist: bool = False  # value codes: likewise (slow: the value operand is transposed, read bytewise)
    fold: bool = True  # fp16: codes read as 1024 + c, the 1024 folded into the softmax terms
    scale_ahead: bool = False  # each tile's scales loaded one tile ahead by hand
    pair: bool = True  # (scale, zero) read as one 32-bit word (PTX; Triton then pipelines those loads)
    lazy: bool = True  # row sums kept per key column, summed once at the end

    @functools.cached_property
    def variant_mask(self) -> int:
        """The quantized decode kernel's TUNE constant for these flags (computed once: the
        launcher reads it every decode step)."""
        return sum(bit for name, bit in VARIANT_BITS.items() if getattr(self, name))


DEFAULT_TUNING = AttentionTuning()


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
