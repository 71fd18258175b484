"""InternLM3: Llama's tensor names and computation; its bias flags are spelled differently.

config.json says ``qkv_bias`` (q/k/v and o_proj) and ``bias`` (the MLP); transformers reads
them as ``attention_bias`` / ``mlp_bias`` (and refuses them unequal), so both spellings are
read here. ``head_dim`` comes from the config (128), not hidden/heads.
"""

from __future__ import annotations

from ...protocol.errors import UnsupportedModelError
from ..model_config import ModelConfig
from .llama import LlamaForCausalLM


def _flag(config: ModelConfig, *names: str) -> bool:
    return bool(next((config.raw[n] for n in names if config.raw.get(n) is not None), False))


class InternLM3ForCausalLM(LlamaForCausalLM):
    """InternLM3 dense causal LM (internlm3-8b-instruct)."""

    @staticmethod
    def attention_biases(config: ModelConfig) -> tuple[bool, bool]:
        """``qkv_bias`` (transformers: ``attention_bias``) covers q/k/v and o_proj."""
        bias = _flag(config, "qkv_bias", "attention_bias")
        if bias != _flag(config, "bias", "mlp_bias"):
            # transformers refuses this too: its InternLM3 is Llama's code, one flag per kind.
            raise UnsupportedModelError("InternLM3 with qkv_bias different from bias is not supported")
        return bias, bias

    @staticmethod
    def mlp_bias(config: ModelConfig) -> bool:
        """``bias`` (transformers: ``mlp_bias``) covers gate/up/down."""
        return _flag(config, "bias", "mlp_bias")
