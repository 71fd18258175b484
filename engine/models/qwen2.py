"""Qwen2: the Llama layout with biased q/k/v projections (and an unbiased o_proj)."""

from __future__ import annotations

from ..model_config import ModelConfig
from .llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5 causal LM."""

    @staticmethod
    def attention_biases(config: ModelConfig) -> tuple[bool, bool]:
        """q/k/v always carry a bias in Qwen2; o_proj never does."""
        return True, False
