"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head q/k RMSNorm, no
bias) with Qwen2-MoE's sparse blocks minus the shared expert; the top-k weights are
renormalised (``norm_topk_prob``, True in the releases). ``mlp_only_layers`` /
``decoder_sparse_step`` pick dense layers as in Qwen2-MoE (none in the releases)."""

from __future__ import annotations

from dataclasses import replace

from ..model_config import ModelConfig
from .llama import LlamaVariant
from .mixtral import MixtralForCausalLM
from .qwen2_moe import Qwen2MoeDecoderLayer


class Qwen3MoeDecoderLayer(Qwen2MoeDecoderLayer):
    """No shared expert; renormalised top-k unless the config says otherwise."""

    shared_expert = False
    norm_topk_default = True


class Qwen3MoeForCausalLM(MixtralForCausalLM):
    """Qwen3-MoE causal LM."""

    layer_class = Qwen3MoeDecoderLayer
    expert_names = ("gate_proj", "up_proj", "down_proj")

    @staticmethod
    def attention_biases(config: ModelConfig) -> tuple[bool, bool]:
        """``attention_bias`` covers q/k/v and o_proj, as in Qwen3 (off in the releases)."""
        return config.attention_bias, config.attention_bias

    @classmethod
    def variant(cls, config: ModelConfig) -> LlamaVariant:
        """Mixtral's (the MoE layer class, windows from the config) plus per-head q/k RMSNorm."""
        return replace(super().variant(config), qk_norm="per_head")
