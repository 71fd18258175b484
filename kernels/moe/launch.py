"""The fused-MoE dispatcher: the Triton kernel for CUDA tensors it can take, else the reference.

The Triton path: ``moe_align`` sorts the (token, slot) pairs by expert into ``BLOCK_M`` tiles
(two kernels for a decode step), ``_gate_up_kernel`` writes ``act(gate) * up`` per pair [T*k, I],
``_down_kernel`` the weighted down projection per pair [T*k, H], and ``_sum_slots_kernel`` sums
the k slots of each token into [T, H]. No host sync, so it captures in a CUDA graph.
"""

from __future__ import annotations

import torch

from .._triton import FLOAT_DTYPES, cdiv, triton_takes
from .align import moe_align
from .gemm import ACT_CODES, _down_kernel, _gate_up_kernel, _sum_slots_kernel
from .policy import MoeConfig, Tiles, moe_config
from .reference import fused_moe_ref

_SUM_BLOCK = 1024  # columns a program of the slot sum adds


def fused_moe_triton(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    activation: str = "silu", config: MoeConfig | None = None,
) -> torch.Tensor:
    """Triton launcher for :func:`fused_moe_ref` (``config``: the tiles, for tuning and tests)."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    assert w13.shape[2] == hidden and w2.shape == (num_experts, hidden, inter), "w13 / w2 shapes"
    assert topk_weights.shape == topk_ids.shape and topk_ids.shape[0] == num_tokens
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if x.stride(-1) != 1:
        x = x.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()  # no-ops for the engine's weights (checked in _problem)
    cfg = config or moe_config(num_tokens, top_k, num_experts, x.element_size(), hidden=hidden, inter=inter,
                               dtype=x.dtype, device=x.device)
    if num_pairs == 0:
        return torch.zeros_like(x)
    sorted_pairs, tile_expert, _ = moe_align(topk_ids, num_experts, cfg.block_m)
    # Pairs of other ranks' experts get no tile and no row of y: the sum skips them by their id.
    y = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).float().contiguous()
    gate_up(x, w13, h, sorted_pairs, tile_expert, top_k, cfg.block_m, cfg.gate_up, activation)
    down(h, w2, y, weights, sorted_pairs, tile_expert, cfg.block_m, cfg.down)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    _sum_slots_kernel[(num_tokens, cdiv(hidden, _SUM_BLOCK))](
        y, out, ids, num_experts, hidden, y.stride(0), out.stride(0), TOP_K=top_k, BLOCK=_SUM_BLOCK, num_warps=4)
    return out


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # fp32 exact; tf32 is unused for 16-bit


def gate_up(x: torch.Tensor, w13: torch.Tensor, h: torch.Tensor, sorted_pairs: torch.Tensor,
            tile_expert: torch.Tensor, top_k: int, block_m: int, tiles: Tiles, activation: str = "silu") -> None:
    """``h[p] = act(gate) * up`` of every pair over ``moe_align``'s layout (also the tuner's entry)."""
    num_pairs, inter = h.shape
    _gate_up_kernel[(tile_expert.numel(), cdiv(inter, tiles.block_n))](
        x, w13, h, sorted_pairs, tile_expert, num_pairs, top_k, x.shape[1], inter, x.stride(0), h.stride(0),
        BLOCK_M=block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, ACT=ACT_CODES[activation],
        PRECISION=_precision(x.dtype), num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )


def down(h: torch.Tensor, w2: torch.Tensor, y: torch.Tensor, weights: torch.Tensor, sorted_pairs: torch.Tensor,
         tile_expert: torch.Tensor, block_m: int, tiles: Tiles) -> None:
    """``y[p] = weight[p] * (h[p] @ w2[e].T)`` of every pair (also the tuner's entry)."""
    num_pairs, hidden = y.shape
    _down_kernel[(tile_expert.numel(), cdiv(hidden, tiles.block_n))](
        h, w2, y, weights, sorted_pairs, tile_expert, num_pairs, hidden, h.shape[1], h.stride(0), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, PRECISION=_precision(h.dtype),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )


def _problem(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, activation: str) -> str | None:
    if x.dtype not in FLOAT_DTYPES:
        return f"x dtype {x.dtype} (fp16, bf16 or fp32 only)"
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        return f"weights {w13.dtype}/{w2.dtype} differ from x's {x.dtype}"
    if not (w13.is_contiguous() and w2.is_contiguous()):
        return "w13 / w2 not contiguous"
    if activation not in ACT_CODES:
        return f"activation {activation!r} (silu, gelu or gelu_tanh)"
    return None


def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    activation: str = "silu",
) -> torch.Tensor:
    """The expert MLP of every token (the package doc); ``fused_moe_ref``'s arguments and result."""
    if triton_takes("fused_moe", (x, w13, w2, topk_ids), _problem, x, w13, w2, activation):
        return fused_moe_triton(x, w13, w2, topk_weights, topk_ids, activation)
    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids, activation)
