"""The MoE references against loops written from their definitions: the fused expert MLP token by
token, and expert selection (softmax then top-k, renormalised or not, grouped top-k)."""

import pytest
import torch
import torch.nn.functional as F

from conveyor.kernels.moe import fused_moe_ref, select_experts_ref


def _expert_loop(x, w13, w2, weights, ids):
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if not 0 <= e < w13.shape[0]:
                continue
            gate_up = w13[e].double() @ x[t].double()
            out[t] += float(weights[t, j]) * (w2[e].double() @ (F.silu(gate_up[:inter]) * gate_up[inter:]))
    return out.float()


@pytest.mark.parametrize("tokens, experts, top_k", [(1, 4, 2), (7, 8, 2), (13, 6, 3)])
def test_fused_moe_reference_equals_the_token_loop(tokens: int, experts: int, top_k: int) -> None:
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 16, generator=gen)
    w13, w2 = torch.randn(experts, 24, 16, generator=gen), torch.randn(experts, 16, 12, generator=gen)
    weights, ids = select_experts_ref(torch.randn(tokens, experts, generator=gen), top_k, renormalize=True)
    torch.testing.assert_close(fused_moe_ref(x, w13, w2, weights, ids), _expert_loop(x, w13, w2, weights, ids),
                               atol=1e-4, rtol=1e-4)


def test_experts_of_another_rank_contribute_nothing() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 16, generator=gen)
    w13, w2 = torch.randn(2, 24, 16, generator=gen), torch.randn(2, 16, 12, generator=gen)
    ids = torch.tensor([[0, 5], [1, 0], [7, 6], [1, 1]], dtype=torch.int32)
    weights = torch.rand(4, 2, generator=gen)
    out = fused_moe_ref(x, w13, w2, weights, ids)
    assert torch.all(out[2] == 0)
    torch.testing.assert_close(out, _expert_loop(x, w13, w2, weights, ids), atol=1e-4, rtol=1e-4)


def test_selection_rules() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.5, 0.1, 0.2, 4.0]])
    probs = torch.softmax(logits, -1)
    weights, ids = select_experts_ref(logits, 2, renormalize=False)
    assert ids.tolist() == [[1, 2], [3, 0]] and ids.dtype == torch.int32
    torch.testing.assert_close(weights, probs.gather(1, ids.long()))
    weights, _ = select_experts_ref(logits, 2, renormalize=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2))
    # Groups of two experts scored by their best: for row 0 the group {2, 3} loses to {0, 1}.
    _, ids = select_experts_ref(logits, 2, renormalize=False, num_expert_group=2, topk_group=1)
    assert ids.tolist() == [[1, 0], [3, 2]]
    # The router runs in fp32 whatever the logits' dtype.
    weights, _ = select_experts_ref(logits.half(), 2, renormalize=True)
    assert weights.dtype == torch.float32
