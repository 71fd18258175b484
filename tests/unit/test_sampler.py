"""Unit tests for conveyor.engine.sampler (CPU, fast)."""

from __future__ import annotations

import math

import torch

from conveyor.engine.sampler import Sampler
from conveyor.protocol.sampling import SamplingParams

V = 32


def _run(logits: torch.Tensor, params: list[SamplingParams], history: list[list[int]] | None = None,
         generated: list[int] | None = None, seeds: list[int] | None = None):
    """Call the sampler with neutral defaults for whatever the test does not care about."""
    b = logits.shape[0]
    return Sampler()(logits, params, history or [[] for _ in range(b)], generated or [0] * b,
                     seeds if seeds is not None else list(range(b)))


def _draws(logits: torch.Tensor, params: SamplingParams, n: int = 2000, seed: int = 0) -> list[int]:
    """``n`` independent draws from one row of logits: ``n`` rows with distinct seeds."""
    return _run(logits.expand(n, -1), [params] * n, seeds=[seed * 1_000_003 + i for i in range(n)]).token_ids


def _logits_from_probs(probs: list[float]) -> torch.Tensor:
    """A ``[1, len(probs)]`` logits row whose softmax is ``probs``."""
    return torch.tensor(probs).log()[None]


def test_greedy_is_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, V)
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=1, temperature=1.5)] * 3
    out = _run(logits, params)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs is None and out.top_logprobs is None


def test_temperature_sampling_matches_softmax() -> None:
    torch.manual_seed(1)
    logits = torch.randn(1, 8)
    n, temperature = 4000, 0.7
    counts = torch.bincount(torch.tensor(_draws(logits, SamplingParams(temperature=temperature, top_k=0), n)),
                            minlength=8).float()
    expected = (logits[0] / temperature).softmax(-1) * n
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 40.0  # 7 degrees of freedom: the 99.9% quantile is about 24


def test_top_k_only_yields_top_tokens() -> None:
    torch.manual_seed(2)
    logits = torch.randn(1, V)
    drawn = set(_draws(logits, SamplingParams(temperature=5.0, top_k=3)))
    assert drawn == set(logits[0].topk(3).indices.tolist())


def test_top_p_keeps_minimal_nucleus() -> None:
    logits = _logits_from_probs([0.5, 0.3, 0.1, 0.1])
    for top_p, nucleus in [(0.1, {0}), (0.7, {0, 1}), (0.85, {0, 1, 2}), (1.0, {0, 1, 2, 3})]:
        assert set(_draws(logits, SamplingParams(temperature=1.0, top_k=0, top_p=top_p))) == nucleus


def test_top_k_then_top_p_renormalizes() -> None:
    # After top_k=2 the kept mass is {0: 0.625, 1: 0.375}, so top_p=0.6 keeps token 0 alone.
    logits = _logits_from_probs([0.5, 0.3, 0.1, 0.1])
    assert set(_draws(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.6))) == {0}


def test_min_p_drops_unlikely_tokens() -> None:
    logits = _logits_from_probs([0.5, 0.3, 0.1, 0.1])
    assert set(_draws(logits, SamplingParams(temperature=1.0, top_k=0, min_p=0.5))) == {0, 1}
    assert set(_draws(logits, SamplingParams(temperature=1.0, top_k=0, min_p=0.1))) == {0, 1, 2, 3}


def test_repetition_penalty_changes_argmax() -> None:
    greedy = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    positive = torch.tensor([[2.0, 1.8, -1.0, -2.0]])
    assert _run(positive, [greedy]).token_ids == [0]
    assert _run(positive, [greedy], history=[[0, 0, 3]]).token_ids == [1]  # 2.0 / 2 < 1.8
    negative = torch.tensor([[-1.0, -1.5, -3.0, -4.0]])
    assert _run(negative, [greedy], history=[[0]]).token_ids == [1]  # -1.0 * 2 < -1.5


def test_bad_tokens_and_sequences_never_produced() -> None:
    torch.manual_seed(3)
    params = SamplingParams(temperature=1.0, top_k=0, bad_token_ids=[7], bad_sequences=[[3, 5], [1, 2, 4]])
    generated: list[int] = []
    for _ in range(300):
        logits = torch.randn(1, 8)
        logits[0, [3, 5, 7, 1, 2, 4]] += 2.0  # make the bad tokens tempting
        generated += _run(logits, [params], history=[list(generated)], generated=[len(generated)],
                          seeds=[3]).token_ids
    pairs = list(zip(generated, generated[1:]))
    triples = list(zip(generated, generated[1:], generated[2:]))
    assert 7 not in generated and (3, 5) not in pairs and (1, 2, 4) not in triples
    assert 3 in generated and 5 in generated  # banned only in context


