"""InternLM (v1: internlm-7b, internlm-chat-7b, internlm-20b; remote code, ``model_type`` "internlm").

Llama's tensor names and computation (RMSNorm, SwiGLU, rotary), with one ``bias`` flag that
puts a bias on q, k, v and o_proj (the 7B models have it, the 20B ones not) and none on the MLP.
Its RoPE settings live in a ``rotary`` dict (``base``; ``type`` "origin" or "dynamic", dynamic NTK
with ``scaling_factor``), which ``model_config.py`` reads into rope_theta / rope_scaling.
"""

from __future__ import annotations

from ..model_config import ModelConfig
from .llama import LlamaForCausalLM


class InternLMForCausalLM(LlamaForCausalLM):
    """InternLM (v1) causal LM."""

    @staticmethod
    def attention_biases(config: ModelConfig) -> tuple[bool, bool]:
        """config.json's ``bias`` covers q/k/v and o_proj alike (model_config reads it into attention_bias)."""
        return config.attention_bias, config.attention_bias

    @staticmethod
    def mlp_bias(config: ModelConfig) -> bool:
        """The published code's MLP has no biases whatever ``bias`` says."""
        return False
