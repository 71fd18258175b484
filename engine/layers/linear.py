"""Linear layers, including the fused QKV and gate/up projections the models use.

Two seams:

* **Weight format** goes through a ``LinearMethod`` (``create_weights`` + ``apply``): dense
  here, W4A16 in ``awq_linear.py``, W8A8 in ``w8a8_linear.py``; ``engine/quant_format.py`` picks
  one from the checkpoint. A parameter says which of its dims runs along the outputs
  (``output_dim``, default 0) and along the inputs (``input_dim``; none: not split by inputs),
  how many outputs one element packs (``pack_factor``: AWQ's ``qweight`` is [in, out/8]) and how
  many inputs one row covers (``input_group``: AWQ's group scales). Shards are cut by those.
* **Tensor parallelism** (``engine/distributed.py``): the column-parallel layers (the fused
  QKV and gate/up, ``MergedLinear``) keep each rank's part of every output shard, the
  row-parallel ones (o_proj, down_proj, ``RowParallelLinear``) each rank's part of the inputs
  and sum their partial outputs with one all-reduce. Each rank reads only its slice of a
  checkpoint tensor (``weight_loader.narrow``). With one rank both are plain linear layers.

Every parameter carries a ``weight_loader(param, tensor, shard_id=None)`` attribute; fused layers
also carry ``shard_ids`` so a model's ``load_weights`` can check that each shard was loaded.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch
from torch import nn

from ...kernels.gemv import linear
from ..distributed import kv_head_range, shard_range, tp_group
from ..weight_loader import materialize, narrow

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
        layer.weight.input_dim = 1
        layer.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None

    # ``apply`` can write its product into a given buffer (``out``): a row-parallel layer's into
    # its slot of tensor parallel's fused all-reduce, without a copy (RowParallelLinear.forward).
    writes_into = True

    def apply(self, layer: LinearBase, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Dense matmul (into ``out``, [rows, out] for 2-D ``x``, when given); one-row inputs
        (batch-1 decode) take the GEMV kernel on the GPU."""
        return linear(x, layer.weight, layer.bias, out=out)


