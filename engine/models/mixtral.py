"""Mixtral: Llama's attention (and Mistral's sliding window, from the config) with a sparse MoE
block in place of the MLP; also the decoder layer the Qwen MoE families reuse.

Checkpoint names: ``block_sparse_moe.gate`` (router) and ``block_sparse_moe.experts.{e}.w1`` /
``w3`` / ``w2`` (gate / up / down), or transformers 5's in-memory ``mlp.gate`` and stacked
``mlp.experts.gate_up_proj`` / ``down_proj``; both load into ``mlp`` (layers/moe.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import torch
from torch import nn

from ..layers import RMSNorm, RotaryEmbedding
from ..layers.moe import SparseMoeBlock, map_expert_weight
from ..model_config import ModelConfig
from .llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaVariant,
    WeightTarget,
    hands_over_int8,
)


class MoeDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm block (its forward and constructor arguments) whose ``mlp`` is what
    ``build_mlp`` gives for the layer: a family says which layers are sparse and how they route."""

    def __init__(
        self, config: ModelConfig, rotary: RotaryEmbedding, qkv_bias: bool, o_bias: bool, mlp_bias: bool,
        variant: LlamaVariant | None = None, layer_idx: int = 0,
    ) -> None:
        # Not LlamaDecoderLayer.__init__: it would allocate a dense MLP of intermediate_size
        # (Mixtral's 14336) per layer only to drop it.
        nn.Module.__init__(self)
        variant = variant or LlamaVariant()
        self.self_attn = LlamaAttention(config, rotary, qkv_bias, o_bias, variant, layer_idx)
        self.mlp = self.build_mlp(config, layer_idx, variant)
        quantize, offset = hands_over_int8(config), variant.norm_weight_offset
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, quantize, offset)
        # Under W8A8 a sparse block's router reads the normed rows in 16 bits: the experts (and a
        # shared expert) quantize them themselves. A dense layer's MLP takes them as int8.
        quantize_mlp = quantize and not isinstance(self.mlp, SparseMoeBlock)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, quantize_mlp, offset)

    @staticmethod
    def build_mlp(config: ModelConfig, layer_idx: int, variant: LlamaVariant) -> nn.Module:
        """Mixtral: every layer sparse, top-k weights renormalised, no shared expert."""
        return SparseMoeBlock(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                              config.intermediate_size, renormalize=True, activation=variant.hidden_act,
                              quant=config.quant)


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral causal LM (Mixtral-8x7B / 8x22B)."""

    layer_class: type[MoeDecoderLayer] = MoeDecoderLayer
    # Each expert's (gate, up, down) names in the checkpoint.
    expert_names = ("w1", "w3", "w2")

    @classmethod
    def variant(cls, config: ModelConfig) -> LlamaVariant:
        """Llama's (hidden_act, the config's sliding window on every layer) with the MoE block."""
        return replace(LlamaForCausalLM.variant(config), decoder_layer=cls.layer_class)

    def map_weight(self, name: str, tensor: torch.Tensor) -> Iterator[WeightTarget]:
        """Expert tensors into the stacked ``w13`` / ``w2``; the rest as Llama maps them."""
        name = name.replace(".block_sparse_moe.", ".mlp.")
        experts = map_expert_weight(name, tensor, *self.expert_names)
        if experts is not None:
            return experts
        return super().map_weight(name, tensor)
