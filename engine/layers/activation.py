"""Activation layers: the gate of a gated MLP over a fused ``cat(gate, up)`` projection, and the
plain (non-gated) activation with the two-linear MLP around it (StarCoder2, Falcon)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels import silu_and_mul
from ...kernels.w8a8 import quant_per_token, silu_mul_quant
from ...protocol.errors import UnsupportedModelError
from .linear import LinearMethod, MergedLinear, RowParallelLinear
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


class Activation(nn.Module):
    """A plain activation ``act(x)`` (GELU exact or tanh, ReLU, SiLU), torch ops on every device;
    with ``quantize_output`` the rows are then quantized per token for a W8A8 reader."""

    def __init__(self, fn, quantize_output: bool = False) -> None:
        super().__init__()
        self.fn = fn
        self.quantize_output = quantize_output

    def forward(self, x: torch.Tensor) -> torch.Tensor | Int8Rows:
        """Apply the activation."""
        out = self.fn(x)
        if self.quantize_output:
            q, scale = quant_per_token(out)
            return Int8Rows(q, scale, x.dtype)
        return out


_PLAIN = {
    "gelu": lambda x: F.gelu(x),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}


def activation(name: str, quantize_output: bool = False) -> Activation:
    """The plain activation layer for a ``hidden_act`` name; UnsupportedModelError for others."""
    if name not in _PLAIN:
        raise UnsupportedModelError(f"MLP activation {name!r} is not supported; supported: {sorted(_PLAIN)}")
    return Activation(_PLAIN[name], quantize_output)


class DenseMLP(nn.Module):
    """Non-gated MLP ``down_proj(act(up_proj(x)))`` (StarCoder2's c_fc/c_proj, Falcon's
    dense_h_to_4h/dense_4h_to_h). Under tensor parallel ``up_proj`` keeps this rank's part of
    the intermediate outputs (a one-shard ``MergedLinear``) and ``down_proj`` the matching
    inputs, summed by one all-reduce, as the gated MLP splits."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, act: str, bias: bool,
        up_method: LinearMethod | None = None, down_method: LinearMethod | None = None,
        quantize_act: bool = False,
    ) -> None:
        super().__init__()
        self.up_proj = MergedLinear(hidden_size, [intermediate_size], bias=bias, method=up_method)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, method=down_method)
        self.act = activation(act, quantize_output=quantize_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]."""
        return self.down_proj(self.act(self.up_proj(x)))
