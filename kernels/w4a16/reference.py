"""The plain-torch reference of the W4A16 product: the dense weight ``(q - z) * s`` and ``x @ W``,
computed in fp32 (used on CPU and in tests)."""

import torch

from .packing import awq_unpack, check_awq_shapes


def dequantize_awq_ref(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The dense weight [K, N] = (q - z) * s of an AWQ triple (computed in fp32, where it is exact)."""
    k = qweight.shape[0]
    _, group_size = check_awq_shapes(k, qweight, qzeros, scales, group_size)
    group_of_row = torch.arange(k, device=qweight.device) // group_size
    q = awq_unpack(qweight).float()
    z = awq_unpack(qzeros).float()[group_of_row]
    s = scales.float()[group_of_row]
    return ((q - z) * s).to(dtype)


def w4a16_matmul_ref(
    x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x [..., K] @ W + bias`` -> [..., N] in x's dtype, computed in fp32 from the dense weight."""
    w = dequantize_awq_ref(qweight, qzeros, scales, group_size)
    out = x.float() @ w
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
