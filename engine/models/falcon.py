"""Falcon (``FalconForCausalLM``; the older ``RWForCausalLM`` checkpoints, model_type
``RefinedWebModel`` / ``RefinedWeb``, load the same way).

Three block layouts, as config.json says:

- Falcon-7B: attention and MLP side by side on one input LayerNorm (``parallel_attn``),
  ``x + attn(ln(x)) + mlp(ln(x))``; multi-query (``multi_query``: one kv head, which tensor
  parallel replicates on every rank as QKVLinear does for any GQA model with fewer kv heads
  than ranks); ``query_key_value`` rows ``[q | k | v]``.
- Falcon-40B/180B (``new_decoder_architecture``): grouped kv heads (``num_kv_heads``, older
  configs ``n_head_kv``), two LayerNorms side by side (``ln_attn``, ``ln_mlp``; one when
  ``num_ln_in_parallel_attn`` is 1, as Falcon2-11B), and ``query_key_value`` rows grouped per kv
  head: ``[q_0 .. q_{G-1}, k, v]`` for each group. The loader unpacks them into q, k and v, which
  the fused layer then splits by rank.
- Neither (``multi_query`` false): every head its own kv head, rows ``[q, k, v]`` per head (the
  grouped layout with groups of one); with ``parallel_attn`` false the block is sequential
  (``post_attention_layernorm`` before the MLP), as falcon-rw's.

RoPE over the whole head, a GELU MLP (``dense_h_to_4h`` / ``dense_4h_to_h``), biases everywhere
when ``bias``, a final LayerNorm (``ln_f``) and, by default, a tied LM head.

ALiBi (``alibi``: falcon-rw-1b/7b) replaces RoPE: no rotation, and head h adds
``slope_h * k / sqrt(head_dim)`` to its score of key k (Falcon adds the bias before the
``1/sqrt(head_dim)`` scale, so the attention layer gets BLOOM's slopes divided by it; its code
also rounds the slopes to bfloat16 first, which changes nothing for the power-of-two head
counts of the released models). Each tensor-parallel rank takes its own heads' slopes.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ...kernels.attention import alibi_slopes
from ...protocol.errors import UnsupportedModelError
from ..distributed import shard_range, tp_group
from ..layers import Attention, DenseMLP, LayerNorm, RotaryEmbedding, get_rope
from ..model_config import ModelConfig
from ..weight_loader import materialize
from .internlm2 import unpack_wqkv
from .llama import LlamaAttention, LlamaForCausalLM, LlamaVariant, WeightTarget, linear_method
from .starcoder2 import refuse_int8_hand_over

# Falcon name fragment -> ours, applied in order where each occurs.
_RENAMES: tuple[tuple[str, str], ...] = (
    ("transformer.word_embeddings.", "model.embed_tokens."),
    ("transformer.ln_f.", "model.norm."),
    ("transformer.h.", "model.layers."),
    (".self_attention.query_key_value.", ".self_attn.qkv_proj."),
    (".self_attention.dense.", ".self_attn.o_proj."),
    (".mlp.dense_h_to_4h.", ".mlp.up_proj."),
    (".mlp.dense_4h_to_h.", ".mlp.down_proj."),
)


def new_decoder_architecture(raw: dict[str, Any]) -> bool:
    """Falcon-40B/180B's layout (the old ``RefinedWeb`` model type is always it)."""
    return bool(raw.get("new_decoder_architecture")) or raw.get("model_type") == "RefinedWeb"


def falcon_alibi_slopes(config: ModelConfig) -> torch.Tensor:
    """This rank's heads' ALiBi slopes as Falcon applies them: BLOOM's slopes rounded to bfloat16
    (as its code does) and divided by ``sqrt(head_dim)`` (its bias is added before the scale)."""
    tp = tp_group()
    first, count = shard_range(config.num_heads, tp.rank, tp.size, "num_attention_heads")
    slopes = alibi_slopes(config.num_heads).bfloat16().float() / math.sqrt(config.head_dim)
    return slopes[first : first + count]


def norms_in_parallel(raw: dict[str, Any]) -> int:
    """How many LayerNorms the block has before attention and MLP side by side (0: sequential)."""
    if new_decoder_architecture(raw):
        return int(raw.get("num_ln_in_parallel_attn") or 2)
    return 1 if raw.get("parallel_attn", True) else 0


