"""Qwen3: the Llama layout with an RMSNorm over each query and key head before rotary.

``self_attn.q_norm`` / ``self_attn.k_norm`` are ``[head_dim]`` scales (layers/qk_norm.py,
``per_head``); ``head_dim`` comes from the config (128 in every Qwen3, whatever hidden/heads
is). The projections carry a bias only when ``attention_bias`` says so (never, in the
released checkpoints), unlike Qwen2's always-biased q/k/v.
"""

from __future__ import annotations

from dataclasses import replace

from ..model_config import ModelConfig
from .llama import LlamaForCausalLM, LlamaVariant


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 dense causal LM."""

    @staticmethod
    def attention_biases(config: ModelConfig) -> tuple[bool, bool]:
        """``attention_bias`` covers q/k/v and o_proj, as in Llama."""
        return config.attention_bias, config.attention_bias

    @staticmethod
    def variant(config: ModelConfig) -> LlamaVariant:
        """Llama's computation plus per-head q/k RMSNorm."""
        return replace(LlamaForCausalLM.variant(config), qk_norm="per_head")
