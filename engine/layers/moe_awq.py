"""AWQ (W4A16) experts for ``FusedMoE``: every expert's AutoAWQ "gemm" triples stacked on a
leading expert dim, in the layout ``kernels/moe/gemm_w4a16.py`` reads.

Published AWQ MoE checkpoints (TheBloke's Mixtral, Qwen's Qwen1.5-MoE / Qwen3-MoE releases) and
``conveyor lite auto_awq`` store one triple per expert and projection:
``experts.{e}.{gate,up,down}.{qweight,qzeros,scales}``, gate/up [H, I/8], [H/g, I/8], [H/g, I] and
down [I, H/8], [I/g, H/8], [I/g, H] (K rows, N columns: the layout ``kernels/w4a16`` documents).
They load with no repacking: gate's columns then up's into ``w13_*`` [E, ..., 2I/8 or 2I] (the
fused order ``fused_moe`` reads), down's into ``w2_*`` [E, ...].

Tensor parallelism slices each expert's intermediate dim as the 16-bit experts do: gate/up by
columns (I/8 packed words a rank), down by rows, whose zeros and scales come one row per group, so
a rank's slice must hold whole groups: a tp whose slice is not a multiple of ``group_size`` is
refused when the layer is built, before any weight is read.

On the GPU ``fused_moe_w4a16`` runs the Triton kernels (no dense weight is written). On the CPU
the experts are dequantized once to fp32 and kept, as ``awq_linear`` keeps its dense weight (the
CPU runs the engine for tests, not for speed).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ...kernels.moe.launch_w4a16 import fused_moe_w4a16
from ...kernels.moe.reference import fused_moe_ref
from ...kernels.moe.reference_w4a16 import dequantize_experts_ref
from ...kernels.w4a16 import PACK
from ...protocol.errors import EngineConfigError
from ..weight_loader import materialize, narrow

class AWQMoEMethod:
    """Group-wise 4-bit experts with zero points; activations stay in 16 bits."""

    def __init__(self, group_size: int):
        self.group_size = group_size

    def create_weights(self, layer: nn.Module, hidden_size: int, tp_size: int) -> None:
        """Register ``w13_{qweight,qzeros,scales}`` and ``w2_*`` for this rank's slice of I
        (``layer.inter_size``); EngineConfigError for a slice the groups cannot follow."""
        inter, full, e = layer.inter_size, layer.full_intermediate_size, layer.num_experts
        group = self.group_size
        one_group = group == -1 or group >= full  # one group over each expert's inputs to down_proj
        if one_group and tp_size > 1:
            raise EngineConfigError(f"this AWQ checkpoint has one group over each expert's {full} inputs to "
                                    f"down_proj (group_size {group}), which cannot be split over tp={tp_size}: "
                                    "use tp=1")
        if not one_group and inter % group:
            where = (f"tp={tp_size} gives each rank {inter} of the experts' {full} intermediate columns"
                     if tp_size > 1 else f"the experts' intermediate size is {full}")
            fix = (f"pick a tp that leaves each rank a multiple of {group} (one dividing {full // group})"
                   if full % group == 0 else "re-quantize with a group_size that divides it")
            raise EngineConfigError(f"{where} (moe_intermediate_size), not a multiple of the AWQ group_size "
                                    f"{group}: {fix}")
        g2 = inter if one_group else group
        g13 = hidden_size if group == -1 or group >= hidden_size else group
        if hidden_size % g13 or hidden_size % PACK or inter % PACK:
            raise EngineConfigError(f"hidden_size {hidden_size} / the experts' width {inter} is not a multiple of "
                                    f"the AWQ group_size {group} (and of 8)")
        shapes = {
            "w13_qweight": ((e, hidden_size, 2 * inter // PACK), torch.int32),
            "w13_qzeros": ((e, hidden_size // g13, 2 * inter // PACK), torch.int32),
            "w13_scales": ((e, hidden_size // g13, 2 * inter), None),  # the model's dtype
            "w2_qweight": ((e, inter, hidden_size // PACK), torch.int32),
            "w2_qzeros": ((e, inter // g2, hidden_size // PACK), torch.int32),
            "w2_scales": ((e, inter // g2, hidden_size), None),
        }
        for name, (shape, dtype) in shapes.items():
            p = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
            proj, kind = name.split("_")
            p.weight_loader = functools.partial(self._load, layer, proj, kind)
            p.shard_ids = tuple((x, j) for x in range(e) for j in (0, 1)) if proj == "w13" else tuple(range(e))
            setattr(layer, name, p)
        layer.dense_cpu = None  # the CPU path's dequantized experts, made on first use

    def _load(self, layer: nn.Module, proj: str, kind: str, param: nn.Parameter, loaded: torch.Tensor,
              shard_id) -> None:
        """One expert's gate ((e, 0)), up ((e, 1)) or down (e) tensor of ``kind``, this rank's slice."""
        if shard_id is None:
            raise ValueError(f"AWQ experts load one tensor per expert and projection "
                             f"(experts.{{e}}.<proj>.{kind}), not a stacked {proj} tensor")
        full, start, size = layer.full_intermediate_size, layer.inter_start, layer.inter_size
        per_expert = tuple(param.shape[1:])
        if proj == "w13":
            expert, half = shard_id
            cols = PACK if kind != "scales" else 1  # columns of I per tensor column
            want = (per_expert[0], full // cols)
            src = narrow(loaded, 1, start // cols, size // cols)
            dst = param.data[expert, :, half * (size // cols):(half + 1) * (size // cols)]
            what = f"expert {expert} {'up' if half else 'gate'} {kind}"
        else:
            expert = shard_id
            rows = 1 if kind == "qweight" else size // per_expert[0]  # inputs of I per tensor row: 1, or a group
            want = (full // rows, per_expert[1])
            src = narrow(loaded, 0, start // rows, size // rows)
            dst = param.data[expert]
            what = f"expert {expert} down {kind}"
        if tuple(loaded.shape) != want:
            raise ValueError(f"checkpoint tensor for {what} has shape {tuple(loaded.shape)}, expected {want} "
                             f"(AWQ group_size {self.group_size})")
        src = materialize(src)
        if kind != "scales" and src.dtype != torch.int32:
            raise ValueError(f"checkpoint tensor for {what} is {src.dtype}; AWQ packs int32")
        dst.copy_(src)

    def apply(self, layer: nn.Module, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum from the packed weights (this rank's part)."""
        if x.device.type == "cpu":
            if layer.dense_cpu is None:
                layer.dense_cpu = (
                    dequantize_experts_ref(layer.w13_qweight, layer.w13_qzeros, layer.w13_scales, self.group_size),
                    dequantize_experts_ref(layer.w2_qweight, layer.w2_qzeros, layer.w2_scales, self.group_size))
            w13, w2 = layer.dense_cpu
            return fused_moe_ref(x.float(), w13, w2, weights, ids, layer.activation).to(x.dtype)
        return self.apply_packed(layer, x, weights, ids)

    def apply_packed(self, layer: nn.Module, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
                     ) -> torch.Tensor:
        """``apply`` on the packed weights (the GPU's path: the Triton kernels where they take x)."""
        return fused_moe_w4a16(x, layer.w13_qweight, layer.w13_qzeros, layer.w13_scales, layer.w2_qweight,
                               layer.w2_qzeros, layer.w2_scales, self.group_size, weights, ids, layer.activation)

    def init_dummy(self, layer: nn.Module, generator: torch.Generator) -> None:
        """Random experts whose dequantized values are ~N(0, 0.02)-sized (``AWQLinearMethod``'s)."""
        for proj in ("w13", "w2"):
            qweight = getattr(layer, f"{proj}_qweight")
            qweight.copy_(torch.randint(-2**31, 2**31 - 1, qweight.shape, generator=generator,
                                        device=qweight.device, dtype=torch.int64).to(torch.int32))
            getattr(layer, f"{proj}_qzeros").fill_(0x88888888 - 2**32)  # every nibble 8
            getattr(layer, f"{proj}_scales").fill_(0.02 / 4.6)
        layer.dense_cpu = None
