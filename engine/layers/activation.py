"""Activation layers: the gate of a gated MLP over a fused ``cat(gate, up)`` projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels import silu_and_mul
from ...kernels.w8a8 import quant_per_token, silu_mul_quant
from ...protocol.errors import UnsupportedModelError
from .w8a8_linear import Int8Rows


class SiluAndMul(nn.Module):
    """SwiGLU gate over a fused projection: ``[..., 2*I] = cat(gate, up) -> silu(gate) * up``.

    With ``quantize_output`` (its reader is a W8A8 down projection) the gated rows come out
    quantized per token as ``Int8Rows``, in the same pass (``kernels/w8a8.silu_mul_quant``).
    """

    def __init__(self, quantize_output: bool = False) -> None:
        super().__init__()
        self.quantize_output = quantize_output

    def forward(self, x: torch.Tensor) -> torch.Tensor | Int8Rows:
        """Apply the gate."""
        if self.quantize_output:
            q, scale = silu_mul_quant(x)
            return Int8Rows(q, scale, x.dtype)
        return silu_and_mul(x)


class GeluAndMul(nn.Module):
    """GeGLU gate: ``cat(gate, up) -> gelu(gate) * up``, GELU exact (``approximate="none"``) or
    its tanh form (``"tanh"``: Gemma's ``gelu_pytorch_tanh``). Torch ops on every device (one
    elementwise pass; no kernel of its own). With ``quantize_output`` the gated rows are then
    quantized per token (``kernels/w8a8.quant_per_token``)."""

    def __init__(self, approximate: str = "none", quantize_output: bool = False) -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"approximate={approximate!r}: use 'none' or 'tanh'")
        self.approximate = approximate
        self.quantize_output = quantize_output

    def forward(self, x: torch.Tensor) -> torch.Tensor | Int8Rows:
        """Apply the gate."""
        gate, up = x.chunk(2, dim=-1)
        out = F.gelu(gate, approximate=self.approximate) * up
        if self.quantize_output:
            q, scale = quant_per_token(out)
            return Int8Rows(q, scale, x.dtype)
        return out


# config.json ``hidden_act`` names (transformers' ACT2FN keys) -> the gated layer that runs them.
_GATED: dict[str, tuple[type[nn.Module], dict]] = {
    "silu": (SiluAndMul, {}),
    "swish": (SiluAndMul, {}),
    "gelu": (GeluAndMul, {"approximate": "none"}),
    "gelu_pytorch_tanh": (GeluAndMul, {"approximate": "tanh"}),
    "gelu_new": (GeluAndMul, {"approximate": "tanh"}),
    "gelu_fast": (GeluAndMul, {"approximate": "tanh"}),
}


def act_and_mul(name: str, quantize_output: bool = False) -> nn.Module:
    """The gated-MLP activation layer for a ``hidden_act`` name; UnsupportedModelError for others."""
    if name not in _GATED:
        raise UnsupportedModelError(f"MLP activation {name!r} is not supported; supported: {sorted(_GATED)}")
    cls, kwargs = _GATED[name]
    return cls(quantize_output=quantize_output, **kwargs)
