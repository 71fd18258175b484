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

from dataclasses import replace

import torch
from torch import nn

from ..layers import RMSNorm, RotaryEmbedding, get_rope
from ..layers.rotary import partial_rotary_factor
from ..model_config import ModelConfig
from .llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaVariant, hands_over_int8


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


class Glm4DecoderLayer(nn.Module):
    """``x += norm(attn(norm(x))); x += norm(mlp(norm(x)))``, with Llama's residual hand-over:
    the pair returned sums to the hidden state, and the next pre-norm adds them."""

    def __init__(
        self, config: ModelConfig, rotary: RotaryEmbedding, qkv_bias: bool, o_bias: bool, mlp_bias: bool,
        variant: LlamaVariant | None = None, layer_idx: int = 0,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary, qkv_bias, o_bias, variant, layer_idx)
        self.mlp = LlamaMLP(config, mlp_bias, variant)
        hidden, eps, quantize = config.hidden_size, config.rms_norm_eps, hands_over_int8(config)
        self.input_layernorm = RMSNorm(hidden, eps, quantize)
        self.post_attention_layernorm = RMSNorm(hidden, eps, quantize)
        # These two read the attention / MLP output and feed the residual add: never int8.
        self.post_self_attn_layernorm = RMSNorm(hidden, eps)
        self.post_mlp_layernorm = RMSNorm(hidden, eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (the MLP's normed output, the hidden state before it)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_self_attn_layernorm(self.self_attn(positions, hidden))
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.post_mlp_layernorm(self.mlp(hidden)), residual


class Glm4ForCausalLM(GlmForCausalLM):
    """GLM-4-0414 causal LM: GLM with the attention and MLP outputs normed."""

    @staticmethod
    def variant(config: ModelConfig) -> LlamaVariant:
        """GLM's computation in the sandwich-norm block."""
        return replace(LlamaForCausalLM.variant(config), decoder_layer=Glm4DecoderLayer)
