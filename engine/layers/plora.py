"""Partial LoRA (InternLM-XComposer2): a low-rank delta added to a linear's output on the image
tokens' rows only.

XComposer2 trains a rank-``r`` adapter ``B·A`` on every linear of its InternLM2 language model
(``wqkv``, ``wo``, ``w1``, ``w2``, ``w3``) and applies it where ``im_mask`` marks an image row;
text rows see the plain linear. Here the adapters sit outside the language model (so its own
loading and its fused projections stay as they are): each is a forward hook on one of its
linears that adds ``scaling · B(A(x))`` to the hook's output at the step's image rows, which a
shared ``ImageRows`` holds for the length of one forward. No image rows (decode steps, text-only
prompts): the hooks return at once.

A fused projection holds its parts' adapters side by side: ``gate_up_proj`` is ``w1`` and ``w3``,
each with its own ``A`` (``lora_a`` stacks them, ``[parts · r, in]``) and ``B`` (``lora_b`` stacks
their rows, ``[sum(out), r]``); ``qkv_proj`` is one adapter (``wqkv``'s) whose ``B`` rows are
put in the fused ``[q | k | v]`` order on loading.
"""

from __future__ import annotations

import torch
from torch import nn


class ImageRows:
    """The current forward's image rows (indices into the step's tokens), or None: no image rows."""

    def __init__(self) -> None:
        self.index: torch.Tensor | None = None

    def set(self, mask: torch.Tensor | None) -> None:
        """From a ``[T]`` bool mask (None or no True: none)."""
        self.index = None if mask is None or not bool(mask.any()) else mask.nonzero().squeeze(1)


class PartialLoRA(nn.Module):
    """The adapters of one (possibly fused) linear: ``parts`` inputs-to-rank maps and their
    rank-to-output maps, whose outputs lie side by side as the linear's do."""

    def __init__(self, in_features: int, out_sizes: list[int], rank: int, scaling: float, rows: ImageRows) -> None:
        super().__init__()
        self.out_sizes, self.rank, self.scaling, self.rows = list(out_sizes), rank, scaling, rows
        self.lora_a = nn.Parameter(torch.empty(len(out_sizes) * rank, in_features))
        self.lora_b = nn.Parameter(torch.empty(sum(out_sizes), rank))

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """[N, in] -> [N, sum(out)]: each part's ``B_i · A_i · x``, scaled."""
        low = (x @ self.lora_a.t()).view(x.shape[0], len(self.out_sizes), self.rank)
        outs = [low[:, i] @ b.t() for i, b in enumerate(self.lora_b.split(self.out_sizes))]
        return torch.cat(outs, dim=-1) * self.scaling

    def hook(self, module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
        """A forward hook on the linear: its output plus the delta at the image rows."""
        index = self.rows.index
        if index is None:
            return output
        x = inputs[0]
        return output.index_add(0, index, self.delta(x.index_select(0, index)).to(output.dtype))

    def attach(self, linear: nn.Module) -> None:
        linear.register_forward_hook(self.hook)
