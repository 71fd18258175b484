"""Gemma (v1): the Llama layout with a GELU-tanh gated MLP, RMSNorms that scale by ``1 + weight``,
embeddings multiplied by ``sqrt(hidden_size)``, ``head_dim`` from the config (256 on Gemma-7B,
so ``heads * head_dim`` need not equal ``hidden_size``) and, by default, a tied LM head.

Gemma 2's sliding windows and logit soft-capping are not here (they need attention-kernel
arguments); its ``Gemma2ForCausalLM`` is not registered.
"""

from __future__ import annotations

from ..model_config import ModelConfig
from .llama import LlamaForCausalLM, LlamaVariant


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma causal LM."""

    @staticmethod
    def variant(config: ModelConfig) -> LlamaVariant:
        """GELU (tanh form), ``(1 + w)`` norms, ``sqrt(hidden)`` embedding scale."""
        # Gemma's released configs say hidden_act="gelu" but mean the tanh approximation
        # (transformers rewrites it the same way); newer ones say hidden_activation.
        act = config.raw.get("hidden_activation") or config.raw.get("hidden_act") or "gelu_pytorch_tanh"
        if act == "gelu":
            act = "gelu_pytorch_tanh"
        return LlamaVariant(hidden_act=act, norm_weight_offset=1.0, embed_scale=config.hidden_size**0.5)

    @staticmethod
    def ties_embeddings(config: ModelConfig) -> bool:
        """Gemma ties unless config.json says otherwise (its default, which configs may omit)."""
        return bool(config.raw.get("tie_word_embeddings", True))
