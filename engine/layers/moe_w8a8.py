"""W8A8 (SmoothQuant int8) experts for ``FusedMoE``: every expert's int8 weights and per-channel
scales stacked on a leading expert dim, in the layout ``kernels/moe/gemm_w8a8.py`` reads.

compressed-tensors' int8 checkpoints (llm-compressor, ``conveyor lite smooth_quant``) store one
pair per expert and projection: ``experts.{e}.{gate,up,down}.weight`` int8 [out, in] and
``.weight_scale`` [out, 1] (any float dtype in the file; float32 here), as the dense W8A8 linears
read them (``w8a8_linear``). They load with no repacking: gate's rows then up's into ``w13`` int8
[E, 2I, H] and ``w13_scale`` [E, 2I], down's into ``w2`` [E, H, I] and ``w2_scale`` [E, H].
Activations are quantized per token (the experts' input) and per routed pair (the intermediate)
at run time, by the kernels.

Tensor parallelism slices each expert's intermediate dim as the 16-bit experts do: the gate and
up rows and their scales, the down projection's columns (its per-row scales stay whole: every
rank's partial sum carries the full scale, and the all-reduce adds them).

The MoE block's input arrives in 16 bits (the router reads it; ``MoeDecoderLayer`` keeps the norm
before a sparse block from handing over int8 rows), and ``fused_moe_w8a8`` quantizes it.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ...kernels.moe.launch_w8a8 import fused_moe_w8a8
from ...kernels.w8a8 import QMAX
from ..weight_loader import materialize, narrow


class W8A8MoEMethod:
    """Symmetric int8 experts (one scale per output channel) times per-row int8 activations."""

    def create_weights(self, layer: nn.Module, hidden_size: int, tp_size: int) -> None:
        """Register ``w13``, ``w13_scale``, ``w2`` and ``w2_scale`` for this rank's slice of I
        (``layer.inter_size``)."""
        inter, e = layer.inter_size, layer.num_experts
        shapes = {"w13": ((e, 2 * inter, hidden_size), torch.int8), "w13_scale": ((e, 2 * inter), torch.float32),
                  "w2": ((e, hidden_size, inter), torch.int8), "w2_scale": ((e, hidden_size), torch.float32)}
        for name, (shape, dtype) in shapes.items():
            p = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
            proj = name.split("_")[0]
            p.weight_loader = functools.partial(self._load, layer, proj, name != proj)
            p.shard_ids = tuple((x, j) for x in range(e) for j in (0, 1)) if proj == "w13" else tuple(range(e))
            setattr(layer, name, p)

    @staticmethod
    def _load(layer: nn.Module, proj: str, is_scale: bool, param: nn.Parameter, loaded: torch.Tensor,
              shard_id) -> None:
        """One expert's gate ((e, 0)), up ((e, 1)) or down (e) weight or scale, this rank's slice."""
        kind = "weight_scale" if is_scale else "weight"
        if shard_id is None:
            raise ValueError(f"W8A8 experts load one tensor per expert and projection "
                             f"(experts.{{e}}.<proj>.{kind}), not a stacked {proj} tensor")
        full, start, size = layer.full_intermediate_size, layer.inter_start, layer.inter_size
        hidden = layer.w2.shape[1]
        if proj == "w13":
            expert, half = shard_id
            what = f"expert {expert} {'up' if half else 'gate'} {kind}"
            want = (full, 1) if is_scale else (full, hidden)
            src = narrow(loaded, 0, start, size)
            dst = param.data[expert, half * size:(half + 1) * size]
        else:
            expert = shard_id
            what = f"expert {expert} down {kind}"
            want = (hidden, 1) if is_scale else (hidden, full)
            src = loaded if is_scale else narrow(loaded, 1, start, size)
            dst = param.data[expert]
        if tuple(loaded.shape) != want:
            raise ValueError(f"checkpoint tensor for {what} has shape {tuple(loaded.shape)}, expected {want}")
        src = materialize(src)
        if is_scale:
            if not src.is_floating_point():
                raise ValueError(f"checkpoint tensor for {what} is {src.dtype}; scales are float")
            dst.copy_(src.reshape(-1).float())
        else:
            if src.dtype != torch.int8:
                raise ValueError(f"checkpoint tensor for {what} is {src.dtype}; W8A8 weights are int8")
            dst.copy_(src)

    def apply(self, layer: nn.Module, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum (this rank's part): the Triton kernels on the GPU, their
        integer reference on the CPU."""
        return fused_moe_w8a8(x, layer.w13, layer.w13_scale, layer.w2, layer.w2_scale, weights, ids,
                              layer.activation)

    def init_dummy(self, layer: nn.Module, generator: torch.Generator) -> None:
        """Random experts whose values are ~N(0, 0.02)-sized (``W8A8LinearMethod``'s): uniform codes
        in ±127 (std ~73.3) times 0.02 / 73.3."""
        for proj in ("w13", "w2"):
            w = getattr(layer, proj)
            w.copy_(torch.randint(-QMAX, QMAX + 1, w.shape, generator=generator, device=w.device, dtype=torch.int8))
            getattr(layer, f"{proj}_scale").fill_(0.02 / 73.3)
