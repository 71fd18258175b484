"""Asymmetric per-group round-to-nearest quantization of a linear weight (AWQ's zero-point scheme).

A weight ``[out, in]`` is cut into groups of ``group_size`` consecutive input channels per
output row. Each group gets ``scale = (max - min) / (2**bits - 1)`` and an integer zero point,
``code = clamp(round(w / scale) + zero, 0, 2**bits - 1)``, and reads back as
``(code - zero) * scale``. The range always includes 0 (GPTQ's choice; AutoAWQ omits it, which
clips groups whose values all have one sign). Scales are rounded to float16 before the codes are
computed, because the checkpoint stores them in float16: the values this module dequantizes are
exactly the ones a W4A16 kernel will see.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MIN_SCALE = 1e-5  # an all-equal group must not divide by zero (AutoAWQ's floor)


@dataclass(frozen=True)
class GroupQuantized:
    """A weight ``[out, in]`` as ``codes`` (int32, 0..2**bits-1), ``zeros`` and float16 ``scales`` ``[out, in/G]``."""

    codes: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    group_size: int

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight ``[out, in]`` these codes stand for."""
        out, inp = self.codes.shape
        codes = self.codes.view(out, inp // self.group_size, self.group_size).to(torch.float32)
        zeros = self.zeros.to(torch.float32).unsqueeze(-1)
        scales = self.scales.to(torch.float32).unsqueeze(-1)
        return ((codes - zeros) * scales).view(out, inp).to(dtype)


def _grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    if w.dim() != 2 or w.shape[1] % group_size:
        raise ValueError(f"weight of shape {tuple(w.shape)} cannot be cut into groups of {group_size} input channels")
    return w.reshape(w.shape[0], w.shape[1] // group_size, group_size)


def quantize(w: torch.Tensor, bits: int, group_size: int) -> GroupQuantized:
    """Round-to-nearest codes, zero points and float16 scales of ``w`` ``[out, in]``."""
    max_int = 2**bits - 1
    g = _grouped(w.to(torch.float32), group_size)
    lo = g.amin(dim=-1).clamp(max=0)
    hi = g.amax(dim=-1).clamp(min=0)
    scales = ((hi - lo).clamp(min=_MIN_SCALE) / max_int).to(torch.float16)
    if not torch.isfinite(scales).all():
        raise ValueError("weight values too large for float16 scales (|w| above ~1e6)")
    s = scales.to(torch.float32)
    zeros = (-torch.round(lo / s)).clamp(0, max_int)
    codes = (torch.round(g / s.unsqueeze(-1)) + zeros.unsqueeze(-1)).clamp(0, max_int)
    return GroupQuantized(codes.view_as(w).to(torch.int32), zeros.to(torch.int32), scales, group_size)


def fake_quantize(w: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """``w`` after quantizing and dequantizing, in ``w``'s dtype."""
    return quantize(w, bits, group_size).dequantize(w.dtype)
