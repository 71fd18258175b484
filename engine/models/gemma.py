"""Gemma (v1), Gemma 2 and Gemma 3 (text): the Llama layout with Gemma's changes.

- **Gemma**: a GELU-tanh gated MLP, RMSNorms that scale by ``1 + weight``, embeddings multiplied
  by ``sqrt(hidden_size)``, ``head_dim`` from the config (256 on Gemma-7B, so ``heads * head_dim``
  need not equal ``hidden_size``) and, by default, a tied LM head.
- **Gemma 2** adds the "sandwich" block (norms after attention and after the MLP too, before
  each residual add), a softmax scale of ``query_pre_attn_scalar ** -0.5``, attention scores and
  final logits soft-capped (``c * tanh(x / c)``), and sliding-window attention on every other
  layer (``engine/attention_windows.py``).
- **Gemma 3** (text; ``Gemma3ForCausalLM``) keeps Gemma 2's block and scale, caps only the final
  logits (and only if its config sets it; the published ones do not), norms q and k per head
  (``1 + weight`` again), slides on five layers of every six, and rotates the sliding layers
  with their own RoPE base (``rope_local_base_freq``, 10k) while the global layers take
  ``rope_theta`` (1M) and its scaling (linear x8 on 4B+).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ..layers import RMSNorm, RotaryEmbedding, get_rope
from ..model_config import ModelConfig
from .llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaVariant, hands_over_int8


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
        return replace(LlamaForCausalLM.variant(config), hidden_act=act, norm_weight_offset=1.0,
                       embed_scale=config.hidden_size**0.5)

    @staticmethod
    def ties_embeddings(config: ModelConfig) -> bool:
        """Gemma ties unless config.json says otherwise (its default, which configs may omit)."""
        return bool(config.raw.get("tie_word_embeddings", True))


class GemmaSandwichLayer(nn.Module):
    """Gemma 2/3's block: ``x += post_norm(attn(norm(x))); x += post_ff_norm(mlp(pre_ff_norm(x)))``,
    with Llama's residual hand-over (the pair returned sums to the hidden state)."""

    def __init__(
        self, config: ModelConfig, rotary: RotaryEmbedding, qkv_bias: bool, o_bias: bool, mlp_bias: bool,
        variant: LlamaVariant | None = None, layer_idx: int = 0,
    ) -> None:
        super().__init__()
        variant = variant or LlamaVariant()
        self.self_attn = LlamaAttention(config, rotary, qkv_bias, o_bias, variant, layer_idx)
        self.mlp = LlamaMLP(config, mlp_bias, variant)
        hidden, eps, offset = config.hidden_size, config.rms_norm_eps, variant.norm_weight_offset
        # The norms before attention and the MLP feed linears (int8 under W8A8); those after feed residual adds.
        quantize = hands_over_int8(config)
        self.input_layernorm = RMSNorm(hidden, eps, quantize, offset)
        self.post_attention_layernorm = RMSNorm(hidden, eps, weight_offset=offset)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, quantize, offset)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, weight_offset=offset)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (the MLP's normed output, the hidden state before it); their sum is the block's output."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma2ForCausalLM(GemmaForCausalLM):
    """Gemma 2 causal LM."""

    @staticmethod
    def variant(config: ModelConfig) -> LlamaVariant:
        """Gemma's, plus the sandwich block, the query scale and the soft-caps (None where unset)."""
        raw = config.raw
        scalar = raw.get("query_pre_attn_scalar") or config.head_dim
        return replace(
            GemmaForCausalLM.variant(config), decoder_layer=GemmaSandwichLayer, attn_scale=float(scalar) ** -0.5,
            attn_softcap=raw.get("attn_logit_softcapping"), final_softcap=raw.get("final_logit_softcapping"),
        )


def gemma3_ropes(raw: dict[str, Any]) -> dict[str, tuple[float, dict[str, Any] | None]]:
    """(base, scaling or None) of the global (``full_attention``) and the sliding layers' RoPE.

    transformers 5 writes one ``rope_parameters`` entry per layer type; the published configs say
    ``rope_theta`` + ``rope_scaling`` (global) and ``rope_local_base_freq`` (sliding)."""
    params = raw.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        out = {}
        for kind, default_base in (("full_attention", 1_000_000.0), ("sliding_attention", 10_000.0)):
            entry = dict(params.get(kind) or {})
            base = float(entry.pop("rope_theta", default_base))
            entry.setdefault("rope_type", entry.get("type", "default"))
            out[kind] = (base, entry if entry["rope_type"] != "default" else None)
        return out
    scaling = raw.get("rope_scaling")
    if scaling:
        scaling = dict(scaling)
        scaling.setdefault("rope_type", scaling.get("type", "default"))
    return {
        "full_attention": (float(raw.get("rope_theta", 1_000_000.0)), scaling or None),
        "sliding_attention": (float(raw.get("rope_local_base_freq", 10_000.0)), None),
    }


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 causal LM (the text model: Gemma-3-1B, or a text-only Gemma 3 checkpoint)."""

    def __init__(self, config: ModelConfig, rope_scaling_factor: float = 0.0, max_position: int | None = None) -> None:
        base, scaling = gemma3_ropes(config.raw)["full_attention"]
        super().__init__(replace(config, rope_theta=base, rope_scaling=scaling), rope_scaling_factor, max_position)

    @staticmethod
    def variant(config: ModelConfig) -> LlamaVariant:
        """Gemma 2's, plus per-head q/k RMSNorms that also scale by ``1 + weight``. The attention
        scores are never capped: Gemma 3 replaced the cap with the q/k norms, and transformers
        reads ``attn_logit_softcapping`` from its config without applying it (the final cap stays)."""
        return replace(Gemma2ForCausalLM.variant(config), qk_norm="per_head", qk_norm_offset=1.0, attn_softcap=None)

    @staticmethod
    def sliding_rotary(config: ModelConfig, rope_scaling_factor: float, max_position: int | None
                       ) -> RotaryEmbedding | None:
        """The sliding layers' RoPE: the local base, never the global layers' scaling."""
        base, scaling = gemma3_ropes(config.raw)["sliding_attention"]
        return get_rope(replace(config, rope_theta=base, rope_scaling=scaling), 0.0, max_position)
