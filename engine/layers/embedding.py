"""Token embedding and the LM head (which may share the embedding's weight), split by vocabulary
over the tensor-parallel ranks.

Each rank keeps ``ceil(vocab / tp)`` rows (the last rank's tail past the vocabulary is zeros). The
embedding looks up the ids that fall in its rows, zeros the others and all-reduces; the LM head
computes its rows' logits and all-gathers them, so every rank holds the whole ``[N, vocab]``, or,
for a greedy step, takes their argmax with the other ranks' without gathering them
(``vocab_argmax.py``). With one rank both are the plain lookup and product.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels.gemv import linear
from ..distributed import tp_group
from ..weight_loader import narrow
from .vocab_argmax import vocab_parallel_argmax


class VocabEmbedding(nn.Module):
    """Token id -> hidden vector lookup table ``[vocab, hidden]`` (this rank's rows of it)."""

    def __init__(
        self, vocab_size: int, hidden_size: int, shared: nn.Parameter | None = None, scale: float = 1.0
    ) -> None:
        super().__init__()
        tp = tp_group()
        self.vocab_size = vocab_size
        # Multiplies every looked-up row (Gemma scales its embeddings by sqrt(hidden)); the
        # product is taken in the table's dtype, as Hugging Face does.
        self.scale = scale
        self.rows = -(-vocab_size // tp.size)  # per rank
        self.start = tp.rank * self.rows
        if shared is not None:  # another table's rows, split alike (a tied LM head)
            self.weight = shared
        else:
            self.weight = nn.Parameter(torch.empty(self.rows, hidden_size))
            self.weight.weight_loader = self.weight_loader

    @torch.no_grad()
    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """Copy this rank's rows of a ``[vocab, hidden]`` checkpoint tensor (zeros past the vocabulary)."""
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} is not fused; got shard {shard_id!r}")
        if tuple(loaded.shape) != (self.vocab_size, param.shape[1]):
            raise ValueError(f"checkpoint tensor for the vocabulary has shape {tuple(loaded.shape)}, expected "
                             f"{(self.vocab_size, param.shape[1])}")
        n = max(min(self.rows, self.vocab_size - self.start), 0)
        param.data[n:].zero_()
        param.data[:n].copy_(narrow(loaded, 0, self.start, n))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, hidden]."""
        tp = tp_group()
        if not tp.active:
            out = F.embedding(input_ids, self.weight)
        else:
            local = input_ids - self.start
            mine = (local >= 0) & (local < self.rows)
            out = F.embedding(torch.where(mine, local, 0), self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
            out = tp.all_reduce(out)
        if self.scale != 1.0:
            out = out * torch.tensor(self.scale, dtype=out.dtype)
        return out


class LMHead(VocabEmbedding):
    """Hidden -> vocabulary logits, run only on the rows the caller selects (e.g. each sequence's last).

    With ``tie_to`` the head reuses that embedding's Parameter, so it is loaded once and appears
    once in ``named_parameters()`` (under the embedding's name). Its rows are split as the
    embedding's.
    """

    def __init__(self, vocab_size: int, hidden_size: int, tie_to: VocabEmbedding | None = None) -> None:
        super().__init__(vocab_size, hidden_size, shared=tie_to.weight if tie_to is not None else None)
        self.tied = tie_to is not None

    def forward(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 (samplers want full-precision logits)."""
        return self.gather(self.shard(hidden_rows))

    def shard(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, rows]: this rank's rows of the logits, in the weight's dtype (the
        whole vocabulary with one rank)."""
        return linear(hidden_rows, self.weight)

    def gather(self, shard: torch.Tensor) -> torch.Tensor:
        """[N, rows] of ``shard`` on every rank -> [N, vocab] float32, padding dropped. Gathered
        before the conversion: the collective moves the weight's dtype, half float32's bytes."""
        tp = tp_group()
        if tp.active:
            shard = tp.all_gather(shard)[:, : self.vocab_size]
        return shard.float()

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """[N, rows] this rank's float32 logits -> [N] int64: the argmax of the rows that
        ``gather`` would give, the same on every rank, exchanging one pair per row instead."""
        return vocab_parallel_argmax(logits, self.start, self.vocab_size, tp_group())
