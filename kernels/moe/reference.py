"""The plain-torch reference of the fused expert MLP (the package doc): used on CPU, and what the
Triton kernel is tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


def fused_moe_ref(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    activation: str = "silu",
) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, k] (fp32), topk_ids [T, k] -> [T, H].

    Each expert in use multiplies the rows routed to it at once; the products are summed in fp32,
    weighted by ``topk_weights``, and the result cast to x's dtype. ``topk_ids`` outside [0, E)
    (an expert another tensor-parallel or expert-parallel rank holds) contribute nothing."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    assert w13.shape[2] == hidden and w2.shape == (num_experts, hidden, two_inter // 2), "w13 / w2 shapes"
    assert topk_weights.shape == topk_ids.shape and topk_ids.shape[0] == num_tokens
    act = ACTIVATIONS[activation]
    inter = two_inter // 2
    out = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1).long()
    flat_weights = topk_weights.reshape(-1).float()
    token_of = torch.arange(num_tokens, device=x.device).repeat_interleave(topk_ids.shape[1])
    for e in flat_ids.unique().tolist():
        if not 0 <= e < num_experts:
            continue
        slots = (flat_ids == e).nonzero(as_tuple=True)[0]
        rows = token_of[slots]
        gate_up = x[rows].float() @ w13[e].float().t()
        h = act(gate_up[:, :inter]) * gate_up[:, inter:]
        out.index_add_(0, rows, (h @ w2[e].float().t()) * flat_weights[slots, None])
    return out.to(x.dtype)
