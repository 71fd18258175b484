"""Expert selection in one Triton kernel: ``routing.select_experts_ref``'s softmax or sigmoid
scores, top-k and optional renormalisation, a program per token (grouped top-k has no kernel:
``select_experts`` gives it to the reference).

A decode step scores a handful of tokens; as torch ops the selection is five to eight launches
per layer (softmax, the top-k's sort and gather, the sum and division), each a few microseconds
of a step whose expert GEMMs take tens. Here it is one. The top-k is k passes of a max over the
token's E scores (E <= 1024), taking the lowest index among equal scores, as ``torch.topk``
orders them.
"""

# No ``from __future__ import annotations``: Triton reads ``tl.constexpr`` annotations as objects.

import torch

from .._triton import jit, next_pow2, tl

SCORING_CODES = {"softmax": 0, "sigmoid": 1}
MAX_EXPERTS = 1024  # one program holds a token's scores in registers


@jit
def _select_kernel(
    logits, weights, ids, num_experts, stride_t,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, SCORING: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, E_PAD)
    real = cols < num_experts
    x = tl.load(logits + t * stride_t + cols, mask=real, other=float("-inf")).to(tl.float32)
    if SCORING == 0:
        p = tl.exp(x - tl.max(x, axis=0))
        p = p / tl.sum(p, axis=0)
    else:
        p = 1.0 / (1.0 + tl.exp(-x))
    # Scores are >= 0: -1 marks the padding columns and the experts already taken.
    p = tl.where(real, p, -1.0)
    slots = tl.arange(0, K_PAD)
    top_w = tl.zeros([K_PAD], dtype=tl.float32)
    top_i = tl.zeros([K_PAD], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        at = tl.min(tl.where(p == best, cols, E_PAD), axis=0)
        top_w = tl.where(slots == j, best, top_w)
        top_i = tl.where(slots == j, at, top_i)
        p = tl.where(cols == at, -1.0, p)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=0)
    tl.store(weights + t * TOP_K + slots, top_w, mask=slots < TOP_K)
    tl.store(ids + t * TOP_K + slots, top_i, mask=slots < TOP_K)


def select_experts_triton(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, scoring: str = "softmax"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``select_experts_ref`` without groups, as one kernel: (weights [T, k] fp32, ids [T, k] int32)."""
    num_tokens, num_experts = router_logits.shape
    if router_logits.stride(-1) != 1:
        router_logits = router_logits.contiguous()
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if num_tokens:
        _select_kernel[(num_tokens,)](
            router_logits, weights, ids, num_experts, router_logits.stride(0),
            TOP_K=top_k, K_PAD=next_pow2(top_k), E_PAD=next_pow2(num_experts), SCORING=SCORING_CODES[scoring],
            RENORMALIZE=renormalize, num_warps=4 if num_experts >= 256 else 1,
        )
    return weights, ids


def select_problem(router_logits: torch.Tensor, top_k: int, scoring: str) -> str | None:
    """Why the kernel cannot take these inputs (None: it can)."""
    if scoring not in SCORING_CODES:
        return f"scoring {scoring!r}"
    if router_logits.shape[-1] > MAX_EXPERTS or not 0 < top_k <= router_logits.shape[-1]:
        return f"{router_logits.shape[-1]} experts, top {top_k} (at most {MAX_EXPERTS} experts)"
    if router_logits.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"logits dtype {router_logits.dtype}"
    return None
