"""GLM (``GlmForCausalLM``: GLM-4-9B in transformers' layout) and GLM-4-0414 (``Glm4ForCausalLM``).

The Llama computation with:

- RoPE on the first half of each head only (``partial_rotary_factor``, 0.5 unless the config
  says otherwise), its dims paired as neighbours (``x[2i]``, ``x[2i+1]``), not as halves: the
  rotation runs in torch before the attention layer (layers/rotary.py);
- a bias on q/k/v (``attention_bias``, on in the released models) and none on o_proj;
- the checkpoint's MLP already fused as ``gate_up_proj`` (``[gate | up]``), which the fused
  layer splits by rank as it loads.

GLM-4-0414 (``Glm4``) adds a norm on the attention output and one on the MLP output, each before
its residual add (``post_self_attn_layernorm``, ``post_mlp_layernorm``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import torch

from ..layers import RotaryEmbedding, get_rope
from ..layers.rotary import partial_rotary_factor
from ..model_config import ModelConfig
from .gemma import GemmaSandwichLayer
from .llama import LlamaForCausalLM, LlamaVariant, WeightTarget


class GlmForCausalLM(LlamaForCausalLM):
    """GLM-4 (transformers' ``Glm``) causal LM."""

    @staticmethod
    def rope(config: ModelConfig, rope_scaling_factor: float, max_position: int | None) -> RotaryEmbedding:
        """Half of each head rotated (transformers' GLM default), in interleaved pairs."""
        return get_rope(config, rope_scaling_factor, max_position,
                        partial_rotary_factor(config, default=0.5), interleaved=True)

    @staticmethod
    def attention_biases(config: ModelConfig) -> tuple[bool, bool]:
        """``attention_bias`` is q/k/v's; o_proj has none."""
        return config.attention_bias, False


# GLM-4-0414's checkpoint names of the sandwich block's norms -> the block's own (Gemma 2's):
# its ``post_attention_layernorm`` is the norm *before* the MLP.
_GLM4_NORMS = {"post_self_attn_layernorm": "post_attention_layernorm",
               "post_attention_layernorm": "pre_feedforward_layernorm",
               "post_mlp_layernorm": "post_feedforward_layernorm"}


class Glm4ForCausalLM(GlmForCausalLM):
    """GLM-4-0414 causal LM: GLM with the attention and MLP outputs normed."""

    @staticmethod
    def variant(config: ModelConfig) -> LlamaVariant:
        """GLM's computation in the sandwich-norm block (layers/ Gemma 2's ``GemmaSandwichLayer``)."""
        return replace(LlamaForCausalLM.variant(config), decoder_layer=GemmaSandwichLayer)

    def map_weight(self, name: str, tensor: torch.Tensor) -> Iterator[WeightTarget]:
        """GLM's mapping, with the sandwich norms renamed to the block's."""
        parts = name.split(".")
        if len(parts) > 1 and parts[-2] in _GLM4_NORMS:
            parts[-2] = _GLM4_NORMS[parts[-2]]
            name = ".".join(parts)
        yield from super().map_weight(name, tensor)
