"""Groups of a decoder layer's linears that read the same input, and folding per-channel scales into them.

Both AWQ and SmoothQuant rescale the input channels of such a group: the group's weights are
multiplied by per-input-channel scales ``s`` and the op that produces the input (an RMSNorm's
weight, or the rows of ``v_proj`` / ``up_proj``) is divided by them, which leaves the
unquantized model's function unchanged. The groups of a Llama-named layer (transformers' module
names; which norms they follow is the family's ``layouts.DecoderLayout``): q/k/v after the
attention's norm (``input_layernorm``); ``o_proj`` after ``v_proj`` (only when their shapes
match: with grouped-query attention one ``v_proj`` row feeds several ``o_proj`` columns);
gate/up after the MLP's norm (``post_attention_layernorm``, Gemma 2/3's
``pre_feedforward_layernorm``); ``down_proj`` after ``up_proj`` (the MLP's product is linear in
up's output).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .calibration import InputRecord, LayerwiseRunner
from .layouts import LAYOUTS


@dataclass
class ScaleGroup:
    """Linear layers that share an input, the op that produces it, and the block whose output is judged."""

    name: str
    prev: nn.Module
    linears: dict[str, nn.Linear]
    input_name: str  # the key of the InputRecord holding the group's input
    block: Callable[[torch.Tensor], torch.Tensor]
    prev_offset: float = 0.0  # a norm ``prev`` that scales by ``prev_offset + weight`` (Gemma's 1)
    # Modules that read the same input but are not quantized (an MoE router, the shared expert's
    # gate, experts without calibration tokens): multiplied by the scales when they are folded.
    also_scaled: tuple[nn.Module, ...] = ()


# Linears of a decoder layer that stay 16-bit: Qwen2-MoE's one-output gate of the shared expert.
KEEP_16BIT = ("mlp.shared_expert_gate",)


def decoder_linears(layer: nn.Module) -> dict[str, nn.Linear]:
    """The linear layers of a decoder layer that are quantized, by name relative to the layer."""
    return {name: module for name, module in layer.named_modules()
            if isinstance(module, nn.Linear) and name not in KEEP_16BIT}


def attention_groups(layer: nn.Module, runner: LayerwiseRunner) -> list[ScaleGroup]:
    """The attention's scale groups: q/k/v, and o_proj where v_proj's shape allows."""
    layout = LAYOUTS[runner.model.config.model_type]
    attn = layer.self_attn
    groups = [ScaleGroup("qkv", getattr(layer, layout.attn_norm),
                         {"self_attn.q_proj": attn.q_proj, "self_attn.k_proj": attn.k_proj,
                          "self_attn.v_proj": attn.v_proj},
                         "self_attn.q_proj", lambda x: runner.attention(attn, x), layout.norm_offset)]
    if attn.v_proj.weight.shape == attn.o_proj.weight.shape:
        groups.append(ScaleGroup("o", attn.v_proj, {"self_attn.o_proj": attn.o_proj}, "self_attn.o_proj",
                                 attn.o_proj))
    return groups


def scale_groups(layer: nn.Module, runner: LayerwiseRunner) -> list[ScaleGroup]:
    """The scale groups of a dense decoder layer of ``runner``'s model (transformers' module names)."""
    layout = LAYOUTS[runner.model.config.model_type]
    mlp = layer.mlp
    groups = attention_groups(layer, runner)
    groups.append(ScaleGroup("gate_up", getattr(layer, layout.mlp_norm),
                             {"mlp.gate_proj": mlp.gate_proj, "mlp.up_proj": mlp.up_proj}, "mlp.gate_proj", mlp,
                             layout.norm_offset))
    groups.append(ScaleGroup("down", mlp.up_proj, {"mlp.down_proj": mlp.down_proj}, "mlp.down_proj",
                             mlp.down_proj))
    return groups


def recorded_inputs(layer: nn.Module) -> dict[str, nn.Module]:
    """The submodules whose inputs the search needs: one per distinct input of the layer's linears."""
    attn, mlp = layer.self_attn, layer.mlp
    return {"self_attn.q_proj": attn.q_proj, "self_attn.o_proj": attn.o_proj,
            "mlp.gate_proj": mlp.gate_proj, "mlp.down_proj": mlp.down_proj}


# The input each linear reads, as the name of the module recorded for it.
INPUT_OF = {"self_attn.q_proj": "self_attn.q_proj", "self_attn.k_proj": "self_attn.q_proj",
             "self_attn.v_proj": "self_attn.q_proj", "self_attn.o_proj": "self_attn.o_proj",
             "mlp.gate_proj": "mlp.gate_proj", "mlp.up_proj": "mlp.gate_proj", "mlp.down_proj": "mlp.down_proj"}


@torch.no_grad()
def apply_scale(group: ScaleGroup, scales: torch.Tensor, record: InputRecord | None = None) -> None:
    """Fold ``scales`` in: the previous op's output divided by them, the group's weights multiplied.

    The unquantized function of the layer is unchanged. The recorded inputs, if given, are divided
    too, so that later searches (clipping) see what the scaled weights will be fed.
    """
    prev = group.prev
    s = scales.to(prev.weight.device)
    if isinstance(prev, nn.Linear):
        # The previous linear's last len(s) output rows produce the group's input.
        rows = prev.weight[-s.numel():]
        rows.div_(s.to(rows.dtype).view(-1, 1))
        if prev.bias is not None:
            prev.bias[-s.numel():].div_(s.to(prev.bias.dtype))
    else:  # RMSNorm / LayerNorm: a per-channel weight (and bias); the scale it applies is offset + weight
        offset = group.prev_offset
        prev.weight.add_(offset).div_(s.to(prev.weight.dtype)).sub_(offset)
        if getattr(prev, "bias", None) is not None:
            prev.bias.div_(s.to(prev.bias.dtype))
    for lin in (*group.linears.values(), *group.also_scaled):
        lin.weight.mul_(s.to(lin.weight.dtype).view(1, -1))
    if record is not None:
        if record.kept is not None:
            record.kept.div_(s.to(record.kept.dtype))
        record.absmean.div_(s.to(record.absmean.dtype))
        record.absmax.div_(s.to(record.absmax.dtype))
