"""The plain-torch reference of the fused expert MLP on W8A8 experts (``gemm_w8a8.py`` gives the
stacked layout): the kernels' arithmetic step by step, so CPU results are theirs. x is quantized
per token (``kernels/w8a8.quant_per_token_ref``: the kernel's codes bit for bit), each expert's
int8 products are summed exactly (``int8_mm_int32_ref``), both scales applied in fp32 in the
kernel's order, ``act(gate) * up`` rounded once to x's dtype and quantized per (token, slot) pair,
the down product scaled and weighted the same way, rounded per pair, and the k pairs of a token
summed in fp32 (``_sum_slots_kernel``). Used on CPU and what the Triton kernels are tested against
(they differ only by the activation's ``exp``, within an ulp, which may move an intermediate code
by one)."""

from __future__ import annotations

import torch

from ..w8a8 import int8_mm_int32_ref, quant_per_token_ref
from .reference import ACTIVATIONS


def check_moe_w8a8_shapes(hidden: int, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                          w2_scale: torch.Tensor) -> tuple[int, int]:
    """(experts, intermediate size) of stacked W8A8 experts for ``hidden`` inputs; ValueError on
    a shape or dtype that does not match (the layout in ``gemm_w8a8.py``)."""
    num_experts, two_inter = w13.shape[0], w13.shape[1]
    inter = two_inter // 2
    want = {"w13": (num_experts, two_inter, hidden), "w13_scale": (num_experts, two_inter),
            "w2": (num_experts, hidden, inter), "w2_scale": (num_experts, hidden)}
    got = {"w13": w13, "w13_scale": w13_scale, "w2": w2, "w2_scale": w2_scale}
    bad = {k: tuple(t.shape) for k, t in got.items() if tuple(t.shape) != want[k]}
    if two_inter % 2 or bad:
        raise ValueError(f"W8A8 expert tensors for hidden {hidden}: expected {({k: want[k] for k in bad})}, "
                         f"got {bad} (w13's rows: gate then up, an even count)")
    dtypes = {"w13": torch.int8, "w2": torch.int8, "w13_scale": torch.float32, "w2_scale": torch.float32}
    wrong = {k: got[k].dtype for k, d in dtypes.items() if got[k].dtype != d}
    if wrong:
        raise ValueError(f"W8A8 experts take int8 weights and float32 scales, got {wrong}")
    return num_experts, inter


def fused_moe_w8a8_ref(
    x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str = "silu",
) -> torch.Tensor:
    """x [T, H] (float), w13 int8 [E, 2I, H], w13_scale fp32 [E, 2I], w2 int8 [E, H, I], w2_scale
    fp32 [E, H], topk_weights [T, k], topk_ids [T, k] -> [T, H] in x's dtype. ``topk_ids`` outside
    [0, E) contribute nothing (``fused_moe_ref``'s contract)."""
    num_tokens, hidden = x.shape
    num_experts, inter = check_moe_w8a8_shapes(hidden, w13, w13_scale, w2, w2_scale)
    assert topk_weights.shape == topk_ids.shape and topk_ids.shape[0] == num_tokens
    act = ACTIVATIONS[activation]
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1).long()
    flat_weights = topk_weights.reshape(-1).float()
    token_of = torch.arange(num_tokens, device=x.device).repeat_interleave(top_k)
    xq, xs = quant_per_token_ref(x)
    h = torch.zeros(num_tokens * top_k, inter, dtype=x.dtype, device=x.device)
    slots_of = {}
    for e in flat_ids.unique().tolist():
        if not 0 <= e < num_experts:
            continue
        slots = slots_of[e] = (flat_ids == e).nonzero(as_tuple=True)[0]
        rows = token_of[slots]
        acc = int8_mm_int32_ref(xq[rows], w13[e]).float() * xs[rows] * w13_scale[e][None, :]
        h[slots] = (act(acc[:, :inter]) * acc[:, inter:]).to(x.dtype)
    hq, hs = quant_per_token_ref(h)
    y = torch.zeros(num_tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    for e, slots in slots_of.items():
        acc = int8_mm_int32_ref(hq[slots], w2[e]).float() * hs[slots] * w2_scale[e][None, :]
        y[slots] = (acc * flat_weights[slots, None]).to(x.dtype)
    return y.float().view(num_tokens, top_k, hidden).sum(1).to(x.dtype)
