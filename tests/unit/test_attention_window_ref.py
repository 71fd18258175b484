"""The attention reference's sliding window, soft-capping and ALiBi against a per-query loop
written from their definitions (transformers' ``sliding_window_overlay``: key k is visible to the
query at position p when p - W < k <= p; Gemma 2's capping: s -> c * tanh(s / c) before the
softmax; ALiBi: head h's score gets slope_h * (k - p), after the scale and before the cap)."""

import math

import pytest
import torch

from conveyor.kernels.attention import alibi_slopes, paged_attention_ref


def _dense_case(q_lens, k_lens, h, hkv, d, seed):
    """q [T, H, D], per-sequence keys/values [Lk, Hkv, D], and the same keys in one-token blocks."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(q_lens), h, d, generator=gen)
    ks = [torch.randn(n, hkv, d, generator=gen) for n in k_lens]
    vs = [torch.randn(n, hkv, d, generator=gen) for n in k_lens]
    k_cache = torch.cat(ks).unsqueeze(1)
    v_cache = torch.cat(vs).unsqueeze(1)
    starts = [0, *torch.tensor(k_lens).cumsum(0).tolist()]
    tables = torch.zeros(len(k_lens), max(k_lens), dtype=torch.int32)
    for b, n in enumerate(k_lens):
        tables[b, :n] = torch.arange(starts[b], starts[b] + n)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, ks, vs, k_cache, v_cache, tables, cu, torch.tensor(k_lens, dtype=torch.int32)


def _loop(q, ks, vs, q_lens, k_lens, scale, window, softcap, slopes=None):
    out = torch.empty_like(q)
    row = 0
    for b, (lq, lk) in enumerate(zip(q_lens, k_lens)):
        group = q.shape[1] // ks[b].shape[1]
        for i in range(lq):
            p = lk - lq + i
            for head in range(q.shape[1]):
                kv = head // group
                scores = []
                for key in range(lk):
                    visible = key <= p and (window is None or key > p - window)
                    s = float(q[row, head] @ ks[b][key, kv]) * scale
                    if slopes is not None:
                        s += float(slopes[head]) * (key - p)
                    if softcap is not None:
                        s = softcap * math.tanh(s / softcap)
                    scores.append(s if visible else -math.inf)
                w = torch.softmax(torch.tensor(scores, dtype=torch.float64), 0)
                out[row, head] = (w[:, None] * vs[b][:, kv].double()).sum(0).float()
            row += 1
    return out


@pytest.mark.parametrize("window, softcap", [(3, None), (None, 2.0), (4, 1.5), (1, None)])
def test_window_and_softcap_reference(window, softcap) -> None:
    q_lens, k_lens = [5, 1, 7], [5, 9, 12]  # a prefill, a decode step, a chunk after a prefix
    q, ks, vs, kc, vc, bt, cu, sk = _dense_case(q_lens, k_lens, 4, 2, 8, seed=window or 0)
    scale = 8**-0.5 * 3  # scores large enough that capping changes them
    out = paged_attention_ref(q, kc, vc, bt, cu, sk, scale, sliding_window=window, softcap=softcap)
    expected = _loop(q, ks, vs, q_lens, k_lens, scale, window, softcap)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window, softcap", [(None, None), (4, None), (None, 2.0)])
def test_alibi_reference(window, softcap) -> None:
    """Six heads (not a power of two: the interleaved slopes), alone and with a window or a cap."""
    q_lens, k_lens = [5, 1, 7], [5, 9, 12]
    q, ks, vs, kc, vc, bt, cu, sk = _dense_case(q_lens, k_lens, 6, 2, 8, seed=11)
    scale, slopes = 8**-0.5 * 3, alibi_slopes(6)
    out = paged_attention_ref(q, kc, vc, bt, cu, sk, scale, sliding_window=window, softcap=softcap,
                              alibi_slopes=slopes)
    expected = _loop(q, ks, vs, q_lens, k_lens, scale, window, softcap, slopes)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
