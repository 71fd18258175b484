"""Expert selection from router logits (the package doc), in fp32 whatever the logits' dtype."""

from __future__ import annotations

import torch

from .._triton import triton_takes
from .topk import select_experts_triton, select_problem


def select_experts_ref(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, scoring: str = "softmax",
    num_expert_group: int | None = None, topk_group: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] fp32, ids [T, k] int32).

    ``scoring``: "softmax" (probabilities over all experts, then the k largest) or "sigmoid"
    (each expert's own score). ``renormalize``: divide the k weights by their sum (Mixtral,
    Qwen3-MoE) or keep them as scored (Qwen2-MoE, DeepSeek-MoE). With ``num_expert_group`` /
    ``topk_group`` (DeepSeek-V2) the experts form groups, each group is scored by its best
    expert, and the k experts are chosen inside the ``topk_group`` best groups only."""
    logits = router_logits.float()
    if scoring == "softmax":
        scores = torch.softmax(logits, dim=-1)
    elif scoring == "sigmoid":
        scores = torch.sigmoid(logits)
    else:
        raise ValueError(f"scoring {scoring!r}: use 'softmax' or 'sigmoid'")
    if num_expert_group:
        num_tokens, num_experts = scores.shape
        groups = scores.view(num_tokens, num_expert_group, num_experts // num_expert_group)
        best_groups = groups.max(dim=-1).values.topk(topk_group, dim=-1).indices
        keep = torch.zeros(num_tokens, num_expert_group, dtype=torch.bool, device=scores.device)
        keep.scatter_(1, best_groups, True)
        scores = scores.masked_fill(~keep.repeat_interleave(num_experts // num_expert_group, dim=1), 0.0)
    weights, ids = scores.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, scoring: str = "softmax",
    num_expert_group: int | None = None, topk_group: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``select_experts_ref``'s result: one Triton kernel (``topk.py``) on CUDA, else (and for
    grouped top-k, which has no kernel) the reference's torch ops."""
    if not num_expert_group and triton_takes("select_experts", (router_logits,), select_problem,
                                             router_logits, top_k, scoring):
        return select_experts_triton(router_logits, top_k, renormalize, scoring)
    return select_experts_ref(router_logits, top_k, renormalize, scoring, num_expert_group, topk_group)
