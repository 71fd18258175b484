"""AutoAWQ's "gemm" checkpoint layout of a 4-bit linear layer.

Per linear layer with weight ``[out, in]`` and group size ``G``:

- ``qweight`` int32 ``[in, out / 8]``: the codes transposed to ``[in, out]``, eight output
  columns per int32;
- ``qzeros``  int32 ``[in / G, out / 8]``: the zero points, packed the same way;
- ``scales``  float16 ``[in / G, out]``.

Inside each int32 the eight 4-bit values are interleaved: the nibble at bits ``4i..4i+3`` holds
column ``[0, 2, 4, 6, 1, 3, 5, 7][i]`` of its eight, as AutoAWQ's
``WQLinear_GEMM.from_linear`` writes them and ``awq/utils/packing_utils.py`` undoes them.
The weight reads back as ``(code - zero) * scale``.

The packing itself (``awq_pack`` / ``awq_unpack`` / ``dequantize_awq_ref``) is the W4A16
kernels' reference in ``kernels/w4a16.py``, so the tool writes exactly what the engine reads;
this module converts between it and ``quantizer.GroupQuantized``.
"""

from __future__ import annotations

import torch

from ...kernels.w4a16 import awq_pack, awq_unpack, dequantize_awq_ref
from .quantizer import GroupQuantized

__all__ = ["awq_pack", "awq_unpack", "dequantize_awq_ref", "pack_linear", "unpack_linear"]


def pack_linear(q: GroupQuantized) -> dict[str, torch.Tensor]:
    """``qweight`` / ``qzeros`` / ``scales`` tensors of one quantized linear layer."""
    return {
        "qweight": awq_pack(q.codes.t().contiguous()),
        "qzeros": awq_pack(q.zeros.t().contiguous()),
        "scales": q.scales.t().contiguous().to(torch.float16),
    }


def unpack_linear(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                  group_size: int) -> GroupQuantized:
    """The inverse of ``pack_linear``."""
    return GroupQuantized(awq_unpack(qweight).t().contiguous().to(torch.int32),
                          awq_unpack(qzeros).t().contiguous().to(torch.int32),
                          scales.t().contiguous().to(torch.float16), group_size)