def test_bad_sequence_prefix_in_prompt_does_not_ban() -> None:
    logits = torch.zeros(1, 8)
    logits[0, 5] = 10.0
    params = SamplingParams(temperature=0.0, bad_sequences=[[3, 5]])
    assert _run(logits, [params], history=[[1, 3]], generated=[0]).token_ids == [5]
    assert _run(logits, [params], history=[[1, 3]], generated=[1]).token_ids != [5]


def test_min_new_tokens_bans_stop_then_allows_it() -> None:
    logits = torch.zeros(1, 8)
    logits[0, 2] = 10.0
    params = SamplingParams(temperature=0.0, min_new_tokens=2, stop_token_ids=[2])
    assert _run(logits, [params], generated=[1]).token_ids != [2]
    assert _run(logits, [params], generated=[2]).token_ids == [2]


def test_all_tokens_banned_falls_back_without_nan() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    params = SamplingParams(temperature=1.0, top_k=0, bad_token_ids=[0, 1, 2], logprobs=1)
    out = _run(logits, [params], seeds=[0])
    assert out.token_ids[0] in (0, 1, 2) and math.isfinite(out.logprobs[0])
    dead = _run(torch.full((1, 3), float("-inf")), [params])
    assert dead.token_ids[0] in (0, 1, 2) and math.isfinite(dead.logprobs[0])


def test_seeded_row_independent_of_batch_neighbours() -> None:
    torch.manual_seed(4)
    steps = [torch.randn(6, V) for _ in range(10)]
    target = SamplingParams(temperature=1.3, top_k=20, top_p=0.9, random_seed=1234)

    def sequence(batch: bool) -> list[int]:
        tokens = []
        for k, logits in enumerate(steps):
            if batch:  # target at row 3, surrounded by other seeded, sampling and greedy rows
                params = [SamplingParams(temperature=0.9, top_k=0)] * 3 + [target] + \
                         [SamplingParams(temperature=0.0), SamplingParams(temperature=2.0, min_p=0.1)]
                seeds = [1, 2, 99, 1234, 5, 6]
                # Neighbours at other step counts too: only the row's own count may matter.
                generated = [k + 7, k, 3, k, 0, 2 * k]
                tokens.append(_run(logits, params, generated=generated, seeds=seeds).token_ids[3])
            else:
                tokens.append(_run(logits[3:4], [target], generated=[k], seeds=[1234]).token_ids[0])
        return tokens

    assert sequence(batch=False) == sequence(batch=True)
    # A different seed gives a different stream (10 draws at temperature 1.3: equal by chance ~never).
    other = [_run(lg[3:4], [target], generated=[k], seeds=[4321]).token_ids[0] for k, lg in enumerate(steps)]
    assert other != sequence(batch=False)


def test_logprobs_are_raw_log_softmax() -> None:
    torch.manual_seed(5)
    logits = torch.randn(3, V)
    params = [SamplingParams(temperature=0.5, top_k=0, logprobs=4),
              SamplingParams(temperature=0.0, logprobs=0), SamplingParams(temperature=0.0)]
    out = _run(logits, params, seeds=[5, 0, 0])
    expected = logits.log_softmax(-1)
    for row, token in enumerate(out.token_ids):
        assert math.isclose(out.logprobs[row], expected[row, token].item(), rel_tol=1e-5, abs_tol=1e-6)
    top = out.top_logprobs
    assert len(top[0]) == 4 and top[1] == [] and top[2] == []
    assert [t for t, _ in top[0]] == expected[0].topk(4).indices.tolist()
    values = [v for _, v in top[0]]
    assert values == sorted(values, reverse=True)
    assert torch.allclose(torch.tensor(values), expected[0].topk(4).values)


def test_mixed_batch_and_input_untouched() -> None:
    torch.manual_seed(6)
    logits = torch.randn(4, V)
    before = logits.clone()
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=2),
              SamplingParams(top_k=1), SamplingParams(temperature=0.8, top_k=0, top_p=0.5)]
    out = _run(logits, params)
    assert out.token_ids[0] == logits[0].argmax().item() and out.token_ids[2] == logits[2].argmax().item()
    assert out.token_ids[1] in logits[1].topk(2).indices.tolist()
    assert 0 <= out.token_ids[3] < V
    assert torch.equal(logits, before)
