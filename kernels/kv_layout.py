"""What a paged KV cache stores per token and KV head under each ``quant_policy``: the tensors a
policy allocates, the bytes a token costs, and whether its keys are centred (``kv_cache``'s module
doc explains the quantization and the key centres; this module only says how they are laid out).

It is also the one place that knows what the centres ask of the engine, answered as neutral
questions (``min_first_chunk_tokens``, ``reserved_head_blocks``): the scheduler and the block
manager take those answers as plain ints from the engine, so they neither import torch nor know
why a layout asks.

``KVCacheSpec`` is the model's side of it: how many kv heads a layer's cache holds per token and
how wide their keys and values are (MLA's latent cache: one head whose values are its keys' first
columns, no value cache of its own).

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
CENTRE_ROWS_PER_SEQUENCE = 2
"""Key centre rows, hence reserved head blocks, per sequence of the largest batch (why so few:
``kv_cache``'s module doc)."""


def turned_centres(bits: int) -> bool:
    """Whether a cache of ``bits`` centres keys by their sequence's mean key turned to each key's
    position (int4), or by one constant vector (int8: its error is small enough without, and the
    turned centre's scores cost the attention kernels ~10 % of ShareGPT throughput)."""
    return bits == 4


@dataclass(frozen=True)
class KVCacheSpec:
    """A model's cache geometry per layer and token: ``num_kv_heads`` heads (the whole model's;
    tensor parallel splits them, ``distributed.kv_head_range``) of ``k_dim`` key values and
    ``v_dim`` value values. With ``shares_v`` there is no value cache: the values are each key
    head's first ``v_dim`` values, read through a view of the key cache (multi-head latent
    attention caches one latent row, ``[c_kv, k_pe]``, and attends with ``c_kv`` as the values).
    Dense attention's default: ``KVCacheSpec(num_kv_heads, head_dim, head_dim)``."""

    num_kv_heads: int
    k_dim: int
    v_dim: int
    shares_v: bool = False

    def __post_init__(self) -> None:
        if self.shares_v and self.v_dim > self.k_dim:
            raise ValueError(f"shared values ({self.v_dim} wide) must fit in the keys ({self.k_dim} wide)")

    def layouts(self, quant_policy: int) -> tuple["KVCacheLayout", "KVCacheLayout | None"]:
        """The key cache's layout under ``quant_policy`` and the value cache's (None: the values
        are a view of the keys). ValueError for a policy this geometry has no layout for."""
        if quant_policy and (self.shares_v or self.k_dim != self.v_dim):
            # The quantizer stores a key and a value of one width each in caches of their own
            # (codes, scales, key centres): a latent row has no such layout yet.
            what = (f"one latent row a token ({self.k_dim} values, the first {self.v_dim} also the values)"
                    if self.shares_v else f"keys {self.k_dim} and values {self.v_dim} wide")
            raise ValueError(f"quant_policy={quant_policy}: this model's KV cache holds {what}, which the "
                             "int8/int4 KV cache cannot hold yet: use quant_policy=0")
        keys = KVCacheLayout(quant_policy, self.k_dim)
        return keys, None if self.shares_v else KVCacheLayout(quant_policy, self.v_dim)


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

    @property
    def centred(self) -> bool:
        """Whether keys are stored minus their sequence's centre (every quantized policy): the
        centre is computed from the sequence's first chunk, in an eager step (a decode graph
        computes none), and kept at the row of its first block (``KeyCentring``)."""
        return bool(self.quant_policy)

    @property
    def min_first_chunk_tokens(self) -> int:
        """The fewest tokens a sequence's first chunk may bring (fewer only when the sequence or
        the step's token budget is shorter), so that what the cache derives from the chunk does not
        depend on how the scheduler cut it: a centred cache's centre tokens; 0 means no rule."""
        return CENTRE_TOKENS if self.centred else 0

    def reserved_head_blocks(self, max_batch_size: int, num_blocks: int | None = None) -> int:
        """Blocks the block manager keeps for sequences' first blocks, at most ``num_blocks``: a
        centred cache has a centre row only for these (a sequence starting elsewhere is stored
        uncentred); 0 when the layout keeps no per-sequence state."""
        rows = CENTRE_ROWS_PER_SEQUENCE * max_batch_size if self.centred else 0
        return rows if num_blocks is None else min(rows, num_blocks)

    def centre_bytes_per_head(self) -> int:
        """Bytes one key centre row takes per layer and kv head (0 when unquantized): its two
        vectors (``KeyCentring``)."""
        return 2 * self.head_dim * SCALE_DTYPE.itemsize if self.centred else 0

    def centre_table_bytes(self, layers: int, num_kv_heads: int, max_batch_size: int) -> int:
        """Bytes the key centre tables take at most (``allocate_centres`` with every reserved
        head block), set aside before the cache's blocks are counted; 0 when unquantized."""
        rows = self.reserved_head_blocks(max_batch_size) + 1  # and the zero row
        return layers * rows * num_kv_heads * self.centre_bytes_per_head()

    def allocate_centres(self, layers: int, head_blocks: int, num_kv_heads: int,
                         device: torch.device | str) -> torch.Tensor | None:
        """The key centre tables (the module doc), zeros [layers, head_blocks + 1, 2,
        num_kv_heads, head_dim]: a row for each reserved head block and the zero one last
        (``KeyCentring.table``); None when unquantized."""
        if not self.centred:
            return None
        return torch.zeros((layers, head_blocks + 1, 2, num_kv_heads, self.head_dim), dtype=SCALE_DTYPE,
                           device=device)

    def allocate(self, lead: tuple[int, ...], dtype: torch.dtype, device: torch.device | str,
                 alloc=torch.zeros) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One cache (keys or values) of shape ``lead + (code_dim,)`` and its scales
        ``lead + (2,)`` (None when unquantized)."""
        codes = alloc((*lead, self.code_dim), dtype=self.code_dtype(dtype), device=device)
        scales = alloc((*lead, 2), dtype=SCALE_DTYPE, device=device) if self.quant_policy else None
        return codes, scales
