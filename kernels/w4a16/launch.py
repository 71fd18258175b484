"""The W4A16 launchers and dispatcher: check the AWQ triple, pick the path for the row count
(GEMV, fused GEMM, or dense weight + cuBLAS) and its tiles and splits from ``policy.py``, launch;
``w4a16_matmul`` sends CUDA tensors here and the rest to the reference."""

from dataclasses import replace

import torch

from .._triton import TRITON_INTERPRETED, cdiv, next_pow2, sm_count, triton_takes
from .dequant import _dequant_kernel
from .gemm import _gemm_kernel, _gemm_swap_kernel, _splitk_reduce_kernel
from .gemv import _gemv_f16_kernel, _gemv_kernel
from .packing import PACK, check_awq_shapes
from .policy import DEQUANT_MIN_ROWS, GemmConfig, GemvConfig, gemm_config, gemv_config, gemv_splits, split_k, tile_k
from .reference import w4a16_matmul_ref

TRITON_DTYPES = (torch.float16, torch.bfloat16)


_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}


def split_counters(device: torch.device, tiles: int) -> torch.Tensor:
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
                x2, qweight, qzeros, scales, b, out, part, split_counters(x.device, tiles), k, n, n // PACK,
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
