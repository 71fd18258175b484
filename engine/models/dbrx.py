"""DBRX (databricks/dbrx-base, dbrx-instruct): a pre-norm block of bias-free LayerNorms around
GQA attention and a fine-grained MoE (16 experts, top-4 in the releases), every layer sparse.

What differs from Mixtral's block:

- The config nests its fields (``d_model``, ``n_heads``, ``attn_config``, ``ffn_config``);
  ``model_config._dbrx_fields`` maps them, RoPE's base included (``attn_config.rope_theta``).
- The fused ``attn.Wqkv`` output is clamped to ``[-clip_qkv, clip_qkv]`` before the split and
  RoPE when ``clip_qkv`` is set (8 in the releases). Elementwise, so each tensor-parallel rank
  clamps its own heads.
- Routing: softmax over the experts, top-k, then the k weights divided by their
  ``moe_normalize_expert_weights``-norm (a p-norm). p=1 (the releases: the default) is the
  renormalisation ``select_experts`` does; None keeps the softmax weights; another p is refused.
- The experts are stored fused, ``ffn.experts.mlp.w1`` (gate), ``v1`` (up) and ``w2`` (down,
  transposed), each ``[E * I, H]``; transformers 5 saves the same layout. Each expert's rows go
  into ``FusedMoE``'s stacked ``w13`` / ``w2`` through its per-expert loader, read lazily, so a
  tensor-parallel rank reads its own slice of I only.

LayerNorm hands no int8 rows to a W8A8 linear, and neither AWQ nor W8A8 experts are read for DBRX
(engine/quant_format.py refuses them with the fix): it runs from its 16-bit checkpoint.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator

import torch
from torch import nn

from ...protocol.errors import UnsupportedModelError
from ..layers import LayerNorm, RotaryEmbedding, SparseMoeBlock
from ..layers.moe import GATE, UP
from ..model_config import ModelConfig
from ..weight_loader import narrow
from .llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaVariant, WeightTarget
from .starcoder2 import refuse_int8_hand_over

logger = logging.getLogger(__name__)

# DBRX name fragment -> ours, applied in order where each occurs.
_RENAMES: tuple[tuple[str, str], ...] = (
    ("transformer.wte.", "model.embed_tokens."),
    ("transformer.norm_f.", "model.norm."),
    ("transformer.blocks.", "model.layers."),
    (".norm_attn_norm.norm_1.", ".input_layernorm."),
    (".norm_attn_norm.norm_2.", ".post_attention_layernorm."),
    (".norm_attn_norm.attn.Wqkv.", ".self_attn.qkv_proj.linear."),
    (".norm_attn_norm.attn.out_proj.", ".self_attn.o_proj."),
    (".ffn.router.layer.", ".mlp.gate."),
)
# The fused experts, after the renames: model.layers.{i}.ffn.experts.mlp.{w1,v1,w2}.
_EXPERTS = re.compile(r"^(?P<layer>model\.layers\.\d+)\.ffn\.experts\.mlp\.(?P<proj>w1|v1|w2)$")


def _ffn_config(config: ModelConfig) -> dict:
    return config.raw.get("ffn_config") or {}


def renormalizes(config: ModelConfig) -> bool:
    """Whether the top-k weights are divided by their sum: ``moe_normalize_expert_weights`` 1
    (transformers' default when absent, as in every release); None keeps the softmax weights."""
    return _ffn_config(config).get("moe_normalize_expert_weights", 1.0) is not None


def check_supported(config: ModelConfig) -> None:
    """Refuse, naming the field, what DBRX's configs can ask for that is not implemented: another
    p-norm of the expert weights, llm-foundry's uniform expert assignment, activation arguments."""
    ffn = _ffn_config(config)
    p = ffn.get("moe_normalize_expert_weights", 1.0)
    if p is not None and float(p) != 1.0:
        raise UnsupportedModelError(
            f"DBRX with ffn_config.moe_normalize_expert_weights={p} is not supported: only 1 (the top-k weights "
            "divided by their sum, as every released DBRX) or null (the softmax weights as they are)")
    if ffn.get("uniform_expert_assignment"):
        raise UnsupportedModelError("DBRX with ffn_config.uniform_expert_assignment=true (experts assigned "
                                    "round-robin, not by the router) is not supported; set it to false")
    extra = sorted(set(ffn.get("ffn_act_fn") or {}) - {"name"})
    if extra:
        raise UnsupportedModelError(f"DBRX's ffn_config.ffn_act_fn takes a name only here, not {extra}; "
                                    "remove them or use the released {'name': 'silu'}")


class ClampedOutput(nn.Module):
    """A linear layer whose outputs are clamped to ``[-clip, clip]`` (no clamp when ``clip`` is None)."""

    def __init__(self, linear: nn.Module, clip: float | None) -> None:
        super().__init__()
        self.linear, self.clip = linear, clip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[T, in] -> [T, out]."""
        out = self.linear(x)
        return out if self.clip is None else out.clamp(-self.clip, self.clip)


class DbrxAttention(LlamaAttention):
    """Llama's attention (fused q/k/v, RoPE, GQA) with DBRX's ``clip_qkv`` on the q/k/v outputs."""

    def __init__(
        self, config: ModelConfig, rotary: RotaryEmbedding, qkv_bias: bool, o_bias: bool,
        variant: LlamaVariant | None = None, layer_idx: int = 0,
    ) -> None:
        super().__init__(config, rotary, qkv_bias, o_bias, variant, layer_idx)
        clip = (config.raw.get("attn_config") or {}).get("clip_qkv")
        # Wrapped whether or not the config clips, so the checkpoint names map one way.
        self.qkv_proj = ClampedOutput(self.qkv_proj, None if clip is None else float(clip))


class DbrxDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm block (its forward) over bias-free LayerNorms, DBRX's attention and a sparse MoE."""

    def __init__(
        self, config: ModelConfig, rotary: RotaryEmbedding, qkv_bias: bool, o_bias: bool, mlp_bias: bool,
        variant: LlamaVariant | None = None, layer_idx: int = 0,
    ) -> None:
        nn.Module.__init__(self)  # not LlamaDecoderLayer's: it would allocate a dense MLP and RMSNorms
        variant = variant or LlamaVariant()
        self.self_attn = DbrxAttention(config, rotary, qkv_bias, o_bias, variant, layer_idx)
        self.mlp = SparseMoeBlock(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                                  config.intermediate_size, renormalize=renormalizes(config),
                                  activation=variant.hidden_act)
        self.input_layernorm = LayerNorm(config.hidden_size, config.rms_norm_eps, bias=False)
        self.post_attention_layernorm = LayerNorm(config.hidden_size, config.rms_norm_eps, bias=False)


class _ExpertRows:
    """Expert ``e``'s ``[I, H]`` rows of a fused ``[E * I, H]`` checkpoint tensor, transposed to
    ``[H, I]`` when ``transpose`` (DBRX's down projection); only the slice the loader narrows to
    is read (``FusedMoE.weight_loader`` narrows every per-expert tensor to its rank's part of I)."""

    def __init__(self, fused, expert: int, rows: int, transpose: bool) -> None:
        self.fused, self.start, self.rows, self.transpose = fused, expert * rows, rows, transpose
        hidden = fused.shape[1]
        self.shape = torch.Size((hidden, rows) if transpose else (rows, hidden))

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """The part ``[start, start + length)`` of dim ``dim`` of this expert's (transposed) tensor."""
        if dim == (1 if self.transpose else 0):  # along I: a block of the fused tensor's rows
            rows = narrow(self.fused, 0, self.start + start, length)
            return rows.t() if self.transpose else rows
        whole = narrow(self.fused, 0, self.start, self.rows)
        return (whole.t() if self.transpose else whole).narrow(dim, start, length)


class DbrxForCausalLM(LlamaForCausalLM):
    """DBRX causal LM."""

    def __init__(self, config: ModelConfig, *args, **kwargs) -> None:
        refuse_int8_hand_over(config, "DBRX")
        check_supported(config)  # before any weight is allocated
        super().__init__(config, *args, **kwargs)
        self.model.norm = LayerNorm(config.hidden_size, config.rms_norm_eps, bias=False)
        given = (config.raw.get("rope_parameters") or {}).get("rope_theta")
        if given is not None and float(given) != config.rope_theta:
            logger.warning("DBRX config: rope_parameters.rope_theta=%s differs from attn_config.rope_theta=%s; "
                           "using attn_config's, DBRX's own field (transformers 5 reads a released DBRX config "
                           "without it and writes its default base into rope_parameters)", given, config.rope_theta)

    @staticmethod
    def attention_biases(config: ModelConfig) -> tuple[bool, bool]:
        """No biases anywhere in DBRX."""
        return False, False

    @staticmethod
    def variant(config: ModelConfig) -> LlamaVariant:
        """The experts' activation (``ffn_config.ffn_act_fn.name``, silu by default) in DBRX's block."""
        act = _ffn_config(config).get("ffn_act_fn") or {"name": "silu"}
        return LlamaVariant(hidden_act=act.get("name", "silu"), decoder_layer=DbrxDecoderLayer)

    def map_weight(self, name: str, tensor: torch.Tensor) -> Iterator[WeightTarget]:
        """DBRX names -> ours; each expert's rows of the fused ``w1`` / ``v1`` / ``w2`` -> ``w13`` / ``w2``."""
        for old, new in _RENAMES:
            name = name.replace(old, new)
        m = _EXPERTS.match(name)
        if m is None:
            yield name, None, tensor
            return
        experts, rows = self.config.num_experts, self.config.intermediate_size
        if tuple(tensor.shape) != (experts * rows, self.config.hidden_size):
            raise ValueError(f"checkpoint tensor for {m['proj']} of {m['layer']} has shape {tuple(tensor.shape)}, "
                             f"expected {(experts * rows, self.config.hidden_size)} (experts * ffn_hidden_size, "
                             "d_model)")
        target = f"{m['layer']}.mlp.experts.{'w2' if m['proj'] == 'w2' else 'w13'}"
        for e in range(experts):
            shard = e if m["proj"] == "w2" else (e, GATE if m["proj"] == "w1" else UP)
            yield target, shard, _ExpertRows(tensor, e, rows, transpose=m["proj"] == "w2")
