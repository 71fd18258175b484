"""Phi-3: the Llama computation with checkpoints that already fuse ``qkv_proj`` and
``gate_up_proj`` (rows ``[q | k | v]`` and ``[gate | up]``, the engine's own order), which the
fused layers' loaders split by rank as they load. RoPE is the default one for the 4k models and
``longrope`` (once spelled ``su``) for the 128k ones (``engine/layers/rotary.py``).

Phi-4-mini is the same architecture with ``partial_rotary_factor`` 0.75: RoPE (longrope there)
turns the first ``int(head_dim * factor)`` dims of each head, halves paired as in Llama, and the
rest pass through; that rotation runs in torch before the attention layer (layers/rotary.py).

Phi-3's ``sliding_window`` (2047 on the 4k models) applies to every layer, as Mistral v0.1's does.
"""

from __future__ import annotations

from ..layers import RotaryEmbedding, get_rope
from ..layers.rotary import partial_rotary_factor
from ..model_config import ModelConfig
from .llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 / Phi-3.5 / Phi-4-mini causal LM."""

    @staticmethod
    def rope(config: ModelConfig, rope_scaling_factor: float, max_position: int | None) -> RotaryEmbedding:
        """RoPE over the config's share of each head (all of it but on Phi-4-mini)."""
        return get_rope(config, rope_scaling_factor, max_position, partial_rotary_factor(config))

    @staticmethod
    def attention_biases(config: ModelConfig) -> tuple[bool, bool]:
        """Phi-3's projections carry no biases."""
        return False, False
