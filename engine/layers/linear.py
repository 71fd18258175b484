"""Linear layers, including the fused QKV and gate/up projections the models use.

Two seams are kept on purpose:

* **Weight format** goes through a ``LinearMethod`` (``create_weights`` + ``apply``): dense
  here, W4A16 in ``awq_linear.py``; ``engine/quant_format.py`` picks one from the checkpoint.
  A parameter whose output dimension is not dim 0 says so in ``output_dim``, and one that packs
  several outputs per element says how many in ``pack_factor`` (AWQ's ``qweight`` is [in, out/8]):
  fused shards are placed by those.
* **Tensor parallelism** will change only *which slice* of a checkpoint tensor a rank keeps
  (``weight_loader``) and add a collective in ``forward``: column-parallel layers (QKV, gate/up)
  shard ``dim 0``, row-parallel ones (o_proj, down_proj) shard ``dim 1`` and all-reduce. Every
  layer here is replicated (TP size 1) today.

Every parameter carries a ``weight_loader(param, tensor, shard_id=None)`` attribute; fused layers
also carry ``shard_ids`` so a model's ``load_weights`` can check that each shard was loaded.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch
from torch import nn

from ...kernels.gemv import linear

logger = logging.getLogger(__name__)

ShardId = int | str


class LinearMethod(Protocol):
    """How a linear layer stores and applies its weight (the quantization seam)."""

    def create_weights(self, layer: LinearBase, input_size: int, output_size: int, bias: bool) -> None:
        """Register the layer's parameters."""

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        """Compute ``x @ W.T (+ b)`` from the stored parameters."""


class UnquantizedLinearMethod:
    """Dense weight ``[out, in]`` in the model dtype."""

    def create_weights(self, layer: LinearBase, input_size: int, output_size: int, bias: bool) -> None:
        """Register ``weight`` and optional ``bias``."""
        layer.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        layer.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        """Dense matmul; one-row inputs (batch-1 decode) take the GEMV kernel on the GPU."""
        return linear(x, layer.weight, layer.bias)


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"checkpoint tensor for {what} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)


class LinearBase(nn.Module):
    """``y = x W^T + b`` with pluggable weight format; replicated across ranks."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, method: LinearMethod | None = None
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.method = method or UnquantizedLinearMethod()
        self.method.create_weights(self, input_size, output_size, bias)
        for param in self.parameters(recurse=False):
            param.weight_loader = self.weight_loader

    @torch.no_grad()
    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId | None = None) -> None:
        """Copy a whole checkpoint tensor into ``param``."""
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} is not fused; got shard {shard_id!r}")
        _copy_checked(param.data, loaded, type(self).__name__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., in] -> [..., out]."""
        return self.method.apply(self, x)


class ReplicatedLinear(LinearBase):
    """A plain linear layer (the place row-parallel sharding of o_proj/down_proj will go)."""


class MergedLinear(LinearBase):
    """Several projections of the same input stacked along the output dim (e.g. gate/up).

    Shard ``i`` of ``output_sizes`` is loaded from its own checkpoint tensor.
    """

    def __init__(
        self, input_size: int, output_sizes: list[int], bias: bool = False, method: LinearMethod | None = None
    ) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, method)
        for param in self.parameters(recurse=False):
            param.shard_ids = self.shard_ids()

    def shard_ids(self) -> tuple[ShardId, ...]:
        """The ids ``weight_loader`` accepts, in output order."""
        return tuple(range(len(self.output_sizes)))

    def _shard_index(self, shard_id: ShardId) -> int:
        ids = self.shard_ids()
        if shard_id not in ids:
            raise ValueError(f"{type(self).__name__}: unknown shard {shard_id!r}; expected one of {ids}")
        return ids.index(shard_id)

    @torch.no_grad()
    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId | None = None) -> None:
        """Copy one projection's tensor into its rows of the fused ``param``."""
        if shard_id is None:
            # An already-fused checkpoint tensor.
            _copy_checked(param.data, loaded, type(self).__name__)
            return
        idx = self._shard_index(shard_id)
        dim, pack = getattr(param, "output_dim", 0), getattr(param, "pack_factor", 1)
        start, size = sum(self.output_sizes[:idx]), self.output_sizes[idx]
        if start % pack or size % pack:
            raise ValueError(f"{type(self).__name__}[{shard_id}]: {size} outputs at {start} do not fall on "
                             f"whole packed elements of {pack}")
        _copy_checked(param.data.narrow(dim, start // pack, size // pack), loaded,
                      f"{type(self).__name__}[{shard_id}]")


class QKVLinear(MergedLinear):
    """Fused query/key/value projection; shards ``"q"``, ``"k"``, ``"v"``."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        method: LinearMethod | None = None,
    ) -> None:
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        super().__init__(hidden_size, sizes, bias, method)

    def shard_ids(self) -> tuple[ShardId, ...]:
        """``("q", "k", "v")``."""
        return ("q", "k", "v")
