"""InternLM2: the Llama computation under different names and a packed ``wqkv``.

``attention.wqkv`` rows are grouped per kv head: for each kv head ``h`` come its ``H/Hkv`` query
heads, then its key head, then its value head (``head_dim`` rows each). Loading unpacks that into
the fused ``qkv_proj``'s ``[all q | all k | all v]`` order.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..model_config import ModelConfig
from ..weight_loader import materialize
from .llama import LlamaForCausalLM, WeightTarget

# InternLM2 name fragment -> (our name fragment, shard id or None).
_RENAMES: tuple[tuple[str, str, int | None], ...] = (
    ("model.tok_embeddings.", "model.embed_tokens.", None),
    (".attention.wo.", ".self_attn.o_proj.", None),
    (".feed_forward.w1.", ".mlp.gate_up_proj.", 0),
    (".feed_forward.w3.", ".mlp.gate_up_proj.", 1),
    (".feed_forward.w2.", ".mlp.down_proj.", None),
    (".attention_norm.", ".input_layernorm.", None),
    (".ffn_norm.", ".post_attention_layernorm.", None),
)


def unpack_wqkv(
    packed: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split a packed ``wqkv`` weight ``[Hkv*(G+2)*D, in]`` (or bias ``[Hkv*(G+2)*D]``) into q, k, v."""
    group = num_heads // num_kv_heads
    rest = packed.shape[1:]
    blocks = packed.reshape(num_kv_heads, group + 2, head_dim, *rest)
    q = blocks[:, :group].reshape(num_heads * head_dim, *rest)
    k = blocks[:, group].reshape(num_kv_heads * head_dim, *rest)
    v = blocks[:, group + 1].reshape(num_kv_heads * head_dim, *rest)
    return q, k, v


class InternLM2ForCausalLM(LlamaForCausalLM):
    """InternLM2 / InternLM2.5 causal LM."""

    @staticmethod
    def attention_biases(config: ModelConfig) -> tuple[bool, bool]:
        """InternLM2's ``bias`` flag covers both wqkv and wo."""
        return config.attention_bias, config.attention_bias

    def map_weight(self, name: str, tensor: torch.Tensor) -> Iterator[WeightTarget]:
        """Rename InternLM2 tensors; split ``wqkv`` into the q/k/v shards."""
        if name == "output.weight":
            yield "lm_head.weight", None, tensor
            return
        if ".attention.wqkv." in name:
            target = name.replace(".attention.wqkv.", ".self_attn.qkv_proj.")
            cfg = self.config
            q, k, v = unpack_wqkv(materialize(tensor), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
            yield from ((target, "q", q), (target, "k", k), (target, "v", v))
            return
        for old, new, shard in _RENAMES:
            if old in name:
                yield name.replace(old, new), shard, tensor
                return
        yield name, None, tensor
