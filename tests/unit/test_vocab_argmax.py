"""The vocab-parallel argmax (engine/layers/vocab_argmax.py) against ``torch.argmax`` on the whole row:
random shards, ties within and across shards, NaN and all -inf rows, padding that would win if it
counted, and a rank holding padding only. The collective is stood in for by the concatenation
``TPGroup.all_gather`` returns (the engine tests in test_tensor_parallel.py run it over gloo)."""

from __future__ import annotations

import pytest
import torch

from conveyor.engine.layers.vocab_argmax import vocab_parallel_argmax


class _Gathered:
    """A rank's view of the group: ``all_gather`` returns every rank's part in rank order, as
    ``TPGroup.all_gather`` does, after checking the caller brought its own."""

    def __init__(self, parts: list[torch.Tensor], rank: int) -> None:
        self.parts, self.rank = parts, rank

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        torch.testing.assert_close(x, self.parts[self.rank], rtol=0, atol=0, equal_nan=True)
        return torch.cat(self.parts, dim=-1)


def _every_rank(logits: torch.Tensor, ranks: int, padding: float) -> list[torch.Tensor]:
    """Each rank's ids from its shard of ``logits`` (rows split as ``LMHead`` splits them: the
    last rank's tail past the vocabulary filled with ``padding``)."""
    from conveyor.engine.layers.vocab_argmax import shard_argmax

    n, vocab = logits.shape
    rows = -(-vocab // ranks)
    padded = torch.full((n, rows * ranks), padding)
    padded[:, :vocab] = logits
    shards = [padded[:, r * rows:(r + 1) * rows] for r in range(ranks)]
    parts = [shard_argmax(shard, r * rows, vocab) for r, shard in enumerate(shards)]
    return [vocab_parallel_argmax(shard, r * rows, vocab, _Gathered(parts, r)) for r, shard in enumerate(shards)]


@pytest.mark.parametrize("vocab, ranks", [(128, 2), (127, 2), (101, 4), (5, 4), (7, 8)])
@pytest.mark.parametrize("padding", [float("inf"), float("nan"), 1e30, 0.0])
def test_every_rank_picks_what_argmax_picks_on_the_whole_row(vocab, ranks, padding) -> None:
    gen = torch.Generator().manual_seed(vocab * 10 + ranks)
    # Values from a handful of levels: most rows tie for their maximum, often across shards.
    logits = torch.randint(-3, 3, (64, vocab), generator=gen).float() * 0.5
    logits[:32] += torch.randn(32, vocab, generator=gen)  # distinct maxima too
    logits[40] = float("-inf")  # all -inf: token 0, as argmax gives
    logits[41, vocab // 2:] = float("-inf")
    logits[42, -1] = float("nan")  # a NaN wins, the first one among several
    logits[43, vocab // 3] = logits[43, -1] = float("nan")
    logits[44] = 7.0  # the maximum everywhere: the lowest index wins
    logits[45, -1] = 99.0  # the last real row, next to the padding
    want = logits.argmax(dim=-1)
    for got in _every_rank(logits, ranks, padding):
        assert got.dtype == torch.int64
        assert torch.equal(got, want)


def test_bfloat16_logits_converted_to_float32_keep_their_ties() -> None:
    """The head's product in bfloat16 (few distinct values, many ties), converted to float32 as the
    sampler's logits are: the same ids as the argmax of the gathered float32 row."""
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(256, 1000, generator=gen) * 3).bfloat16().float()
    for got in _every_rank(logits, 4, float("inf")):
        assert torch.equal(got, logits.argmax(dim=-1))


def test_a_soft_capped_head_takes_its_argmax_after_the_cap(tmp_path) -> None:
    """Gemma 2's cap ``c * tanh(x / c)`` makes large float32 logits equal (tanh rounds to 1): the
    gathered row's argmax is then the lowest of them, not the largest raw logit, and so is the
    vocab-parallel argmax's, which caps each shard first."""
    from test_models import TINY, load_ours, save_tiny
    from transformers import Gemma2Config

    save_tiny(Gemma2Config(**TINY, head_dim=16, final_logit_softcapping=5.0, bos_token_id=1, eos_token_id=2,
                           pad_token_id=0), tmp_path)
    model = load_ours(tmp_path)
    hidden = torch.randn(16, TINY["hidden_size"], generator=torch.Generator().manual_seed(1)) * 1e3
    with torch.no_grad():
        shard = model.head_shard(hidden)
        want = model.compute_logits(hidden).argmax(dim=-1)
        got = model.argmax_from_shard(shard)
    assert torch.equal(got, want)
    assert not torch.equal(shard.float().argmax(dim=-1), want)  # the cap decided some rows
