"""The fused-MoE dispatcher: the Triton kernel for CUDA tensors it can take, else the reference.

The Triton path: ``moe_align`` sorts the (token, slot) pairs by expert into ``BLOCK_M`` tiles,
``_gate_up_kernel`` writes ``act(gate) * up`` per pair [T*k, I], ``_down_kernel`` the weighted
down projection per pair [T*k, H], and a torch sum over the k slots gives [T, H]. Three kernels
plus a few small torch ops for the alignment; no host sync, so it captures in a CUDA graph.
"""

from __future__ import annotations

import torch

from .._triton import FLOAT_DTYPES, cdiv, triton_takes
from .align import moe_align
from .gemm import ACT_CODES, _down_kernel, _gate_up_kernel
from .policy import MoeConfig, moe_config
from .reference import fused_moe_ref


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
    cfg = config or moe_config(num_tokens, top_k, num_experts, x.element_size())
    sorted_pairs, tile_expert, _ = moe_align(topk_ids, num_experts, cfg.block_m)
    tiles = tile_expert.numel()
    # Pairs of other ranks' experts get no tile: their rows must read as zero in the sum.
    y = torch.zeros(num_pairs, hidden, dtype=x.dtype, device=x.device)
    if tiles == 0:
        return y.view(num_tokens, top_k, hidden).sum(dim=1) if top_k else torch.zeros_like(x)
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).float().contiguous()
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 exact; tf32 is unused for 16-bit
    launch = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PRECISION=precision,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    _gate_up_kernel[(tiles, cdiv(inter, cfg.block_n))](
        x, w13, h, sorted_pairs, tile_expert, num_pairs, top_k, hidden, inter, x.stride(0), h.stride(0),
        ACT=ACT_CODES[activation], **launch,
    )
    _down_kernel[(tiles, cdiv(hidden, cfg.block_n))](
        h, w2, y, weights, sorted_pairs, tile_expert, num_pairs, hidden, inter, h.stride(0), y.stride(0),
        **launch,
    )
    # torch's half-precision sum accumulates in fp32: one rounding per slot's product, one at the end.
    return y.view(num_tokens, top_k, hidden).sum(dim=1)


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
