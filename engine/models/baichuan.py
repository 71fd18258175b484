"""Baichuan-7B (``BaiChuanForCausalLM``) and Baichuan2-7B (``BaichuanForCausalLM``); remote code,
``model_type`` "baichuan".

Llama's computation and tensor names, with no biases and q, k, v fused in ``self_attn.W_pack``
as rows ``[q | k | v]`` (the engine's own order: the fused loader splits them per rank).

Baichuan2's LM head is a ``NormHead``: its code L2-normalizes each vocabulary row of
``lm_head.weight`` on the first forward (the checkpoint stores the rows unnormalized). Here the
rows are normalized once, at load time; under tensor parallel each rank normalizes its own rows,
which is the same since the norm is per row. Baichuan2 is told from Baichuan (v1) by its
vocabulary of 125696 tokens, as vLLM and LMDeploy tell them (v1 has 64000).

Baichuan-13B and Baichuan2-13B (hidden_size 5120, 40 layers; the same class names) replace RoPE
with ALiBi: no rotation, and head h adds ``slope_h * k`` to its score of the key at position k
(the published code's mask; ``slope_h * (k - p)`` for the query at p is the same softmax), with
BLOOM's slopes (``kernels.attention.alibi_slopes``). Under tensor parallel each rank's attention
takes the slopes of its own heads. Baichuan2-13B also has the NormHead (its vocabulary is 125696).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F

from ...kernels.attention import alibi_slopes
from ..distributed import shard_range, tp_group
from ..layers import Attention, RotaryEmbedding
from ..model_config import ModelConfig
from .llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaVariant,
    WeightTarget,
)

BAICHUAN2_VOCAB_SIZE = 125696
_NORMALIZE_ROWS = 8192  # rows normalized per step: bounds the float32 copy of a large head


def is_baichuan2(config: ModelConfig) -> bool:
    """Baichuan2's NormHead is told by its vocabulary size (its config has no other mark)."""
    return config.vocab_size == BAICHUAN2_VOCAB_SIZE


def uses_alibi(config: ModelConfig) -> bool:
    """The 13B models (Baichuan-13B, Baichuan2-13B) use ALiBi: their published code's shape, hidden
    5120 over 40 layers (the 7B ones: 4096 over 32, with RoPE)."""
    return config.hidden_size == 5120 and config.num_layers == 40


class BaichuanAlibiAttention(LlamaAttention):
    """Baichuan-13B's attention: Llama's projections, no rotation, ALiBi slopes of this rank's heads."""

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, qkv_bias: bool, o_bias: bool,
                 variant: LlamaVariant | None = None, layer_idx: int = 0) -> None:
        super().__init__(config, rotary, qkv_bias, o_bias, variant, layer_idx)
        tp = tp_group()
        first = shard_range(config.num_heads, tp.rank, tp.size, "num_attention_heads")[0]
        slopes = alibi_slopes(config.num_heads)[first : first + self.num_heads]
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, alibi_slopes=slopes)
        self.rotary_emb = None  # no RoPE: positions enter through the slopes

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]; ``positions`` unused (the cache's key order gives the distances)."""
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v))


class BaichuanAlibiLayer(LlamaDecoderLayer):
    """Llama's pre-norm block around ``BaichuanAlibiAttention``."""

    attention_class = BaichuanAlibiAttention


class BaiChuanForCausalLM(LlamaForCausalLM):
    """Baichuan-7B (v1); also the base of Baichuan's other class: RoPE or ALiBi, and the NormHead."""

    @staticmethod
    def variant(config: ModelConfig) -> LlamaVariant:
        """SwiGLU; the 13B shapes attend through ALiBi instead of RoPE."""
        return LlamaVariant(decoder_layer=BaichuanAlibiLayer if uses_alibi(config) else None)

    @staticmethod
    def attention_biases(config: ModelConfig) -> tuple[bool, bool]:
        """W_pack and o_proj carry no biases."""
        return False, False

    @staticmethod
    def mlp_bias(config: ModelConfig) -> bool:
        """gate/up/down carry no biases."""
        return False

    @staticmethod
    def ties_embeddings(config: ModelConfig) -> bool:
        """Baichuan's lm_head (Baichuan2's NormHead) is its own weight."""
        return False

    def map_weight(self, name: str, tensor: torch.Tensor) -> Iterator[WeightTarget]:
        """``self_attn.W_pack`` is the fused qkv_proj, rows ``[q | k | v]``; the rest are Llama's names."""
        if ".self_attn.W_pack." in name:
            yield name.replace(".self_attn.W_pack.", ".self_attn.qkv_proj."), None, tensor
            return
        yield from super().map_weight(name, tensor)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Llama's loading; then Baichuan2's NormHead rows are normalized (this rank's rows)."""
        super().load_weights(weights)
        if is_baichuan2(self.config):
            weight = self.lm_head.weight.data
            for start in range(0, weight.shape[0], _NORMALIZE_ROWS):
                rows = weight[start : start + _NORMALIZE_ROWS]
                # In float32, rounded once to the model dtype (the published code normalizes in the
                # weight's dtype: the two differ by at most a rounding step per element).
                rows.copy_(F.normalize(rows.float(), dim=-1).to(rows.dtype))


class BaichuanForCausalLM(BaiChuanForCausalLM):
    """Baichuan2-7B (RoPE), Baichuan-13B and Baichuan2-13B (ALiBi); NormHead when the vocabulary is Baichuan2's."""
