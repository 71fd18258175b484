"""Phi-3: the Llama computation with checkpoints that already fuse ``qkv_proj`` and
``gate_up_proj`` (rows ``[q | k | v]`` and ``[gate | up]``, the engine's own order), which the
fused layers' loaders split by rank as they load. RoPE is the default one for the 4k models and
``longrope`` (once spelled ``su``) for the 128k ones (``engine/layers/rotary.py``).

Phi-3's ``sliding_window`` (2047 on the 4k models) applies to every layer, as Mistral v0.1's does.
"""

from __future__ import annotations

from ...protocol.errors import UnsupportedModelError
from ..model_config import ModelConfig
from .llama import LlamaForCausalLM


def partial_rotary_factor(config: ModelConfig) -> float:
    """The share of ``head_dim`` RoPE rotates (top level or in ``rope_parameters``); 1.0 if unset."""
    params = config.raw.get("rope_parameters") or {}
    return float(config.raw.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 1.0)


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 / Phi-3.5 causal LM (mini and medium)."""

    def __init__(self, config: ModelConfig, rope_scaling_factor: float = 0.0, max_position: int | None = None) -> None:
        if partial_rotary_factor(config) != 1.0:  # Phi-4-mini's layout; refused before any weight loads
            raise UnsupportedModelError(
                f"partial_rotary_factor={partial_rotary_factor(config)} (rotating part of each head, as "
                "Phi-4-mini does) is not supported"
            )
        super().__init__(config, rope_scaling_factor, max_position)

    @staticmethod
    def attention_biases(config: ModelConfig) -> tuple[bool, bool]:
        """Phi-3's projections carry no biases."""
        return False, False