class FalconDecoderLayer(nn.Module):
    """One Falcon block, parallel (one or two input norms) or sequential; the pair returned
    sums to the hidden state, as Llama's blocks hand it over."""

    def __init__(
        self, config: ModelConfig, rotary: RotaryEmbedding, qkv_bias: bool, o_bias: bool, mlp_bias: bool,
        variant: LlamaVariant | None = None, layer_idx: int = 0,
    ) -> None:
        super().__init__()
        variant = variant or LlamaVariant()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = LlamaAttention(config, rotary, qkv_bias, o_bias, variant, layer_idx)
        if config.raw.get("alibi"):  # positions through ALiBi slopes (the rotary rotates nothing)
            attn = self.self_attn
            attn.attn = Attention(attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                  alibi_slopes=falcon_alibi_slopes(config))
        self.mlp = DenseMLP(hidden, config.intermediate_size, variant.hidden_act, mlp_bias,
                            linear_method(config), linear_method(config))
        self.norms = norms_in_parallel(config.raw)
        if self.norms == 2:
            self.ln_attn, self.ln_mlp = LayerNorm(hidden, eps), LayerNorm(hidden, eps)
        else:
            self.input_layernorm = LayerNorm(hidden, eps)
            if self.norms == 0:
                self.post_attention_layernorm = LayerNorm(hidden, eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this block's additions, the hidden state before them)."""
        first = self.ln_attn if self.norms == 2 else self.input_layernorm
        if residual is None:
            residual = hidden
            attn_in = first(hidden)
        else:
            attn_in, residual = first(hidden, residual)
        if self.norms == 0:  # sequential: the MLP reads the state after attention's add
            hidden, residual = self.post_attention_layernorm(self.self_attn(positions, attn_in), residual)
            return self.mlp(hidden), residual
        mlp_in = self.ln_mlp(residual) if self.norms == 2 else attn_in
        # Two all-reduces under tensor parallel (o_proj's and down_proj's); summing the partial
        # outputs first and reducing once is the cheaper path for later.
        return self.self_attn(positions, attn_in) + self.mlp(mlp_in), residual


class FalconForCausalLM(LlamaForCausalLM):
    """Falcon causal LM (7B, 40B, 180B, Falcon2-11B layouts)."""

    def __init__(self, config: ModelConfig, *args, **kwargs) -> None:
        refuse_int8_hand_over(config, "Falcon")
        if self.grouped_qkv(config) and config.quant is not None:
            # Unpacking the per-group rows of a packed (AWQ) or int8 tensor is not written.
            raise UnsupportedModelError("quantized Falcon checkpoints with grouped query_key_value rows "
                                        "(new_decoder_architecture, or multi_query=false) are not supported")
        super().__init__(config, *args, **kwargs)
        self.model.norm = LayerNorm(config.hidden_size, config.rms_norm_eps)  # ln_f

    @staticmethod
    def rope(config: ModelConfig, rope_scaling_factor: float, max_position: int | None) -> RotaryEmbedding:
        """RoPE over whole heads; none (a rotary of no dims) where ALiBi gives the positions."""
        if config.raw.get("alibi"):
            return get_rope(config, rope_scaling_factor, max_position, partial_rotary_factor=0.0)
        return get_rope(config, rope_scaling_factor, max_position)

    @staticmethod
    def grouped_qkv(config: ModelConfig) -> bool:
        """Whether ``query_key_value`` rows come per kv group (all but Falcon-7B's multi-query layout)."""
        return new_decoder_architecture(config.raw) or not config.raw.get("multi_query", True)

    @staticmethod
    def attention_biases(config: ModelConfig) -> tuple[bool, bool]:
        """``bias`` covers query_key_value and dense (ModelConfig reads it as attention_bias)."""
        return config.attention_bias, config.attention_bias

    @staticmethod
    def mlp_bias(config: ModelConfig) -> bool:
        """``bias`` covers the MLP too."""
        return config.attention_bias

    @staticmethod
    def variant(config: ModelConfig) -> LlamaVariant:
        """``activation`` (GELU unless said) in Falcon's block; no sliding window."""
        return LlamaVariant(hidden_act=config.raw.get("activation", "gelu"), decoder_layer=FalconDecoderLayer)

    @staticmethod
    def ties_embeddings(config: ModelConfig) -> bool:
        """Tied unless config.json unties it (transformers' default for Falcon)."""
        return bool(config.raw.get("tie_word_embeddings", True))

    def map_weight(self, name: str, tensor: torch.Tensor) -> Iterator[WeightTarget]:
        """Falcon names -> ours; grouped ``query_key_value`` rows unpacked into the q/k/v shards."""
        for old, new in _RENAMES:
            name = name.replace(old, new)
        if ".self_attn.qkv_proj." in name and self.grouped_qkv(self.config):
            cfg = self.config
            q, k, v = unpack_wqkv(materialize(tensor), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
            yield from ((name, "q", q), (name, "k", k), (name, "v", v))
            return
        yield name, None, tensor


class RWForCausalLM(FalconForCausalLM):
    """The architecture name of Falcon checkpoints saved before transformers had Falcon."""
