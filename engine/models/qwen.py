"""Qwen (v1: Qwen-1.8B/7B/14B/72B and their chats; remote code ``QWenLMHeadModel``, ``model_type`` "qwen").

The Llama computation (RMSNorm, rotary, SwiGLU, multi-head attention) under GPT-2-style names:

* ``transformer.wte`` / ``transformer.ln_f`` / ``lm_head``: embedding, final norm, head (untied);
* ``transformer.h.N.ln_1`` / ``ln_2``: the norms before attention and before the MLP;
* ``attn.c_attn``: q, k and v fused as rows ``[q | k | v]`` (the engine's own order), always
  with a bias; ``attn.c_proj``: o_proj, biased only when ``no_bias`` is false;
* ``mlp.w1`` / ``mlp.w2`` / ``mlp.c_proj``: the MLP computes ``c_proj(w1(x) * silu(w2(x)))``, so
  **w2 is the gate and w1 the up projection**; each is ``intermediate_size // 2`` wide (the
  config counts both), which model_config.py halves.

Long context. Qwen's code has two switches for sequences longer than its training length
``seq_length``; both leave every sequence up to ``seq_length`` tokens unchanged, where this file
equals it exactly:

* ``use_logn_attn``: queries past ``seq_length`` are scaled by ``log_{seq_length}(p + 1)``. That
  depends on the position alone and is applied here exactly (``layers/logn_scale.py``).
* ``use_dynamic_ntk``: Qwen picks one RoPE base for a whole sequence from its prompt's length
  (``base * alpha^(d/(d-2))``, ``alpha = 2^ceil(log2(len / seq_length) + 1) - 1``), so a token's
  rotation depends on how long the prompt was. A paged cache keeps one rotation per cached key,
  so past ``seq_length`` this file uses dynamic NTK per position instead (transformers' formula,
  factor 1 over ``seq_length``, LMDeploy's choice for Qwen): a close, not equal, continuation.
  Without ``use_dynamic_ntk`` positions past ``seq_length`` rotate with the plain base, as Qwen's.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator

import torch

from ...protocol.errors import UnsupportedModelError
from ..layers import RotaryEmbedding, get_rope
from ..layers.logn_scale import LogNScale
from ..model_config import ModelConfig
from .llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaVariant,
    WeightTarget,
)

logger = logging.getLogger(__name__)

# Qwen v1 name fragment -> (our name fragment, shard id or None: a whole or already-fused tensor).
_RENAMES: tuple[tuple[str, str, int | str | None], ...] = (
    ("transformer.wte.", "model.embed_tokens.", None),
    ("transformer.ln_f.", "model.norm.", None),
    (".attn.c_attn.", ".self_attn.qkv_proj.", None),  # rows [q | k | v]: the fused loader splits them per rank
    (".attn.c_proj.", ".self_attn.o_proj.", None),
    (".mlp.w2.", ".mlp.gate_up_proj.", 0),  # silu(w2(x)): the gate
    (".mlp.w1.", ".mlp.gate_up_proj.", 1),  # w1(x): the up projection
    (".mlp.c_proj.", ".mlp.down_proj.", None),
    (".ln_1.", ".input_layernorm.", None),
    (".ln_2.", ".post_attention_layernorm.", None),
    ("transformer.h.", "model.layers.", None),
)


def seq_length(config: ModelConfig) -> int:
    """The training length the long-context switches start past."""
    return int(config.raw.get("seq_length") or config.max_position_embeddings)


class QWenAttention(LlamaAttention):
    """Llama's attention with Qwen's log-n query scaling past ``seq_length``."""

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, qkv_bias: bool, o_bias: bool,
                 variant: LlamaVariant | None = None, layer_idx: int = 0) -> None:
        super().__init__(config, rotary, qkv_bias, o_bias, variant, layer_idx)
        if not rotary.fused:
            raise UnsupportedModelError("Qwen rotates whole heads in halves; this RoPE table is not that")
        self.logn = LogNScale(seq_length(config))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]."""
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.logn(q.view(-1, self.num_heads, self.head_dim), positions)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v, positions, self.rotary_emb.cos_sin_cache))


class QWenBlock(LlamaDecoderLayer):
    """Llama's pre-norm block around ``QWenAttention`` (used when ``use_logn_attn`` is on)."""

    attention_class = QWenAttention


class QWenLMHeadModel(LlamaForCausalLM):
    """Qwen (v1) causal LM."""

    def __init__(self, config: ModelConfig, rope_scaling_factor: float = 0.0, max_position: int | None = None) -> None:
        self._check_supported(config)
        super().__init__(config, rope_scaling_factor, max_position)
        if config.raw.get("use_dynamic_ntk") or config.raw.get("use_logn_attn"):
            logger.info("Qwen: equal to its reference code up to seq_length=%s tokens; past it log-n attention "
                        "is exact and dynamic NTK per position (Qwen's picks one base per prompt)",
                        seq_length(config))

    @staticmethod
    def rope(config: ModelConfig, rope_scaling_factor: float, max_position: int | None) -> RotaryEmbedding:
        """Plain RoPE up to seq_length; past it dynamic NTK (see the module docstring), or the
        engine's rope_scaling_factor, counted from seq_length rather than the context length; the
        table covers the whole context."""
        factor = rope_scaling_factor or (1.0 if config.raw.get("use_dynamic_ntk") else 0.0)
        train = seq_length(config)
        rope_config = dataclasses.replace(config, max_position_embeddings=train, rope_scaling=None)
        return get_rope(rope_config, factor, max_position or max(config.max_position_embeddings, train))

    @staticmethod
    def _check_supported(config: ModelConfig) -> None:
        """Refuse what the published code does differently, before any weight is allocated."""
        if float(config.raw.get("rotary_pct", 1.0)) != 1.0:
            raise UnsupportedModelError(
                f"Qwen with rotary_pct={config.raw['rotary_pct']} (rotating part of each head) is not supported")
        if config.head_dim * config.num_heads != config.hidden_size:
            # Qwen's code splits c_attn's output in hidden_size pieces: kv_channels * heads must equal it.
            raise UnsupportedModelError(
                f"Qwen with kv_channels={config.head_dim} * {config.num_heads} heads != hidden_size "
                f"{config.hidden_size} is not supported")

    @staticmethod
    def attention_biases(config: ModelConfig) -> tuple[bool, bool]:
        """c_attn always carries a bias; c_proj only when ``no_bias`` is false."""
        return True, not config.raw.get("no_bias", True)

    @staticmethod
    def mlp_bias(config: ModelConfig) -> bool:
        """w1, w2 and c_proj carry biases only when ``no_bias`` is false."""
        return not config.raw.get("no_bias", True)

    @staticmethod
    def variant(config: ModelConfig) -> LlamaVariant:
        """SwiGLU; with ``use_logn_attn`` the blocks scale their queries past seq_length."""
        return LlamaVariant(decoder_layer=QWenBlock if config.raw.get("use_logn_attn") else None)

    @staticmethod
    def ties_embeddings(config: ModelConfig) -> bool:
        """Qwen v1 keeps a separate lm_head."""
        return bool(config.raw.get("tie_word_embeddings", False))

    def map_weight(self, name: str, tensor: torch.Tensor) -> Iterator[WeightTarget]:
        """Rename Qwen v1 tensors; every fragment of a name is translated (``transformer.h.N.attn.c_attn``
        -> ``model.layers.N.self_attn.qkv_proj``), the shard coming from the projection's."""
        shard = None
        for old, new, piece in _RENAMES:
            if old in name:
                name = name.replace(old, new)
                shard = piece if piece is not None else shard
        yield name, shard, tensor
