"""ChatGLM2, ChatGLM3 and GLM-4 as THUDM publish them (``ChatGLMModel`` /
``ChatGLMForConditionalGeneration``, model_type ``chatglm``, remote code): the GLM computation
(glm.py) under THUDM's names.

- ``transformer.embedding.word_embeddings``, ``transformer.encoder.layers.N.*``,
  ``transformer.encoder.final_layernorm``, ``transformer.output_layer`` (never tied);
- ``self_attention.query_key_value``: rows ``[q | k | v]`` (the fused layer's own order, split by
  rank as it loads), biased when ``add_qkv_bias`` (or ``add_bias_linear``);
- ``mlp.dense_h_to_4h``: ``[gate | up]`` (THUDM's swiglu chunks it in two, silu on the first),
  ``mlp.dense_4h_to_h`` the down projection; ``self_attention.dense`` the output projection;
  these carry a bias only when ``add_bias_linear``;
- RMSNorms (``rmsnorm``) before attention and MLP, and a final one (``post_layer_norm``).

Its rotary embedding turns the first half of each head (``kv_channels / 2`` dims) in interleaved
pairs with base ``10000 * rope_ratio``: what transformers' ``GlmForCausalLM`` computes (its
converter from these checkpoints keeps the weights and changes only names), so the class is
GLM's with a renaming loader. ModelConfig reads the config's names (model_config.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ...protocol.errors import UnsupportedModelError
from ..model_config import ModelConfig
from .glm import GlmForCausalLM
from .llama import WeightTarget

# THUDM name fragment -> ours; applied in order, each where it occurs.
_RENAMES: tuple[tuple[str, str], ...] = (
    ("transformer.embedding.word_embeddings.", "model.embed_tokens."),
    ("transformer.encoder.final_layernorm.", "model.norm."),
    ("transformer.encoder.layers.", "model.layers."),
    ("transformer.output_layer.", "lm_head."),
    (".self_attention.query_key_value.", ".self_attn.qkv_proj."),
    (".self_attention.dense.", ".self_attn.o_proj."),
    (".mlp.dense_h_to_4h.", ".mlp.gate_up_proj."),
    (".mlp.dense_4h_to_h.", ".mlp.down_proj."),
)
# Buffers THUDM's code saves that carry no parameter.
_IGNORED = ("rotary_pos_emb.inv_freq",)


class ChatGLMForConditionalGeneration(GlmForCausalLM):
    """ChatGLM2/3, GLM-4 (THUDM layout) causal LM."""

    def __init__(self, config: ModelConfig, *args, **kwargs) -> None:
        raw = config.raw
        # Layouts no released ChatGLM2/3/GLM-4 checkpoint uses, refused before any weight is read.
        if not raw.get("rmsnorm", True):
            raise UnsupportedModelError("ChatGLM with rmsnorm=false (LayerNorm) is not supported")
        if raw.get("apply_residual_connection_post_layernorm", False):
            raise UnsupportedModelError("ChatGLM with apply_residual_connection_post_layernorm=true is not supported")
        if not raw.get("post_layer_norm", True):
            raise UnsupportedModelError("ChatGLM with post_layer_norm=false is not supported")
        if raw.get("pre_seq_len"):
            raise UnsupportedModelError("ChatGLM P-tuning prefixes (pre_seq_len) are not supported")
        super().__init__(config, *args, **kwargs)

    @staticmethod
    def attention_biases(config: ModelConfig) -> tuple[bool, bool]:
        """q/k/v: ``add_qkv_bias`` or ``add_bias_linear``; the output projection: ``add_bias_linear``."""
        linear = bool(config.raw.get("add_bias_linear", False))
        return bool(config.raw.get("add_qkv_bias", False)) or linear, linear

    @staticmethod
    def mlp_bias(config: ModelConfig) -> bool:
        """``add_bias_linear`` covers both MLP projections."""
        return bool(config.raw.get("add_bias_linear", False))

    def map_weight(self, name: str, tensor: torch.Tensor) -> Iterator[WeightTarget]:
        """THUDM names -> ours; the fused q/k/v and gate/up tensors load whole (shard None)."""
        if name.endswith(_IGNORED):
            return
        for old, new in _RENAMES:
            name = name.replace(old, new)
        yield name, None, tensor


class ChatGLMModel(ChatGLMForConditionalGeneration):
    """The architecture name ChatGLM2/3 and GLM-4's config.json give (same model)."""
