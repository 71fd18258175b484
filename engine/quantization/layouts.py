"""Which decoder layouts the quantization tools know, by ``config.json``'s ``model_type``.

Both tools fold per-channel scales into the norm before a group of linears (``scale_groups``),
so they must know, per family, which norm feeds the attention's q/k/v and which the MLP's
gate/up, and how the norm applies its weight. Every family here has Llama's linear names
(``self_attn.q/k/v/o_proj``, ``mlp.gate/up/down_proj``) in transformers; q/k norms after the
projections (Qwen3, Gemma 3) act on their outputs and are untouched by input-channel scales.

The mixture-of-experts families (``moe.py``; both tools) hold their experts stacked in transformers
(``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]); ``experts`` names
each expert's (gate, up, down) projection in the published checkpoints, under ``moe_prefix``
(Mixtral's ``block_sparse_moe``, the Qwen MoE families' ``mlp``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DecoderLayout:
    """The norms of one family's decoder layer, by module name, and their weight offset."""

    attn_norm: str = "input_layernorm"
    mlp_norm: str = "post_attention_layernorm"
    # Gemma's RMSNorm scales by ``offset + weight`` (offset 1): a scale folds into that sum.
    norm_offset: float = 0.0
    # transformers' attention for calibration: SDPA, or eager where transformers has no SDPA path.
    attention: str = "sdpa"
    # Mixture-of-experts families: each expert's published (gate, up, down) names, and the MoE block's.
    experts: tuple[str, str, str] | None = None
    moe_prefix: str = "mlp"


_LLAMA = DecoderLayout()
_GEMMA = DecoderLayout(norm_offset=1.0)
# Gemma 2 and 3 norm each block's output too ("sandwich" norms): post_attention_layernorm acts on
# o_proj's output, and the MLP reads pre_feedforward_layernorm's.
_GEMMA_SANDWICH = DecoderLayout(mlp_norm="pre_feedforward_layernorm", norm_offset=1.0)

LAYOUTS: dict[str, DecoderLayout] = {
    "llama": _LLAMA, "mistral": _LLAMA, "qwen2": _LLAMA, "qwen3": _LLAMA, "internlm3": _LLAMA,
    "gemma": _GEMMA,
    # transformers runs Gemma 2's soft-capped attention eagerly only.
    "gemma2": DecoderLayout(mlp_norm="pre_feedforward_layernorm", norm_offset=1.0, attention="eager"),
    "gemma3_text": _GEMMA_SANDWICH,
    "mixtral": DecoderLayout(experts=("w1", "w3", "w2"), moe_prefix="block_sparse_moe"),
    "qwen2_moe": DecoderLayout(experts=("gate_proj", "up_proj", "down_proj")),
    "qwen3_moe": DecoderLayout(experts=("gate_proj", "up_proj", "down_proj")),
}
