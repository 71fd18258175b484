"""The dispatcher of the fused expert MLP on AWQ (W4A16) experts: the Triton kernels of
``gemm_w4a16.py`` for CUDA tensors they can take, else ``fused_moe_w4a16_ref``.

The Triton path is ``launch.fused_moe_triton``'s: ``moe_align`` lays the pairs out by expert,
the gate/up GEMM writes ``act(gate) * up`` per pair, the down GEMM the weighted product per pair,
``_sum_slots_kernel`` the sum over a token's k slots. No host sync, so it captures in a CUDA
graph. Tiles: ``policy.table_config``'s ``BLOCK_M`` and ``BLOCK_N``, ``BLOCK_K`` shortened to
divide the group size (``w4a16.policy.tile_k``).
"""

from __future__ import annotations

import torch

from .._triton import TRITON_INTERPRETED, cdiv, triton_takes
from ..w4a16.policy import tile_k
from .align import moe_align
from .gemm import ACT_CODES, _sum_slots_kernel
from .gemm_w4a16 import _down_w4a16_kernel, _gate_up_w4a16_kernel
from .launch import _SUM_BLOCK
from .policy import MoeConfig, table_config
from .reference_w4a16 import check_moe_awq_shapes, fused_moe_w4a16_ref

TRITON_DTYPES = (torch.float16, torch.bfloat16)


def _scales_arg(scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # fp16: the scales as int32 pairs (one half2 load per two columns, w4a16.gemm._dequant_tile).
    return scales.view(torch.int32) if dtype == torch.float16 else scales


def fused_moe_w4a16_triton(
    x: torch.Tensor, w13_qweight: torch.Tensor, w13_qzeros: torch.Tensor, w13_scales: torch.Tensor,
    w2_qweight: torch.Tensor, w2_qzeros: torch.Tensor, w2_scales: torch.Tensor, group_size: int,
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str = "silu", config: MoeConfig | None = None,
) -> torch.Tensor:
    """Triton launcher for :func:`fused_moe_w4a16_ref` (``config``: the tiles, for tests)."""
    num_tokens, hidden = x.shape
    num_experts, inter = check_moe_awq_shapes(hidden, w13_qweight, w13_qzeros, w13_scales, w2_qweight, w2_qzeros,
                                              w2_scales, group_size)
    assert x.dtype in TRITON_DTYPES, f"unsupported dtype {x.dtype}"
    assert topk_weights.shape == topk_ids.shape and topk_ids.shape[0] == num_tokens
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    if x.stride(-1) != 1:
        x = x.contiguous()
    cfg = config or table_config(num_tokens, top_k, num_experts, x.element_size())
    # As kernels/w4a16's GEMM: its dequantized tiles feed tl.dot from 64 columns (8 packed words) up.
    assert min(cfg.gate_up.block_n, cfg.down.block_n) >= 64 or TRITON_INTERPRETED, "BLOCK_N below 64"
    g13 = hidden if group_size == -1 else group_size
    g2 = inter if group_size == -1 else group_size
    sorted_pairs, tile_expert, _ = moe_align(topk_ids, num_experts, cfg.block_m)
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).float().contiguous()
    dot_in_f32 = TRITON_INTERPRETED and x.dtype == torch.bfloat16
    asm = not TRITON_INTERPRETED
    qw, qz, sc = w13_qweight.contiguous(), w13_qzeros.contiguous(), _scales_arg(w13_scales.contiguous(), x.dtype)
    t = cfg.gate_up
    _gate_up_w4a16_kernel[(tile_expert.numel(), cdiv(inter, t.block_n))](
        x, qw, qz, sc, h, sorted_pairs, tile_expert, num_pairs, top_k, hidden, inter, x.stride(0), h.stride(0),
        qw.stride(0), qz.stride(0), sc.stride(0),
        GROUP=g13, BLOCK_M=cfg.block_m, BLOCK_N=t.block_n, BLOCK_K=tile_k(t.block_k, g13, hidden),
        ACT=ACT_CODES[activation], DOT_IN_F32=dot_in_f32, ASM=asm, num_warps=t.num_warps, num_stages=t.num_stages,
    )
    qw, qz, sc = w2_qweight.contiguous(), w2_qzeros.contiguous(), _scales_arg(w2_scales.contiguous(), x.dtype)
    t = cfg.down
    _down_w4a16_kernel[(tile_expert.numel(), cdiv(hidden, t.block_n))](
        h, qw, qz, sc, y, weights, sorted_pairs, tile_expert, num_pairs, hidden, inter, h.stride(0), y.stride(0),
        qw.stride(0), qz.stride(0), sc.stride(0),
        GROUP=g2, BLOCK_M=cfg.block_m, BLOCK_N=t.block_n, BLOCK_K=tile_k(t.block_k, g2, inter),
        DOT_IN_F32=dot_in_f32, ASM=asm, num_warps=t.num_warps, num_stages=t.num_stages,
    )
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    _sum_slots_kernel[(num_tokens, cdiv(hidden, _SUM_BLOCK))](
        y, out, ids, num_experts, hidden, y.stride(0), out.stride(0), TOP_K=top_k, BLOCK=_SUM_BLOCK, num_warps=4)
    return out


def _problem(x: torch.Tensor, w13_scales: torch.Tensor, w2_scales: torch.Tensor, group_size: int,
             activation: str) -> str | None:
    if x.dtype not in TRITON_DTYPES:
        return f"x dtype {x.dtype} (fp16 or bf16 only)"
    if w13_scales.dtype != x.dtype or w2_scales.dtype != x.dtype:
        return f"scales {w13_scales.dtype}/{w2_scales.dtype} differ from x's {x.dtype}"
    if group_size != -1 and group_size % 16:
        return f"group_size {group_size} is not a multiple of 16"
    if activation not in ACT_CODES:
        return f"activation {activation!r} (silu, gelu or gelu_tanh)"
    return None


def fused_moe_w4a16(
    x: torch.Tensor, w13_qweight: torch.Tensor, w13_qzeros: torch.Tensor, w13_scales: torch.Tensor,
    w2_qweight: torch.Tensor, w2_qzeros: torch.Tensor, w2_scales: torch.Tensor, group_size: int,
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str = "silu",
) -> torch.Tensor:
    """The expert MLP of every token on AWQ experts: ``fused_moe``'s result with each expert's
    weights the dequantized ``(q - z) * s`` of its triples (layout: ``gemm_w4a16.py``)."""
    args = (x, w13_qweight, w13_qzeros, w13_scales, w2_qweight, w2_qzeros, w2_scales, group_size,
            topk_weights, topk_ids, activation)
    if triton_takes("fused_moe_w4a16", (x, w13_qweight, w2_qweight, topk_ids), _problem, x, w13_scales, w2_scales,
                    group_size, activation):
        return fused_moe_w4a16_triton(*args)
    return fused_moe_w4a16_ref(*args)
