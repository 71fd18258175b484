"""Token embedding and the LM head (which may share the embedding's weight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels.gemv import linear


class VocabEmbedding(nn.Module):
    """Token id -> hidden vector lookup table ``[vocab, hidden]``."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, hidden]."""
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """Hidden -> vocabulary logits, run only on the rows the caller selects (e.g. each sequence's last).

    With ``tie_to`` the head reuses that embedding's Parameter, so it is loaded once and appears
    once in ``named_parameters()`` (under the embedding's name).
    """

    def __init__(self, vocab_size: int, hidden_size: int, tie_to: VocabEmbedding | None = None) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tied = tie_to is not None
        self.weight = tie_to.weight if tie_to is not None else nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 (samplers want full-precision logits)."""
        return linear(hidden_rows, self.weight).float()
