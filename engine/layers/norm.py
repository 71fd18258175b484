"""RMSNorm layer, optionally fused with the residual add that precedes it.

A norm whose every reader is a W8A8 linear (``quantize_output``) returns its output quantized
per token as ``Int8Rows`` (``kernels/w8a8.rms_norm_quant``: one pass, no 16-bit normed row).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from ...kernels import add_rms_norm, rms_norm
from ...kernels.w8a8 import rms_norm_quant
from ..peer_all_reduce import PartialSum
from ..weight_loader import materialize
from .w8a8_linear import Int8Rows


@torch.no_grad()
def load_offset_scale(param: nn.Parameter, loaded: torch.Tensor, shard_id=None, *, offset: float) -> None:
    """Copy a checkpoint scale stored minus ``offset`` into ``param``, adding it back in float32."""
    if shard_id is not None:
        raise ValueError(f"a norm scale is not fused; got shard {shard_id!r}")
    loaded = materialize(loaded)
    if tuple(loaded.shape) != tuple(param.shape):
        raise ValueError(f"checkpoint tensor for a norm scale has shape {tuple(loaded.shape)}, "
                         f"expected {tuple(param.shape)}")
    param.data.copy_(loaded.to(torch.float32) + offset)


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale (Llama's ``LlamaRMSNorm``).

    ``weight_offset`` is for checkpoints that store the scale minus a constant: Gemma's norms
    multiply by ``(1 + weight)``. The offset is added once, when the checkpoint tensor is loaded,
    so the forward (and its fused kernels) is the plain norm; the parameter holds the true scale.
    """

    def __init__(
        self, hidden_size: int, eps: float = 1e-6, quantize_output: bool = False, weight_offset: float = 0.0
    ) -> None:
        super().__init__()
        self.eps = eps
        self.quantize_output = quantize_output
        self.weight_offset = weight_offset
        self.weight = nn.Parameter(torch.ones(hidden_size))
        if weight_offset:
            self.weight.weight_loader = partial(load_offset_scale, offset=weight_offset)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | Int8Rows | tuple[torch.Tensor | Int8Rows, torch.Tensor]:
        """``norm(x)``; with ``residual``, ``(norm(x + residual), x + residual)``. ``x`` may be a
        row-parallel linear's ``PartialSum`` (tensor parallel's "fused" all-reduce): the ranks'
        parts are summed in the same kernel as the add and the norm."""
        if isinstance(x, PartialSum):
            if residual is not None and not self.quantize_output:
                return x.reducer.add_rms_norm(x, residual, self.weight, self.eps)
            x = x.total()
        if self.quantize_output:
            if residual is None:
                q, scale = rms_norm_quant(x, self.weight, self.eps)
                return Int8Rows(q, scale, x.dtype)
            q, scale, residual = rms_norm_quant(x, self.weight, self.eps, residual)
            return Int8Rows(q, scale, x.dtype), residual
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)
