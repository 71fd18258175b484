"""StarCoder2: the Llama attention (GQA, full RoPE, q/k/v and o biases when ``use_bias``) in a
pre-norm block of LayerNorms with bias, a non-gated GELU MLP (``c_fc`` / ``c_proj``, biased),
a sliding window on every layer (``sliding_window``, engine/attention_windows.py) and, by
default, a tied LM head.

LayerNorm hands no int8 rows to a W8A8 linear (layers/layer_norm.py): W8A8 checkpoints are refused.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from ...protocol.errors import UnsupportedModelError
from ..layers import DenseMLP, LayerNorm, RotaryEmbedding
from ..model_config import ModelConfig
from .llama import (LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaVariant, WeightTarget, hands_over_int8,
                    linear_method)

# StarCoder2 name fragment -> ours.
_RENAMES = ((".mlp.c_fc.", ".mlp.up_proj."), (".mlp.c_proj.", ".mlp.down_proj."))


def refuse_int8_hand_over(config: ModelConfig, family: str) -> None:
    """W8A8 linears read int8 rows from the norm before them; LayerNorm does not make them."""
    if hands_over_int8(config):
        raise UnsupportedModelError(f"W8A8 {family} checkpoints are not supported (its LayerNorms hand no int8 "
                                    "rows to the linears); use the 16-bit or AWQ weights")


class Starcoder2DecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm block (its forward) over LayerNorms and a non-gated MLP."""

    def __init__(
        self, config: ModelConfig, rotary: RotaryEmbedding, qkv_bias: bool, o_bias: bool, mlp_bias: bool,
        variant: LlamaVariant | None = None, layer_idx: int = 0,
    ) -> None:
        nn.Module.__init__(self)  # LlamaDecoderLayer's forward over other norms and MLP
        variant = variant or LlamaVariant()
        self.self_attn = LlamaAttention(config, rotary, qkv_bias, o_bias, variant, layer_idx)
        self.mlp = DenseMLP(config.hidden_size, config.intermediate_size, variant.hidden_act, mlp_bias,
                            linear_method(config), linear_method(config))
        self.input_layernorm = LayerNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = LayerNorm(config.hidden_size, config.rms_norm_eps)


class Starcoder2ForCausalLM(LlamaForCausalLM):
    """StarCoder2 causal LM."""

    def __init__(self, config: ModelConfig, *args, **kwargs) -> None:
        refuse_int8_hand_over(config, "StarCoder2")
        super().__init__(config, *args, **kwargs)
        # The final norm is a LayerNorm with bias too (LlamaModel builds an RMSNorm there).
        self.model.norm = LayerNorm(config.hidden_size, config.rms_norm_eps)

    @staticmethod
    def attention_biases(config: ModelConfig) -> tuple[bool, bool]:
        """``use_bias`` covers q/k/v and o_proj (ModelConfig reads it as attention_bias)."""
        return config.attention_bias, config.attention_bias

    @staticmethod
    def mlp_bias(config: ModelConfig) -> bool:
        """``use_bias`` covers c_fc and c_proj too."""
        return config.attention_bias

    @staticmethod
    def variant(config: ModelConfig) -> LlamaVariant:
        """Llama's variant (``hidden_act``: gelu_pytorch_tanh; each layer's window) in the LayerNorm block."""
        variant = LlamaForCausalLM.variant(config)
        return LlamaVariant(hidden_act=variant.hidden_act, layer_windows=variant.layer_windows,
                            decoder_layer=Starcoder2DecoderLayer)

    @staticmethod
    def ties_embeddings(config: ModelConfig) -> bool:
        """Tied unless config.json unties it (transformers' default for StarCoder2)."""
        return bool(config.raw.get("tie_word_embeddings", True))

    def map_weight(self, name: str, tensor: torch.Tensor) -> Iterator[WeightTarget]:
        """``c_fc`` / ``c_proj`` -> the MLP's up/down projections; q/k/v as Llama's."""
        for old, new in _RENAMES:
            if old in name:
                yield name.replace(old, new), None, tensor
                return
        yield from super().map_weight(name, tensor)
