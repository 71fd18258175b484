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
with ALiBi attention biases, which conveyor's attention does not have yet: they are refused when
the model is built, before any weight is allocated or read.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F

from ...protocol.errors import UnsupportedModelError
from ..model_config import ModelConfig
from .llama import LlamaForCausalLM, WeightTarget

BAICHUAN2_VOCAB_SIZE = 125696
_NORMALIZE_ROWS = 8192  # rows normalized per step: bounds the float32 copy of a large head


def is_baichuan2(config: ModelConfig) -> bool:
    """Baichuan2's NormHead is told by its vocabulary size (its config has no other mark)."""
    return config.vocab_size == BAICHUAN2_VOCAB_SIZE


def uses_alibi(config: ModelConfig) -> bool:
    """The 13B models (Baichuan-13B, Baichuan2-13B) use ALiBi: their published code's shape, hidden
    5120 over 40 layers (the 7B ones: 4096 over 32, with RoPE)."""
    return config.hidden_size == 5120 and config.num_layers == 40


class BaiChuanForCausalLM(LlamaForCausalLM):
    """Baichuan-7B (v1); also the base of Baichuan2's class, which adds the NormHead."""

    def __init__(self, config: ModelConfig, rope_scaling_factor: float = 0.0, max_position: int | None = None) -> None:
        if uses_alibi(config):
            raise UnsupportedModelError(
                f"{config.architecture} with hidden_size 5120 and 40 layers is Baichuan-13B or Baichuan2-13B, "
                "whose attention uses ALiBi position biases instead of rotary embeddings; conveyor's attention "
                "has no ALiBi yet. Baichuan-7B and Baichuan2-7B (RoPE) are supported"
            )
        super().__init__(config, rope_scaling_factor, max_position)

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
    """Baichuan2-7B (NormHead when its vocabulary is Baichuan2's); the 13B models of this name are refused."""
