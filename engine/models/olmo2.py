"""OLMo 2: Llama's projections and MLP with the norms moved.

- q and k are RMSNormed over the whole projection (``q_norm`` ``[heads * head_dim]``,
  ``k_norm`` ``[kv_heads * head_dim]``; layers/qk_norm.py, ``full``) before rotary.
- The block normalises the *outputs* of attention and of the MLP before each residual add
  (``post_attention_layernorm``, ``post_feedforward_layernorm``); nothing normalises their
  inputs (no ``input_layernorm``).

The full-projection q/k norm takes its mean over every head, which a tensor-parallel rank does
not hold: OLMo 2 runs at tp=1 (tp>1 is refused before any rank starts: model_registry.SINGLE_RANK_ONLY).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from ...protocol.errors import UnsupportedModelError
from ..layers import RMSNorm, RotaryEmbedding
from ..model_config import ModelConfig
from .llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaVariant, hands_over_int8


class Olmo2DecoderLayer(nn.Module):
    """``x += norm(attn(x)); x += norm(mlp(x))``, with Llama's residual hand-over (the pair
    returned sums to the hidden state; the model's final norm adds them)."""

    def __init__(
        self, config: ModelConfig, rotary: RotaryEmbedding, qkv_bias: bool, o_bias: bool, mlp_bias: bool,
        variant: LlamaVariant | None = None, layer_idx: int = 0,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary, qkv_bias, o_bias, variant, layer_idx)
        self.mlp = LlamaMLP(config, mlp_bias, variant)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (the MLP's normed output, the hidden state before it); their sum is the block's output."""
        if residual is not None:
            hidden = hidden + residual
        hidden = hidden + self.post_attention_layernorm(self.self_attn(positions, hidden))
        return self.post_feedforward_layernorm(self.mlp(hidden)), hidden


class Olmo2ForCausalLM(LlamaForCausalLM):
    """OLMo 2 dense causal LM."""

    def __init__(self, config: ModelConfig, *args, **kwargs) -> None:
        if hands_over_int8(config):
            # Its linears read un-normed hidden states: W8A8's int8 hand-over from a norm has no norm to do it.
            raise UnsupportedModelError("W8A8 OLMo 2 checkpoints are not supported; use the 16-bit weights")
        super().__init__(config, *args, **kwargs)

    @staticmethod
    def variant(config: ModelConfig) -> LlamaVariant:
        """Llama's computation with full-projection q/k norms and the post-norm block."""
        return replace(LlamaForCausalLM.variant(config), qk_norm="full", decoder_layer=Olmo2DecoderLayer)