def _copy_checked(dst: torch.Tensor, src, what: str) -> None:
    src = materialize(src)
    if dst.shape != src.shape:
        raise ValueError(f"checkpoint tensor for {what} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)


class LinearBase(nn.Module):
    """``y = x W^T + b`` with pluggable weight format; the same on every rank."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, method: LinearMethod | None = None
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.method = method or UnquantizedLinearMethod()
        self.method.create_weights(self, input_size, output_size, bias)
        # LoRA adapters' slots beside this linear (``layers/lora.LoRASlots``), when the engine runs them.
        self.lora = None
        for param in self.parameters(recurse=False):
            param.weight_loader = self.weight_loader

    @torch.no_grad()
    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId | None = None) -> None:
        """Copy a whole checkpoint tensor into ``param``."""
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} is not fused; got shard {shard_id!r}")
        _copy_checked(param.data, loaded, type(self).__name__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., in] -> [..., out] (plus the step's adapter deltas, when LoRA slots are attached)."""
        started = self.lora.begin(x) if self.lora is not None else None
        return self.method.apply(self, x) if started is None else self.lora.apply(self, x, started)


class RowParallelLinear(LinearBase):
    """A linear layer whose inputs are split over the ranks (o_proj, down_proj): each rank
    multiplies its part of the input by its rows of the weight, and one all-reduce sums the
    parts. The bias is added once: rank 0 keeps it, the others hold zeros. ``reduce_output``
    False leaves the sum to the caller, which adds this rank's part to others first (a MoE block's
    shared expert and routed experts: one all-reduce for both)."""

    reduce_output = True
    # The slot of the fused all-reduce's shared buffer this linear leaves its part in, for the norm
    # after it to sum (set by the model, FusedNormAllReduce.assign), or None: summed here.
    reduce_slot: int | None = None

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, method: LinearMethod | None = None
    ) -> None:
        tp = tp_group()
        self.full_input_size = input_size
        self.input_start, local = shard_range(input_size, tp.rank, tp.size, f"{type(self).__name__} inputs")
        super().__init__(local, output_size, bias, method)

    @torch.no_grad()
    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId | None = None) -> None:
        """Copy this rank's input slice of a checkpoint tensor into ``param``."""
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} is not fused; got shard {shard_id!r}")
        what = type(self).__name__
        dim = getattr(param, "input_dim", None)
        if param is self.bias and tp_group().rank != 0:
            if tuple(loaded.shape) != tuple(param.shape):
                raise ValueError(f"checkpoint bias for {what} has shape {tuple(loaded.shape)}, expected "
                                 f"{tuple(param.shape)}")
            param.data.zero_()  # the all-reduce adds rank 0's bias once
        elif dim is None or tp_group().size == 1:
            _copy_checked(param.data, loaded, what)
        else:
            group = getattr(param, "input_group", 1)
            if self.input_start % group or self.input_size % group:
                raise ValueError(f"{what}: a rank's {self.input_size} inputs do not fall on whole groups of {group}")
            full = -(-self.full_input_size // group)
            if loaded.shape[dim] != full:
                raise ValueError(f"checkpoint tensor for {what} has {loaded.shape[dim]} input rows along dim {dim}, "
                                 f"expected {full}")
            _copy_checked(param.data, narrow(loaded, dim, self.input_start // group, param.shape[dim]), what)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., in / tp] -> [..., out], summed over the ranks (this rank's part without
        ``reduce_output``)."""
        started = self.lora.begin(x) if self.lora is not None else None
        tp = tp_group()
        fused = tp.fused if self.reduce_output and self.reduce_slot is not None else None
        if fused is not None and started is None and getattr(self.method, "writes_into", False) and x.dim() == 2:
            # The product straight into this linear's slot: a PartialSum the next norm sums.
            slot = fused.slot_view(self.reduce_slot, x.shape[0], self.output_size, x.dtype, x.device)
            if slot is not None:
                return fused.partial(self.reduce_slot, self.method.apply(self, x, out=slot))
        # With adapters, this rank's part plus x_r A_r^T B^T: the all-reduce sums the ranks' parts.
        out = self.method.apply(self, x) if started is None else self.lora.apply(self, x, started)
        if not self.reduce_output:
            return out
        if fused is not None and fused.fits(out):
            return fused.stage(self.reduce_slot, out)  # a PartialSum: the next norm sums it
        return tp.all_reduce(out)


class MergedLinear(LinearBase):
    """Several projections of the same input stacked along the output dim (e.g. gate/up), and
    split by outputs over the ranks: each rank keeps its part of every projection.

    Shard ``i`` of ``output_sizes`` (whole-model sizes) is loaded from its own checkpoint tensor.
    """

    def __init__(
        self, input_size: int, output_sizes: list[int], bias: bool = False, method: LinearMethod | None = None
    ) -> None:
        tp = tp_group()
        self.full_output_sizes = list(output_sizes)
        # (start in the checkpoint tensor, length) of this rank's part of each projection.
        self.parts = [self.rank_part(i, size, tp.rank, tp.size) for i, size in enumerate(output_sizes)]
        self.output_sizes = [n for _, n in self.parts]
        super().__init__(input_size, sum(self.output_sizes), bias, method)
        for param in self.parameters(recurse=False):
            param.shard_ids = self.shard_ids()

    def rank_part(self, index: int, size: int, rank: int, tp_size: int) -> tuple[int, int]:
        """(start, length) of rank ``rank``'s outputs of projection ``index`` (an equal split)."""
        return shard_range(size, rank, tp_size, f"{type(self).__name__} shard {index} outputs")

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
        """Copy this rank's part of one projection's tensor (or of an already-fused one, when
        ``shard_id`` is None) into its place in the fused ``param``."""
        if shard_id is None:
            offset = 0
            for i in range(len(self.output_sizes)):
                self._load_part(param, loaded, i, offset, whole=sum(self.full_output_sizes))
                offset += self.full_output_sizes[i]
            return
        i = self._shard_index(shard_id)
        self._load_part(param, loaded, i, 0, whole=self.full_output_sizes[i])

    def _load_part(self, param: nn.Parameter, loaded, index: int, offset: int, whole: int) -> None:
        """Rows ``offset + parts[index]`` of ``loaded`` (``whole`` outputs along the output dim)
        into projection ``index``'s place in ``param``."""
        what = f"{type(self).__name__}[{self.shard_ids()[index]}]"
        dim, pack = getattr(param, "output_dim", 0), getattr(param, "pack_factor", 1)
        src, size = self.parts[index]
        dst = sum(self.output_sizes[:index])
        if (offset + src) % pack or size % pack or dst % pack:
            raise ValueError(f"{what}: {size} outputs at {offset + src} do not fall on whole packed elements of {pack}")
        if loaded.shape[dim] != whole // pack:
            raise ValueError(f"checkpoint tensor for {what} has {loaded.shape[dim]} outputs along dim {dim}, "
                             f"expected {whole // pack}")
        _copy_checked(param.data.narrow(dim, dst // pack, size // pack),
                      narrow(loaded, dim, (offset + src) // pack, size // pack), what)


class QKVLinear(MergedLinear):
    """Fused query/key/value projection; shards ``"q"``, ``"k"``, ``"v"``. Split over the ranks
    by heads: each keeps ``num_heads / tp`` query heads and its kv heads (``kv_head_range``:
    an equal part, or one head shared by several ranks when tp exceeds the kv heads)."""

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
        tp = tp_group()
        self.num_heads = shard_range(num_heads, tp.rank, tp.size, "num_attention_heads")[1]
        self.num_kv_heads = kv_head_range(num_kv_heads, tp.rank, tp.size)[1]
        self._kv_heads_total = num_kv_heads
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        super().__init__(hidden_size, sizes, bias, method)

    def rank_part(self, index: int, size: int, rank: int, tp_size: int) -> tuple[int, int]:
        """Query heads split evenly; key and value heads as ``kv_head_range`` says."""
        if index == 0:
            return super().rank_part(index, size, rank, tp_size)
        first, count = kv_head_range(self._kv_heads_total, rank, tp_size)
        return first * self.head_dim, count * self.head_dim

    def shard_ids(self) -> tuple[ShardId, ...]:
        """``("q", "k", "v")``."""
        return ("q", "k", "v")
