"""AutoAWQ's "gemm" checkpoint layout of a 4-bit linear layer.

Per linear layer with weight ``[out, in]`` and group size ``G``:

- ``qweight`` int32 ``[in, out / 8]``: the codes transposed to ``[in, out]``, eight output
  columns per int32;
- ``qzeros``  int32 ``[in / G, out / 8]``: the zero points, packed the same way;
- ``scales``  float16 ``[in / G, out]``.

Inside each int32 the eight 4-bit values are interleaved: the nibble at bits ``4i..4i+3`` holds
column ``AWQ_ORDER[i]`` of its eight (``[0, 2, 4, 6, 1, 3, 5, 7]``), as AutoAWQ's
``WQLinear_GEMM.from_linear`` writes them and ``awq/utils/packing_utils.py`` undoes them.
The weight reads back as ``(code - zero) * scale``.

Until ``kernels/w4a16.py`` provides ``awq_pack`` / ``awq_unpack`` / ``dequantize_awq_ref``, these
are the reference; the names and meanings are meant to be the same.
"""

from __future__ import annotations

import torch

from .quantizer import GroupQuantized

BITS = 4
PACK = 32 // BITS
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_MASK = (1 << BITS) - 1


def awq_pack(values: torch.Tensor) -> torch.Tensor:
    """Integers 0..15 ``[rows, cols]`` -> int32 ``[rows, cols / 8]`` in AWQ's interleaved nibble order."""
    rows, cols = values.shape
    if cols % PACK:
        raise ValueError(f"cannot pack {cols} columns: not a multiple of {PACK}")
    v = values.to(torch.int64).view(rows, cols // PACK, PACK)
    if v.min() < 0 or v.max() > _MASK:
        raise ValueError(f"values to pack must lie in 0..{_MASK}")
    packed = torch.zeros(rows, cols // PACK, dtype=torch.int64, device=values.device)
    for i, col in enumerate(AWQ_ORDER):
        packed |= v[..., col] << (BITS * i)
    # Reinterpret the unsigned 32-bit words as int32 (two's complement), as the checkpoint stores them.
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)
    return packed.to(torch.int32)


def awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[rows, cols / 8]`` in AWQ order -> int32 values 0..15 ``[rows, cols]``."""
    rows, words = packed.shape
    p = packed.to(torch.int64) & 0xFFFFFFFF
    out = torch.empty(rows, words, PACK, dtype=torch.int32, device=packed.device)
    for i, col in enumerate(AWQ_ORDER):
        out[..., col] = ((p >> (BITS * i)) & _MASK).to(torch.int32)
    return out.view(rows, words * PACK)


def dequantize_awq_ref(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                       group_size: int) -> torch.Tensor:
    """The float32 weight ``[in, out]`` (gemm orientation) that a packed layer stands for."""
    codes = awq_unpack(qweight).to(torch.float32)
    zeros = awq_unpack(qzeros).to(torch.float32).repeat_interleave(group_size, dim=0)
    return (codes - zeros) * scales.to(torch.float32).repeat_interleave(group_size, dim=0)


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
    return GroupQuantized(awq_unpack(qweight).t().contiguous(), awq_unpack(qzeros).t().contiguous(),
                          scales.t().contiguous().to(torch.float16), group_size)
