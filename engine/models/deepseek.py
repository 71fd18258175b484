"""DeepSeek-MoE (deepseek-moe-16b, ``DeepseekForCausalLM``): Llama's attention and norms with the
DeepSeek MoE block in place of the MLP on the sparse layers; the block and the rule that picks
the sparse layers are DeepSeek-V2's too (``build_deepseek_mlp``), which only adds routing options.

The block (the published modelling files' ``DeepseekMoE`` / ``DeepseekV2MoE``): a router
``mlp.gate.weight`` [E, H] scored by softmax; each token's ``num_experts_per_tok`` best of the
``n_routed_experts`` experts (``mlp.experts.{e}.{gate,up,down}_proj``, ``moe_intermediate_size``
wide), their weights renormalised only with ``norm_topk_prob`` (and k > 1), then multiplied by
``routed_scaling_factor`` (V2; 1 in v1); plus ``n_shared_experts`` shared experts stored as ONE gated
MLP ``mlp.shared_experts.*`` of ``moe_intermediate_size * n_shared_experts``, added with no gate.
V2's ``topk_method="group_limited_greedy"`` takes the k inside the ``topk_group`` of ``n_group``
expert groups whose best expert scores highest. Layer ``i`` is sparse when ``i >=
first_k_dense_replace`` and ``i % moe_layer_freq == 0``; the others are dense MLPs of
``intermediate_size``.

Not run (refused by name): V3's sigmoid scoring, ``noaux_tc`` top-k and its
``e_score_correction_bias``; ``norm_topk_prob`` together with a ``routed_scaling_factor`` other
than 1 (no V2 release sets both, and the published V2 code and transformers weight that case
differently).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import torch
from torch import nn

from ...protocol.errors import UnsupportedModelError
from ..layers.moe import Routing, SparseMoeBlock, map_expert_weight
from ..model_config import ModelConfig
from .llama import LlamaMLP, LlamaVariant, WeightTarget
from .mixtral import MixtralForCausalLM, MoeDecoderLayer

_TOPK_METHODS = ("greedy", "group_limited_greedy")


def num_routed_experts(config: ModelConfig) -> int:
    """``n_routed_experts`` (0 or absent: every layer dense)."""
    return int(config.raw.get("n_routed_experts") or 0)


def is_sparse(config: ModelConfig, layer_idx: int) -> bool:
    """Whether layer ``layer_idx`` runs the MoE block (the published DeepSeek-MoE / V2 rule)."""
    raw = config.raw
    freq = int(raw.get("moe_layer_freq", 1) or 1)
    return (num_routed_experts(config) > 0 and layer_idx >= int(raw.get("first_k_dense_replace", 0) or 0)
            and layer_idx % freq == 0)


def deepseek_routing(config: ModelConfig) -> tuple[bool, Routing]:
    """(renormalise the top-k weights, the rest of the routing) from config.json; the options
    this engine does not run raise UnsupportedModelError naming them."""
    raw = config.raw
    scoring = raw.get("scoring_func", "softmax")
    if scoring != "softmax":
        raise UnsupportedModelError(f"DeepSeek MoE scoring_func={scoring!r} (DeepSeek-V3's sigmoid router) is not "
                                    "supported: only softmax scoring (DeepSeek-MoE, DeepSeek-V2) runs here")
    method = raw.get("topk_method", "greedy") or "greedy"
    if method not in _TOPK_METHODS:
        raise UnsupportedModelError(f"DeepSeek MoE topk_method={method!r} (noaux_tc: DeepSeek-V3's "
                                    "e_score_correction_bias routing) is not supported; supported: "
                                    f"{list(_TOPK_METHODS)}")
    top_k = config.num_experts_per_tok
    # The published code renormalises only when k > 1 (one expert keeps its softmax score).
    renormalize = bool(raw.get("norm_topk_prob", False)) and top_k > 1
    scale = float(raw.get("routed_scaling_factor", 1.0) or 1.0)
    if renormalize and scale != 1.0:
        raise UnsupportedModelError(
            f"norm_topk_prob=true with routed_scaling_factor={scale}: the published DeepSeek-V2 code skips the "
            "factor when it renormalises and transformers applies it; no release sets both, so set one of them "
            "to its default (norm_topk_prob=false or routed_scaling_factor=1.0) to say which is meant")
    if method == "greedy":  # n_group / topk_group, if given, are unused (as in the published code)
        return renormalize, Routing(routed_scaling_factor=scale)
    if not raw.get("n_group") or not raw.get("topk_group"):
        raise UnsupportedModelError("topk_method='group_limited_greedy' needs n_group and topk_group in config.json")
    return renormalize, Routing(num_expert_group=int(raw["n_group"]), topk_group=int(raw["topk_group"]),
                                routed_scaling_factor=scale)


def build_deepseek_mlp(config: ModelConfig, layer_idx: int, variant: LlamaVariant) -> nn.Module:
    """Layer ``layer_idx``'s MLP: the dense ``LlamaMLP`` or the DeepSeek MoE block (a
    ``SparseMoeBlock`` whose ``shared_expert`` is the shared experts' one ungated MLP). The
    checkpoint names map with ``map_deepseek_mlp_weight``."""
    if not is_sparse(config, layer_idx):
        return LlamaMLP(config, bias=False, variant=variant)
    raw = config.raw
    width = int(raw["moe_intermediate_size"])
    renormalize, routing = deepseek_routing(config)
    shared = None
    if raw.get("n_shared_experts"):
        # The shared experts run as one gated MLP of their summed width (how they are stored).
        shared = LlamaMLP(replace(config, intermediate_size=width * int(raw["n_shared_experts"])),
                          bias=False, variant=variant)
    return SparseMoeBlock(config.hidden_size, num_routed_experts(config), config.num_experts_per_tok, width,
                          renormalize=renormalize, activation=variant.hidden_act, shared_expert=shared,
                          shared_gate=False, routing=routing)


def map_deepseek_mlp_weight(name: str, tensor: torch.Tensor) -> tuple[str, Iterator[WeightTarget] | None]:
    """(the name Llama's mapping takes, or the routed expert tensor's targets): ``mlp.shared_experts``
    is the block's ``shared_expert`` (a LlamaMLP, fused by Llama's gate/up mapping); routed experts
    (per expert or stacked) fill the stacked ``w13`` / ``w2``."""
    name = name.replace(".mlp.shared_experts.", ".mlp.shared_expert.")
    return name, map_expert_weight(name, tensor, "gate_proj", "up_proj", "down_proj")


class DeepseekDecoderLayer(MoeDecoderLayer):
    """Llama's block with ``build_deepseek_mlp``'s MLP."""

    @staticmethod
    def build_mlp(config: ModelConfig, layer_idx: int, variant: LlamaVariant) -> nn.Module:
        """The dense MLP or the DeepSeek MoE block of layer ``layer_idx``."""
        return build_deepseek_mlp(config, layer_idx, variant)


class DeepseekForCausalLM(MixtralForCausalLM):
    """DeepSeek-MoE causal LM (deepseek-moe-16b-base / -chat)."""

    layer_class = DeepseekDecoderLayer
    expert_names = ("gate_proj", "up_proj", "down_proj")

    def map_weight(self, name: str, tensor: torch.Tensor) -> Iterator[WeightTarget]:
        """Experts into ``w13`` / ``w2``, the shared experts and dense MLPs as Llama's gated MLP."""
        name, experts = map_deepseek_mlp_weight(name, tensor)
        return experts if experts is not None else super().map_weight(name, tensor)
