"""The plain-torch reference of the fused expert MLP on AWQ (W4A16) experts (``gemm_w4a16.py``
gives the stacked layout): each expert in use dequantized to fp32, then ``fused_moe_ref``. Used
on CPU and what the Triton kernel is tested against."""

from __future__ import annotations

import torch

from ..w4a16.reference import dequantize_awq_ref
from .reference import fused_moe_ref


def check_moe_awq_shapes(hidden: int, w13_qweight: torch.Tensor, w13_qzeros: torch.Tensor,
                         w13_scales: torch.Tensor, w2_qweight: torch.Tensor, w2_qzeros: torch.Tensor,
                         w2_scales: torch.Tensor, group_size: int) -> tuple[int, int]:
    """(experts, intermediate size) of stacked AWQ experts for ``hidden`` inputs; ValueError on
    a shape that does not match (the layout in ``gemm_w4a16.py``)."""
    num_experts, two_inter = w13_scales.shape[0], w13_scales.shape[-1]
    inter = two_inter // 2
    g13 = -(-hidden // (hidden if group_size == -1 else group_size))
    g2 = -(-inter // (inter if group_size == -1 else group_size))
    want = {"w13_qweight": (num_experts, hidden, two_inter // 8), "w13_qzeros": (num_experts, g13, two_inter // 8),
            "w13_scales": (num_experts, g13, two_inter), "w2_qweight": (num_experts, inter, hidden // 8),
            "w2_qzeros": (num_experts, g2, hidden // 8), "w2_scales": (num_experts, g2, hidden)}
    got = {"w13_qweight": w13_qweight, "w13_qzeros": w13_qzeros, "w13_scales": w13_scales,
           "w2_qweight": w2_qweight, "w2_qzeros": w2_qzeros, "w2_scales": w2_scales}
    bad = {k: tuple(t.shape) for k, t in got.items() if tuple(t.shape) != want[k]}
    if two_inter % 16 or hidden % 8 or bad:
        raise ValueError(f"AWQ expert tensors for hidden {hidden}, group_size {group_size}: expected "
                         f"{ {k: want[k] for k in bad} }, got {bad} (2I = {two_inter} must be a multiple of 16)")
    for k in ("w13_qweight", "w13_qzeros", "w2_qweight", "w2_qzeros"):
        if got[k].dtype != torch.int32:
            raise ValueError(f"{k} must be int32, got {got[k].dtype}")
    return num_experts, inter


def dequantize_experts_ref(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                           experts: list[int] | None = None) -> torch.Tensor:
    """Stacked AWQ triples [E, K, N/8] ... -> the dense fp32 weights [E, N, K] (``fused_moe``'s
    [out, in] order), of ``experts`` only (the others stay zero) or of every expert."""
    num_experts, k = qweight.shape[0], qweight.shape[1]
    out = torch.zeros(num_experts, scales.shape[-1], k, dtype=torch.float32, device=qweight.device)
    for e in range(num_experts) if experts is None else experts:
        out[e] = dequantize_awq_ref(qweight[e], qzeros[e], scales[e], group_size).t()
    return out


def fused_moe_w4a16_ref(
    x: torch.Tensor, w13_qweight: torch.Tensor, w13_qzeros: torch.Tensor, w13_scales: torch.Tensor,
    w2_qweight: torch.Tensor, w2_qzeros: torch.Tensor, w2_scales: torch.Tensor, group_size: int,
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str = "silu",
) -> torch.Tensor:
    """``fused_moe_ref`` on the dequantized experts (only those ``topk_ids`` name), computed in
    fp32 and cast to x's dtype."""
    num_experts, _ = check_moe_awq_shapes(x.shape[-1], w13_qweight, w13_qzeros, w13_scales, w2_qweight, w2_qzeros,
                                          w2_scales, group_size)
    used = [e for e in topk_ids.unique().tolist() if 0 <= e < num_experts]
    w13 = dequantize_experts_ref(w13_qweight, w13_qzeros, w13_scales, group_size, used)
    w2 = dequantize_experts_ref(w2_qweight, w2_qzeros, w2_scales, group_size, used)
    return fused_moe_ref(x.float(), w13, w2, topk_weights, topk_ids, activation).to(x.dtype)
