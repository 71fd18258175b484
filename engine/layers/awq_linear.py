"""W4A16 linear layers on AWQ weights, in AutoAWQ's "gemm" layout as checkpoints store them.

Parameters (``kernels/w4a16.py`` documents the layout): ``qweight`` int32 [K, N / 8],
``qzeros`` int32 [G, N / 8], ``scales`` [G, N], G = ceil(K / group_size). The output dimension is
the last one, and ``qweight``/``qzeros`` pack 8 outputs per int32, so a fused layer's shard
``i`` fills columns ``[start / 8, (start + size) / 8)`` of the packed tensors (``output_dim``
and ``pack_factor`` tell ``MergedLinear.weight_loader`` so).

On the GPU, fp16 layers whose shapes the tensor-core kernels take (``kernels/w4a16/tc.py``:
K and N multiples of 64, groups of 64 or more) are repacked once after loading into those
kernels' layout (``after_loading``; the AWQ tensors are then dropped, so the weight is held once)
when cupy is installed and the kernel mode is ``auto``; the others run the Triton W4A16 kernels
(no dense weight is ever written for small batches). On the CPU the reference path would
dequantize every weight on every call; it dequantizes once and keeps the dense fp32 weight
instead (the CPU runs the engine for tests, not for speed).
"""

from __future__ import annotations

import torch
from torch import nn

from ...kernels._cuda import cuda_kernels_available
from ...kernels.w4a16 import PACK, dequantize_awq_ref, w4a16_matmul
from ...kernels.w4a16.tc import tc_builds, tc_matmul, tc_problem, tc_repack

AWQ_PACK_FACTOR = PACK


class AWQLinearMethod:
    """Group-wise 4-bit weights with zero points; activations stay in 16 bits."""

    def __init__(self, group_size: int):
        self.group_size = group_size

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, bias: bool) -> None:
        """Register ``qweight``, ``qzeros``, ``scales`` (and ``bias``) in the checkpoint's shapes."""
        if output_size % AWQ_PACK_FACTOR:
            raise ValueError(f"AWQ packs 8 outputs per int32; this layer has {output_size} outputs")
        group = input_size if self.group_size == -1 else self.group_size
        groups = -(-input_size // group)
        packed = output_size // AWQ_PACK_FACTOR

        def param(*shape: int, dtype: torch.dtype | None = None, packed_cols: bool, rows_per: int) -> nn.Parameter:
            p = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
            p.output_dim, p.pack_factor = 1, AWQ_PACK_FACTOR if packed_cols else 1
            p.input_dim, p.input_group = 0, rows_per  # a row per input, or per group of inputs
            return p

        layer.qweight = param(input_size, packed, dtype=torch.int32, packed_cols=True, rows_per=1)
        layer.qzeros = param(groups, packed, dtype=torch.int32, packed_cols=True, rows_per=group)
        layer.scales = param(groups, output_size, packed_cols=False, rows_per=group)  # the model's dtype
        layer.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None
        layer.dense_cpu = None  # the CPU path's dequantized weight, made on first use
        layer.tc = None  # the tensor-core layout (TcWeights), made by after_loading

    def after_loading(self, layer: nn.Module) -> None:
        """Repack the weight for the tensor-core kernels where they run (see the module doc)."""
        if layer.tc is not None:
            return
        k, n = layer.qweight.shape[0], layer.scales.shape[1]
        group = k if self.group_size == -1 else self.group_size
        device = layer.qweight.device
        if not cuda_kernels_available(device) or tc_problem(k, n, group, layer.scales.dtype) or not tc_builds(device):
            return
        layer.tc = tc_repack(layer.qweight, layer.qzeros, layer.scales, self.group_size)
        # The AWQ tensors are not used again: empty ones keep the attributes (and dtypes) in place.
        layer.qweight = nn.Parameter(layer.qweight.new_empty(0, n // AWQ_PACK_FACTOR), requires_grad=False)
        layer.qzeros = nn.Parameter(layer.qzeros.new_empty(0, n // AWQ_PACK_FACTOR), requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``x @ W + b`` from the packed weight."""
        if layer.tc is not None:
            return tc_matmul(x, layer.tc, layer.bias)
        if x.device.type == "cpu":
            if layer.dense_cpu is None:
                layer.dense_cpu = dequantize_awq_ref(layer.qweight, layer.qzeros, layer.scales, self.group_size)
            out = x.float() @ layer.dense_cpu
            if layer.bias is not None:
                out = out + layer.bias.float()
            return out.to(x.dtype)
        return w4a16_matmul(x, layer.qweight, layer.qzeros, layer.scales, self.group_size, layer.bias)

    def init_dummy(self, layer: nn.Module, generator: torch.Generator) -> None:
        """Random weights whose dequantized values are ~N(0, 0.02)-sized, as the dense dummy
        init's: uniform 4-bit codes about a zero point of 8 (std ~4.6), times 0.02 / 4.6."""
        layer.qweight.copy_(torch.randint(-2**31, 2**31 - 1, layer.qweight.shape, generator=generator,
                                          device=layer.qweight.device, dtype=torch.int64).to(torch.int32))
        layer.qzeros.fill_(0x88888888 - 2**32)  # every nibble 8
        layer.scales.fill_(0.02 / 4.6)
        if layer.bias is not None:
            layer.bias.zero_()
        layer.dense_cpu = layer.tc = None
