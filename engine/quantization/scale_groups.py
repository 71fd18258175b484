"""Groups of a decoder layer's linears that read the same input, and folding per-channel scales into them.

Both AWQ and SmoothQuant rescale the input channels of such a group: the group's weights are
multiplied by per-input-channel scales ``s`` and the op that produces the input (an RMSNorm's
weight, or the rows of ``v_proj`` / ``up_proj``) is divided by them, which leaves the
unquantized model's function unchanged. The groups of a Llama / Mistral / Qwen2 layer
(transformers' module names): q/k/v after ``input_layernorm``; ``o_proj`` after ``v_proj``
(only when their shapes match: with grouped-query attention one ``v_proj`` row feeds several
``o_proj`` columns); gate/up after ``post_attention_layernorm``; ``down_proj`` after ``up_proj``
(the MLP's product is linear in up's output).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .calibration import InputRecord, LayerwiseRunner


@dataclass
class ScaleGroup:
    """Linear layers that share an input, the op that produces it, and the block whose output is judged."""

    name: str
    prev: nn.Module
    linears: dict[str, nn.Linear]
    input_name: str  # the key of the InputRecord holding the group's input
    block: Callable[[torch.Tensor], torch.Tensor]


def decoder_linears(layer: nn.Module) -> dict[str, nn.Linear]:
    """The linear layers of a Llama-family decoder layer, by name relative to the layer."""
    return {name: module for name, module in layer.named_modules() if isinstance(module, nn.Linear)}


def scale_groups(layer: nn.Module, runner: LayerwiseRunner) -> list[ScaleGroup]:
    """The AWQ groups of a Llama / Mistral / Qwen2 decoder layer (transformers' module names)."""
    attn, mlp = layer.self_attn, layer.mlp
    groups = [ScaleGroup("qkv", layer.input_layernorm,
                         {"self_attn.q_proj": attn.q_proj, "self_attn.k_proj": attn.k_proj,
                          "self_attn.v_proj": attn.v_proj},
                         "self_attn.q_proj", lambda x: runner.attention(attn, x))]
    if attn.v_proj.weight.shape == attn.o_proj.weight.shape:
        groups.append(ScaleGroup("o", attn.v_proj, {"self_attn.o_proj": attn.o_proj}, "self_attn.o_proj",
                                 attn.o_proj))
    groups.append(ScaleGroup("gate_up", layer.post_attention_layernorm,
                             {"mlp.gate_proj": mlp.gate_proj, "mlp.up_proj": mlp.up_proj}, "mlp.gate_proj", mlp))
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
    else:  # RMSNorm / LayerNorm: a per-channel weight (and bias)
        prev.weight.div_(s.to(prev.weight.dtype))
        if getattr(prev, "bias", None) is not None:
            prev.bias.div_(s.to(prev.bias.dtype))
    for lin in group.linears.values():
        lin.weight.mul_(s.to(lin.weight.dtype).view(1, -1))
    if record is not None:
        if record.kept is not None:
            record.kept.div_(s.to(record.kept.dtype))
        record.absmean.div_(s.to(record.absmean.dtype))
        record.absmax.div_(s.to(record.absmax.dtype))
