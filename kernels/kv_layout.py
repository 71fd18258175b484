"""What a paged KV cache stores per token and KV head under each ``quant_policy``: the tensors a
policy allocates, the bytes a token costs, and whether its keys are centred (``kv_cache``'s module
doc explains the quantization and the key centres; this module only says how they are laid out).

Torch only, no Triton: the model runner sizes the cache from it before any kernel runs.
"""

from dataclasses import dataclass

import torch

QUANT_POLICIES = (0, 4, 8)
"""LMDeploy's ``quant_policy`` values: 0 (the model's dtype), 4 (int4 KV) and 8 (int8 KV)."""
SCALE_DTYPE = torch.float16  # of the (scale, zero) pairs and of the key centres
CENTRE_TOKENS = 64
"""A sequence's key centre averages its first chunk's keys over positions 1 .. CENTRE_TOKENS - 1."""
CENTRE_GROUP = 16
"""Keys at positions ``[16 g, 16 g + 16)`` share one rotated centre, turned to position 16 g + 8."""


def turned_centres(bits: int) -> bool:
    """Whether a cache of ``bits`` centres keys by their sequence's mean key turned to each key's
    position (int4), or by one constant vector (int8: its error is small enough without, and the
    turned centre's scores cost the attention kernels ~10 % of ShareGPT throughput)."""
    return bits == 4


@dataclass(frozen=True)
class KVCacheLayout:
    """What a cache of ``quant_policy`` stores per token and KV head of ``head_dim`` values."""

    quant_policy: int
    head_dim: int

    def __post_init__(self) -> None:
        if self.quant_policy not in QUANT_POLICIES:
            raise ValueError(f"quant_policy={self.quant_policy}: use 0 (none), 4 (int4 KV) or 8 (int8 KV)")
        if self.quant_policy and self.head_dim % 2:
            raise ValueError(
                f"quant_policy={self.quant_policy} needs an even head_dim (codes are laid out in two halves); "
                f"this model has head_dim {self.head_dim}: use quant_policy=0")

    @property
    def bits(self) -> int:
        """Bits per stored code: 8 or 4, and 0 for an unquantized cache."""
        return self.quant_policy

    @property
    def code_dim(self) -> int:
        """Last dimension of the code tensor: D, or D // 2 for int4 (two codes per byte)."""
        return self.head_dim // 2 if self.quant_policy == 4 else self.head_dim

    def code_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.uint8 if self.quant_policy else dtype

    def bytes_per_head(self, dtype: torch.dtype) -> int:
        """Bytes one token's key (or value) head takes: codes plus its (scale, zero) pair."""
        codes = self.code_dim * torch.tensor([], dtype=self.code_dtype(dtype)).element_size()
        return codes + (2 * SCALE_DTYPE.itemsize if self.quant_policy else 0)

    def centre_bytes_per_head(self) -> int:
        """Bytes one key centre row takes per layer and kv head (0 when unquantized): its two
        vectors (``KeyCentring``)."""
        return 2 * self.head_dim * SCALE_DTYPE.itemsize if self.quant_policy else 0

    def allocate_centres(self, layers: int, rows: int, num_kv_heads: int,
                         device: torch.device | str) -> torch.Tensor | None:
        """The key centre tables (the module doc), zeros [layers, rows, 2, num_kv_heads, head_dim]
        (``KeyCentring.table``: the last row is the zero one); None when unquantized."""
        if not self.quant_policy:
            return None
        return torch.zeros((layers, rows, 2, num_kv_heads, self.head_dim), dtype=SCALE_DTYPE, device=device)

    def allocate(self, lead: tuple[int, ...], dtype: torch.dtype, device: torch.device | str,
                 alloc=torch.zeros) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One cache (keys or values) of shape ``lead + (code_dim,)`` and its scales
        ``lead + (2,)`` (None when unquantized)."""
        codes = alloc((*lead, self.code_dim), dtype=self.code_dtype(dtype), device=device)
        scales = alloc((*lead, 2), dtype=SCALE_DTYPE, device=device) if self.quant_policy else None
        return codes, scales
