"""AutoAWQ's "GEMM" packing of 4-bit weights (the package doc describes the layout): pack and
unpack, and the shape check of a (qweight, qzeros, scales) triple. Plain torch."""

import torch

from .._triton import cdiv

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""Nibble ``i`` (bits ``4i .. 4i+3``) of a packed int32 holds column ``AWQ_PACK_ORDER[i]`` of its 8."""
AWQ_NIBBLE_OF_COLUMN = (0, 4, 1, 5, 2, 6, 3, 7)
"""Column ``j`` of a packed int32's 8 sits at nibble ``AWQ_NIBBLE_OF_COLUMN[j]`` (the inverse)."""
PACK = 8  # 4-bit values per int32


def awq_pack(intweight: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit integers [R, N] (values 0..15, N a multiple of 8) into AWQ's int32 [R, N // 8]."""
    if intweight.dim() != 2:
        raise ValueError(f"awq_pack takes a 2-D [rows, N] tensor, got shape {tuple(intweight.shape)}")
    rows, n = intweight.shape
    if n % PACK:
        raise ValueError(f"N = {n} is not a multiple of 8: AWQ packs 8 four-bit columns per int32")
    if intweight.is_floating_point() or intweight.is_complex():
        raise ValueError(f"awq_pack takes integers, got {intweight.dtype}")
    w = intweight.to(torch.int64)
    if w.numel() and (int(w.min()) < 0 or int(w.max()) > 15):
        raise ValueError(f"4-bit values must lie in 0..15, got {int(w.min())}..{int(w.max())}")
    nibbles = w.view(rows, n // PACK, PACK)[:, :, list(AWQ_PACK_ORDER)]  # nibble i <- column ORDER[i]
    shifts = torch.arange(0, 32, 4, device=w.device, dtype=torch.int64)
    packed = (nibbles << shifts).sum(-1)  # 0 .. 2**32 - 1
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """Unpack AWQ's int32 [R, C] into the 4-bit integers [R, 8 * C] (uint8, natural column order)."""
    if packed.dim() != 2 or packed.dtype != torch.int32:
        raise ValueError(f"awq_unpack takes a 2-D int32 tensor, got {packed.dtype} {tuple(packed.shape)}")
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # [R, C, 8] in nibble order
    cols = nibbles[:, :, list(AWQ_NIBBLE_OF_COLUMN)]  # column j <- nibble NIBBLE_OF_COLUMN[j]
    return cols.reshape(packed.shape[0], -1).to(torch.uint8)


def check_awq_shapes(
    k: int, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
    bias: torch.Tensor | None = None,
) -> tuple[int, int]:
    """Validate an AWQ triple for ``K = k`` input features; return ``(N, group_size)`` with
    ``group_size = -1`` (one group, AutoAWQ's per-channel setting) resolved to ``K``."""
    if scales.dim() != 2:
        raise ValueError(f"scales must be [G, N], got shape {tuple(scales.shape)}")
    n = scales.shape[1]
    if n % PACK:
        raise ValueError(f"N = {n} is not a multiple of 8: AWQ packs 8 four-bit columns per int32")
    if group_size == -1:
        group_size = k
    if group_size <= 0:
        raise ValueError(f"group_size must be positive (or -1 for one group), got {group_size}")
    groups = cdiv(k, group_size)
    if qweight.dtype != torch.int32 or tuple(qweight.shape) != (k, n // PACK):
        raise ValueError(f"qweight must be int32 [K, N // 8] = [{k}, {n // PACK}], "
                         f"got {qweight.dtype} {tuple(qweight.shape)}")
    if qzeros.dtype != torch.int32 or tuple(qzeros.shape) != (groups, n // PACK):
        raise ValueError(f"qzeros must be int32 [ceil(K / group_size), N // 8] = [{groups}, {n // PACK}], "
                         f"got {qzeros.dtype} {tuple(qzeros.shape)}")
    if scales.shape[0] != groups:
        raise ValueError(f"scales must be [ceil(K / group_size), N] = [{groups}, {n}] for K = {k}, "
                         f"group_size = {group_size}, got {tuple(scales.shape)}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must be [N] = [{n}], got {tuple(bias.shape)}")
    return n, group_size
