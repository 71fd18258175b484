"""The dispatcher of the fused expert MLP on W8A8 experts: the Triton kernels of ``gemm_w8a8.py``
for CUDA tensors they can take, else ``fused_moe_w8a8_ref``.

The Triton path: ``kernels/w8a8``'s per-token quantizer on x, ``moe_align`` lays the pairs out by
expert, the int8 gate/up GEMM writes ``act(gate) * up`` per pair in x's dtype, the same quantizer
turns those rows into int8 codes and a scale per pair, the int8 down GEMM writes the weighted
product per pair, ``_sum_slots_kernel`` the sum over a token's k slots. No host sync, so it
captures in a CUDA graph. Tiles: ``policy.table_config`` at one byte an element.
"""

from __future__ import annotations

import torch

from .._triton import cdiv, triton_takes
from ..rms_norm import MAX_HIDDEN
from ..w8a8 import MAX_K, quant_per_token_triton
from .align import moe_align
from .gemm import ACT_CODES, _sum_slots_kernel
from .gemm_w8a8 import _down_w8a8_kernel, _gate_up_w8a8_kernel
from .launch import _SUM_BLOCK
from .policy import MoeConfig, table_config
from .reference_w8a8 import check_moe_w8a8_shapes, fused_moe_w8a8_ref

TRITON_DTYPES = (torch.float16, torch.bfloat16)


def fused_moe_w8a8_triton(
    x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str = "silu", config: MoeConfig | None = None,
) -> torch.Tensor:
    """Triton launcher for :func:`fused_moe_w8a8_ref` (``config``: the tiles, for tests)."""
    num_tokens, hidden = x.shape
    num_experts, inter = check_moe_w8a8_shapes(hidden, w13, w13_scale, w2, w2_scale)
    assert x.dtype in TRITON_DTYPES, f"unsupported dtype {x.dtype}"
    assert topk_weights.shape == topk_ids.shape and topk_ids.shape[0] == num_tokens
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    cfg = config or table_config(num_tokens, top_k, num_experts, element_size=1)
    xq, xs = quant_per_token_triton(x)
    sorted_pairs, tile_expert, _ = moe_align(topk_ids, num_experts, cfg.block_m)
    # Rows of pairs whose expert another rank holds are never written, quantized as whatever
    # they hold, and never read (no tile, and the slot sum skips them by id).
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).float().contiguous()
    w13, w13_scale, w2, w2_scale = w13.contiguous(), w13_scale.contiguous(), w2.contiguous(), w2_scale.contiguous()
    t = cfg.gate_up
    _gate_up_w8a8_kernel[(tile_expert.numel(), cdiv(inter, t.block_n))](
        xq, xs, w13, w13_scale, h, sorted_pairs, tile_expert, num_pairs, top_k, hidden, inter, xq.stride(0),
        h.stride(0), BLOCK_M=cfg.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, ACT=ACT_CODES[activation],
        num_warps=t.num_warps, num_stages=t.num_stages,
    )
    hq, hs = quant_per_token_triton(h)
    t = cfg.down
    _down_w8a8_kernel[(tile_expert.numel(), cdiv(hidden, t.block_n))](
        hq, hs, w2, w2_scale, y, weights, sorted_pairs, tile_expert, num_pairs, hidden, inter, hq.stride(0),
        y.stride(0), BLOCK_M=cfg.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
        num_warps=t.num_warps, num_stages=t.num_stages,
    )
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    _sum_slots_kernel[(num_tokens, cdiv(hidden, _SUM_BLOCK))](
        y, out, ids, num_experts, hidden, y.stride(0), out.stride(0), TOP_K=top_k, BLOCK=_SUM_BLOCK, num_warps=4)
    return out


def _problem(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
             w2_scale: torch.Tensor, activation: str) -> str | None:
    if x.dtype not in TRITON_DTYPES:
        return f"x dtype {x.dtype} (fp16 or bf16 only)"
    if w13.dtype != torch.int8 or w2.dtype != torch.int8:
        return f"weights {w13.dtype}/{w2.dtype} (int8 only)"
    if w13_scale.dtype != torch.float32 or w2_scale.dtype != torch.float32:
        return f"scales {w13_scale.dtype}/{w2_scale.dtype} (float32 only)"
    inter = w2.shape[-1]
    if not (0 < x.shape[-1] <= min(MAX_K, MAX_HIDDEN) and 0 < inter <= min(MAX_K, MAX_HIDDEN)):
        return f"hidden {x.shape[-1]} / intermediate {inter} past the quantizer's or int32 sum's limit"
    if activation not in ACT_CODES:
        return f"activation {activation!r} (silu, gelu or gelu_tanh)"
    return None


def fused_moe_w8a8(
    x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str = "silu",
) -> torch.Tensor:
    """The expert MLP of every token on W8A8 experts (int8 weights per output channel, x and the
    intermediate quantized per row at run time; layout: ``gemm_w8a8.py``)."""
    args = (x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, activation)
    if triton_takes("fused_moe_w8a8", (x, w13, w2, topk_ids), _problem, x, w13, w13_scale, w2, w2_scale,
                    activation):
        return fused_moe_w8a8_triton(*args)
    return fused_moe_w8a8_ref(*args)
