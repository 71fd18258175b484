"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (biased q/k/v) with sparse MoE
blocks that add a shared expert, scaled per token by ``sigmoid(shared_expert_gate(x))``.

Layer ``i`` is sparse unless it is in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step``
is not 0; the others are dense MLPs of ``intermediate_size``. Experts are ``moe_intermediate_size``
wide, the shared expert ``shared_expert_intermediate_size``. The top-k weights are renormalised
only with ``norm_topk_prob`` (False in Qwen1.5-MoE).
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from ..layers.moe import SparseMoeBlock
from ..model_config import ModelConfig
from .llama import LlamaMLP, LlamaVariant
from .mixtral import MixtralForCausalLM, MoeDecoderLayer


def is_sparse(config: ModelConfig, layer_idx: int) -> bool:
    """Whether layer ``layer_idx`` is a MoE block (transformers' rule for Qwen2/Qwen3-MoE)."""
    step = int(config.raw.get("decoder_sparse_step", 1) or 1)
    return (layer_idx not in (config.raw.get("mlp_only_layers") or []) and config.num_experts > 0
            and (layer_idx + 1) % step == 0)


class Qwen2MoeDecoderLayer(MoeDecoderLayer):
    """Sparse blocks with a gated shared expert; dense MLPs where the config says."""

    shared_expert = True
    norm_topk_default = False

    @classmethod
    def build_mlp(cls, config: ModelConfig, layer_idx: int, variant: LlamaVariant) -> nn.Module:
        """The dense MLP or the sparse block of layer ``layer_idx``."""
        raw = config.raw
        if not is_sparse(config, layer_idx):
            return LlamaMLP(config, bias=False, variant=variant)
        shared = None
        if cls.shared_expert and raw.get("shared_expert_intermediate_size"):
            # The family's gated MLP at the shared expert's width (split over the ranks like any MLP).
            shared = LlamaMLP(replace(config, intermediate_size=raw["shared_expert_intermediate_size"]),
                              bias=False, variant=variant)
        return SparseMoeBlock(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                              raw["moe_intermediate_size"], renormalize=bool(raw.get("norm_topk_prob",
                                                                                     cls.norm_topk_default)),
                              activation=variant.hidden_act, shared_expert=shared, shared_gate=shared is not None,
                              quant=config.quant)


class Qwen2MoeForCausalLM(MixtralForCausalLM):
    """Qwen2-MoE causal LM."""

    layer_class = Qwen2MoeDecoderLayer
    expert_names = ("gate_proj", "up_proj", "down_proj")

    @staticmethod
    def attention_biases(config: ModelConfig) -> tuple[bool, bool]:
        """q/k/v carry a bias (``qkv_bias``, on in every release); o_proj never does."""
        return bool(config.raw.get("qkv_bias", True)), False
