"""Greedy decoding's argmax over a vocabulary split by tensor parallel, without gathering the logits.

Each rank holds the logits of its own rows of the vocabulary (``LMHead``: rank ``r`` has rows
``[r * rows, (r + 1) * rows)``, the last rank's tail past the vocabulary being padding). Rather
than all-gathering ``[N, vocab]`` logits for rank 0 to take their argmax and broadcast the ids,
each rank takes the argmax of its shard, the ranks all-gather one (value, global index) pair per
row, and every rank picks the same winner: a ``[N, 2 * tp]`` exchange instead of ``[N, vocab]``
and a broadcast.

The winner is the one ``torch.argmax`` picks on the whole row, bit for bit: the largest value,
and among equal values the lowest index (a NaN counts as the largest, as it does there).
"""

from __future__ import annotations

import torch

from ..distributed import TPGroup


def shard_argmax(logits: torch.Tensor, start: int, vocab_size: int) -> torch.Tensor:
    """[N, rows] logits of the vocabulary rows from ``start`` -> [N, 2] float64: each row's
    largest value and its index in the whole vocabulary. Rows at or past ``vocab_size`` (the
    last rank's padding) never count."""
    valid = min(max(vocab_size - start, 0), logits.shape[1])
    if valid == 0:
        # A shard of padding only (a tiny vocabulary over many ranks): -inf loses to, or ties
        # with and then yields to, rank 0's pair, which always holds a real row.
        logits = logits.new_full((logits.shape[0], 1), float("-inf"))
    elif valid < logits.shape[1]:
        logits = logits[:, :valid]
    index = logits.argmax(dim=-1, keepdim=True)
    value = logits.gather(1, index)
    # float64 holds a float32 value and any vocabulary index exactly, so one tensor (one
    # collective) carries both.
    return torch.cat([value.double(), (index + start).double()], dim=1)


def combine_shard_argmax(pairs: torch.Tensor) -> torch.Tensor:
    """[N, R, 2] every rank's (value, index) pairs, in rank order -> [N] int64 winning indices.

    ``argmax`` over the ranks takes the largest value and, among equal ones (or NaNs), the first
    rank; rank ``r``'s indices all precede rank ``r + 1``'s, so the first rank holds the lowest
    index: the rule of ``argmax`` on the whole row."""
    winner = pairs[..., 0].argmax(dim=1, keepdim=True)
    return pairs[..., 1].gather(1, winner).squeeze(1).long()


def vocab_parallel_argmax(logits: torch.Tensor, start: int, vocab_size: int, tp: TPGroup) -> torch.Tensor:
    """[N, rows] this rank's logits (rows from ``start``) -> [N] int64: the argmax over the whole
    vocabulary, the same on every rank. A collective: every rank of ``tp`` must call it."""
    pairs = tp.all_gather(shard_argmax(logits, start, vocab_size))  # [N, 2 * R], rank order
    return combine_shard_argmax(pairs.unflatten(1, (-1, 2)))
