"""W8A8 linear layers: int8 weights per output channel, int8 activations per token (SmoothQuant).

Parameters, as compressed-tensors' "int-quantized" checkpoints (llm-compressor, and
``conveyor lite smooth_quant``) store them: ``weight`` int8 [out, in] and ``weight_scale``
[out, 1] (any float dtype in the file; kept in float32 here), with ``w ≈ weight * weight_scale``.
Fused layers stack shards along dim 0 as dense weights do.

An input arrives either as a float tensor, quantized per token here (``quant_per_token``), or
already quantized as ``Int8Rows``: the RMSNorm before q/k/v and gate/up hands its output over
that way (``kernels/w8a8.rms_norm_quant``: norm and quantization in one pass, the normed row
never written in 16 bits). On the GPU the product is the Triton int8 GEMM with both scales in its
epilogue. On the CPU the int8 codes are multiplied as float32 (every code and partial sum is
an integer well inside float32's exact range for one product; the sums round only past 2**24,
a relative 6e-8), with the weight converted once.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from ...kernels.w8a8 import QMAX, int8_matmul, quant_per_token


class Int8Rows(NamedTuple):
    """Activations quantized per token: ``x ≈ q * scale`` (``q`` int8 [M, K], ``scale`` float32 [M, 1]),
    and ``dtype``, the float type the layer that reads them returns."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


class W8A8LinearMethod:
    """Symmetric int8 weights (one scale per output channel) times per-token int8 activations."""

    # RMSNorms that feed only layers of this method hand their output over as Int8Rows.
    takes_int8_input = True

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, bias: bool) -> None:
        """Register ``weight`` (int8), ``weight_scale`` (float32 [out, 1]) and optional ``bias``."""
        layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=torch.int8), requires_grad=False)
        layer.weight.input_dim = 1
        layer.weight_scale = nn.Parameter(torch.empty(output_size, 1, dtype=torch.float32), requires_grad=False)
        layer.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None
        layer.float_weight_cpu = None  # the CPU path's float32 copy of the codes, made on first use

    def apply(self, layer: nn.Module, x: torch.Tensor | Int8Rows) -> torch.Tensor:
        """``x @ (weight * weight_scale).T + b`` with ``x`` quantized per token (if it is not already)."""
        if isinstance(x, Int8Rows):
            xq, x_scale, out_dtype, lead = x.q, x.scale, x.dtype, x.q.shape[:-1]
        else:
            lead, out_dtype = x.shape[:-1], x.dtype
            xq, x_scale = quant_per_token(x)
        if xq.device.type == "cpu":
            out = self._cpu(layer, xq, x_scale, out_dtype)
        else:
            out = int8_matmul(xq, x_scale, layer.weight, layer.weight_scale, layer.bias, out_dtype)
        return out.view(*lead, out.shape[-1])

    @staticmethod
    def _cpu(layer: nn.Module, xq: torch.Tensor, x_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        if layer.float_weight_cpu is None:
            layer.float_weight_cpu = layer.weight.float().t().contiguous()
        out = (xq.reshape(-1, xq.shape[-1]).float() @ layer.float_weight_cpu) * x_scale.reshape(-1, 1)
        out = out * layer.weight_scale.reshape(1, -1)
        if layer.bias is not None:
            out = out + layer.bias.float()
        return out.to(out_dtype)

    def init_dummy(self, layer: nn.Module, generator: torch.Generator) -> None:
        """Random weights whose values are ~N(0, 0.02)-sized, as the dense dummy init's: uniform codes
        in ±127 (std ~73.3) times 0.02 / 73.3."""
        layer.weight.copy_(torch.randint(-QMAX, QMAX + 1, layer.weight.shape, generator=generator,
                                         device=layer.weight.device, dtype=torch.int8))
        layer.weight_scale.fill_(0.02 / 73.3)
        if layer.bias is not None:
            layer.bias.zero_()
        layer.float_weight_cpu = None
