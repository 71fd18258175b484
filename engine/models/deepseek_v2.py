"""DeepSeek-V2 (and V2-Lite, V2.5): multi-head latent attention (``layers/mla.py``) in Llama's
pre-norm block, with DeepSeek's MoE block on the sparse layers (``models/deepseek.py``).

The attention caches one latent row a token (``kv_cache_spec``); its rotary dims pair adjacent
values (transformers' complex rotation, DeepSeek's own code permutes them into halves first: the
same scores) and, with YaRN, the softmax scale carries ``mscale(factor, mscale_all_dim) ** 2``.
Checkpoint names are transformers' and DeepSeek's (``self_attn.kv_a_proj_with_mqa`` ...); the
MLP's ``gate_proj`` / ``up_proj`` load into Llama's fused ``gate_up_proj``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import torch
from torch import nn

from ...kernels.kv_layout import KVCacheSpec
from ...protocol.errors import UnsupportedModelError
from ..layers import RMSNorm, RotaryEmbedding, get_rope
from ..layers.mla import MLAttention, yarn_softmax_scale
from ..model_config import ModelConfig
from .deepseek import build_deepseek_mlp, map_deepseek_mlp_weight
from .llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaVariant, WeightTarget, hands_over_int8


def mla_dims(config: ModelConfig) -> tuple[int, int, int, int, int | None]:
    """(kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, q_lora_rank) from config.json."""
    raw = config.raw
    try:
        return (int(raw["kv_lora_rank"]), int(raw["qk_nope_head_dim"]), int(raw["qk_rope_head_dim"]),
                int(raw["v_head_dim"]), raw.get("q_lora_rank"))
    except KeyError as exc:
        raise UnsupportedModelError(f"{config.architecture}: config.json lacks {exc.args[0]!r}, which multi-head "
                                    "latent attention needs") from exc


class DeepseekV2Attention(MLAttention):
    """MLA with its sizes from the config, in the decoder block's attention signature."""

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, qkv_bias: bool, o_bias: bool,
                 variant: LlamaVariant | None = None, layer_idx: int = 0) -> None:
        kv_lora, nope, rope, v, q_lora = mla_dims(config)
        super().__init__(config.hidden_size, config.num_heads, kv_lora, nope, rope, v, rotary,
                         yarn_softmax_scale(nope + rope, config.rope_scaling), config.rms_norm_eps,
                         q_lora_rank=q_lora, bias=config.attention_bias)


class DeepseekV2DecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm block (its forward) around MLA, with ``build_deepseek_mlp``'s MLP: dense
    (``intermediate_size``) before ``first_k_dense_replace``, DeepSeek's MoE block on the sparse
    layers (V2's ``routed_scaling_factor`` and ``group_limited_greedy`` included)."""

    def __init__(
        self, config: ModelConfig, rotary: RotaryEmbedding, qkv_bias: bool, o_bias: bool, mlp_bias: bool,
        variant: LlamaVariant | None = None, layer_idx: int = 0,
    ) -> None:
        # Not LlamaDecoderLayer.__init__: a sparse layer would allocate a dense MLP only to drop it.
        nn.Module.__init__(self)
        variant = variant or LlamaVariant()
        self.self_attn = DeepseekV2Attention(config, rotary, qkv_bias, o_bias, variant, layer_idx)
        self.mlp = build_deepseek_mlp(config, layer_idx, variant)
        quantize = hands_over_int8(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, quantize)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, quantize)


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    """DeepSeek-V2 causal LM (``DeepseekV2ForCausalLM``, model_type ``deepseek_v2``)."""

    # q/k/v are MLA's own projections, loaded by their names; only the MLPs' gate/up are fused.
    stacked_params = (("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))

    @staticmethod
    def kv_cache_spec(config: ModelConfig) -> KVCacheSpec:
        """One latent row a token and layer, ``[c_kv, rope(k_pe)]``, as one kv head; the values
        are its first ``kv_lora_rank`` columns (no value cache)."""
        kv_lora, _, rope, _, _ = mla_dims(config)
        return KVCacheSpec(1, kv_lora + rope, kv_lora, shares_v=True)

    @staticmethod
    def rope(config: ModelConfig, rope_scaling_factor: float, max_position: int | None) -> RotaryEmbedding:
        """RoPE over the ``qk_rope_head_dim`` dims of q_pe and k_pe, adjacent dims paired."""
        rope_dim = mla_dims(config)[2]
        return get_rope(replace(config, head_dim=rope_dim), rope_scaling_factor, max_position, interleaved=True)

    @classmethod
    def variant(cls, config: ModelConfig) -> LlamaVariant:
        """Llama's (the MLP's ``hidden_act``) with DeepSeek's block; MLA has no sliding window."""
        return replace(LlamaForCausalLM.variant(config), decoder_layer=DeepseekV2DecoderLayer, layer_windows=())

    def map_weight(self, name: str, tensor: torch.Tensor) -> Iterator[WeightTarget]:
        """Routed experts into the stacked ``w13`` / ``w2``, the shared experts and dense MLPs as
        Llama's gated MLP (``map_deepseek_mlp_weight``), MLA's projections by their own names."""
        name, experts = map_deepseek_mlp_weight(name, tensor)
        return experts if experts is not None else super().map_weight(name, tensor)
