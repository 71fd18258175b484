"""Mixture-of-experts layers: every expert's weights stacked in one tensor per projection, run by
``kernels/moe`` (``select_experts`` then ``fused_moe``), and the sparse block around them (router,
experts, optional shared expert).

Tensor parallelism splits each expert's intermediate dim over the ranks, as ``MergedLinear`` and
``RowParallelLinear`` split a dense MLP: every rank holds all experts, and for each its slice of
the gate rows, of the up rows and of the down projection's inputs; the partial outputs are summed
by the same all-reduce ``RowParallelLinear`` uses. Routing is replicated (every rank scores every
token the same), so no token moves between ranks.

Checkpoints come in two layouts, both accepted by the loaders: one tensor per expert and
projection (``experts.{e}.gate_proj.weight``, as published and as transformers 5 saves them), or
already stacked (``experts.gate_up_proj`` [E, 2I, H] and ``experts.down_proj`` [E, H, I], the
layout transformers 5 holds in memory). AWQ checkpoints hold per-expert triples
(``experts.{e}.gate_proj.qweight`` / ``qzeros`` / ``scales``), loaded by ``moe_awq.AWQMoEMethod``;
W8A8 ones per-expert pairs (``experts.{e}.gate_proj.weight`` int8 / ``weight_scale``), loaded by
``moe_w8a8.W8A8MoEMethod``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ...kernels.moe import fused_moe, select_experts
from ...kernels.moe.router import router_logits
from ...protocol.errors import EngineConfigError, UnsupportedModelError
from ..distributed import shard_range, tp_group
from ..weight_loader import materialize, narrow
from .linear import LinearBase, RowParallelLinear
from .moe_awq import AWQMoEMethod
from .moe_w8a8 import W8A8MoEMethod

# config.json ``hidden_act`` names -> the names kernels/moe takes for the expert gate.
_MOE_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
                    "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh"}

# Shard ids of ``FusedMoE.w13``: (expert, 0) its gate rows, (expert, 1) its up rows; of ``w2``: the expert.
GATE, UP = 0, 1


@dataclass(frozen=True)
class Routing:
    """How router logits pick and weight experts beyond top-k and renormalisation (``select_experts``'
    options): the scoring function, DeepSeek-V2's grouped top-k (``num_expert_group`` groups of
    experts, the k chosen inside the ``topk_group`` groups whose best expert scores highest) and
    the factor the routed experts' weights are multiplied by (DeepSeek-V2's ``routed_scaling_factor``)."""

    scoring: str = "softmax"
    num_expert_group: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0

    def check(self, num_experts: int, top_k: int) -> None:
        """UnsupportedModelError for a combination select_experts cannot run."""
        if self.scoring not in ("softmax", "sigmoid"):
            raise UnsupportedModelError(f"expert scoring {self.scoring!r} is not supported; use softmax or sigmoid")
        if self.num_expert_group is None:
            return
        groups, keep = self.num_expert_group, self.topk_group
        if groups < 1 or num_experts % groups or keep is None or not 1 <= keep <= groups:
            raise UnsupportedModelError(f"grouped top-k needs n_group dividing the {num_experts} experts and "
                                        f"1 <= topk_group <= n_group; got n_group={groups}, topk_group={keep}")
        if keep * (num_experts // groups) < top_k:
            raise UnsupportedModelError(f"topk_group={keep} groups of {num_experts // groups} experts hold fewer "
                                        f"than the {top_k} experts each token takes")


class FusedMoE(nn.Module):
    """All experts of one layer: ``w13`` [E, 2 * I_rank, H] (each expert's gate rows then its up
    rows, the order ``fused_moe`` reads) and ``w2`` [E, H, I_rank], or, with an AWQ or W8A8 ``quant``
    (``engine/quant_format.QuantFormat``), their packed triples (``moe_awq.AWQMoEMethod``) or
    their int8 codes and scales (``moe_w8a8.W8A8MoEMethod``), the method held as ``method``.
    ``forward(x, router_logits)`` routes each token to its ``top_k`` experts and returns the
    weighted sum of their outputs, summed over the ranks."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, activation: str = "silu", routing: Routing | None = None,
                 quant=None) -> None:
        super().__init__()
        tp = tp_group()
        if activation not in _MOE_ACTIVATIONS:
            raise UnsupportedModelError(f"expert activation {activation!r} is not supported; supported: "
                                        f"{sorted(_MOE_ACTIVATIONS)}")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.routing = routing or Routing()
        self.routing.check(num_experts, top_k)
        self.activation = _MOE_ACTIVATIONS[activation]
        self.full_intermediate_size = intermediate_size
        self.inter_start, self.inter_size = shard_range(intermediate_size, tp.rank, tp.size,
                                                        "moe_intermediate_size")
        self.method = None
        if quant is not None:
            if quant.method not in ("awq", "w8a8"):
                raise EngineConfigError(f"{quant.model_format} experts are not supported; use an AWQ checkpoint "
                                        "(`conveyor lite auto_awq`), a W8A8 one (`conveyor lite smooth_quant`) "
                                        "or the fp16/bf16 one")
            self.method = AWQMoEMethod(quant.group_size) if quant.method == "awq" else W8A8MoEMethod()
            self.method.create_weights(self, hidden_size, tp.size)
            return
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.inter_size, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, self.inter_size), requires_grad=False)
        self.w13.weight_loader = self.weight_loader
        self.w2.weight_loader = self.weight_loader
        self.w13.shard_ids = tuple((e, j) for e in range(num_experts) for j in (GATE, UP))
        self.w2.shard_ids = tuple(range(num_experts))

    @torch.no_grad()
    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """One expert's gate ([I, H], shard (e, 0)), up ((e, 1)) or down ([H, I], shard e)
        tensor, or (shard None) the stacked tensor of every expert; this rank's slice of I."""
        if shard_id is None:
            if param is self.w13:
                full = self.full_intermediate_size
                self._copy(param.data[:, :self.inter_size], narrow(loaded, 1, self.inter_start, self.inter_size),
                           (self.num_experts, 2 * full), "w13 (stacked gate_up_proj)", loaded)
                self._copy(param.data[:, self.inter_size:],
                           narrow(loaded, 1, full + self.inter_start, self.inter_size),
                           (self.num_experts, 2 * full), "w13 (stacked gate_up_proj)", loaded)
            else:
                self._copy(param.data, narrow(loaded, 2, self.inter_start, self.inter_size),
                           (self.num_experts, param.shape[1], self.full_intermediate_size),
                           "w2 (stacked down_proj)", loaded)
            return
        if param is self.w13:
            expert, half = shard_id
            rows = slice(half * self.inter_size, (half + 1) * self.inter_size)
            self._copy(param.data[expert, rows], narrow(loaded, 0, self.inter_start, self.inter_size),
                       (self.full_intermediate_size,), f"expert {expert} {'up' if half else 'gate'}", loaded)
        else:
            self._copy(param.data[shard_id], narrow(loaded, 1, self.inter_start, self.inter_size),
                       (param.shape[1], self.full_intermediate_size), f"expert {shard_id} down", loaded)

    @staticmethod
    def _copy(dst: torch.Tensor, src, full_prefix: tuple[int, ...], what: str, loaded) -> None:
        # The whole checkpoint tensor's leading dims must be the model's (a slice of a wrong-sized
        # tensor could otherwise fit this rank by accident).
        if tuple(loaded.shape[:len(full_prefix)]) != full_prefix:
            raise ValueError(f"checkpoint tensor for {what} has shape {tuple(loaded.shape)}, expected leading "
                             f"dims {full_prefix}")
        src = materialize(src)
        if dst.shape != src.shape:
            raise ValueError(f"checkpoint tensor for {what}: a rank's slice has shape {tuple(src.shape)}, "
                             f"expected {tuple(dst.shape)}")
        dst.copy_(src)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """x [T, H], router_logits [T, E] -> [T, H], summed over the ranks (this rank's part
        without ``reduce``)."""
        r = self.routing
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize, r.scoring,
                                      r.num_expert_group, r.topk_group)
        if r.routed_scaling_factor != 1.0:
            # On the fp32 routing weights, once: the kernel folds them into each expert's output.
            weights = weights * r.routed_scaling_factor
        if self.method is not None:
            out = self.method.apply(self, x, weights, ids)
        else:
            out = fused_moe(x, self.w13, self.w2, weights, ids, self.activation)
        return tp_group().all_reduce(out) if reduce else out


class Router(LinearBase):
    """The router's [E, H] linear, the same on every rank, run in float32 so that near-tied
    experts are picked as a float32 reference picks them in any model dtype. The weight is held
    in float32 (the checkpoint's values, cast once at load) rather than cast every step: a decode
    step would otherwise copy it once a layer."""

    def __init__(self, input_size: int, output_size: int) -> None:
        super().__init__(input_size, output_size)
        self.weight.data = self.weight.data.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[T, H] -> [T, E] float32 logits."""
        return router_logits(x, self.weight)


class SparseMoeBlock(nn.Module):
    """Router (``gate``), experts (``experts``) and, optionally, a shared expert every token runs
    through (``shared_expert``, any [T, H] -> [T, H] module, e.g. the family's gated MLP), scaled
    per token by ``sigmoid(shared_expert_gate(x))`` when ``shared_gate`` (Qwen2-MoE) and added as
    it is otherwise (DeepSeek-MoE's shared experts). ``routing`` (default: softmax, plain top-k, a
    factor of 1) picks and weights the routed experts (``Routing``); ``quant`` the experts' format
    (``FusedMoE``). The router and the shared expert's gate stay 16-bit whatever the format."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 renormalize: bool, activation: str = "silu", shared_expert: nn.Module | None = None,
                 shared_gate: bool = False, routing: Routing | None = None, quant=None) -> None:
        super().__init__()
        self.gate = Router(hidden_size, num_experts)  # 16-bit in every format (AWQ and W8A8 leave it so)
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size, renormalize, activation,
                                routing, quant)
        self.shared_expert = shared_expert
        self.shared_expert_gate = LinearBase(hidden_size, 1) if shared_expert is not None and shared_gate else None
        # A shared expert ending in a row-parallel projection (the family's gated MLP) leaves its
        # sum over the ranks to forward: the per-token gate is a scale, so it commutes with the sum,
        # and one all-reduce carries routed and shared parts together.
        down = getattr(shared_expert, "down_proj", None)
        self._joint_reduce = isinstance(down, RowParallelLinear)
        if self._joint_reduce:
            down.reduce_output = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[T, H] -> [T, H], summed over the ranks."""
        out = self.experts(x, self.gate(x), reduce=not self._joint_reduce)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return tp_group().all_reduce(out) if self._joint_reduce else out


# experts.{e}.{projection}.weight (one expert's tensor; AWQ: .qweight / .qzeros / .scales; W8A8:
# .weight and .weight_scale) and experts.{gate_up_proj,down_proj} (stacked).
_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\."
                         r"(?P<kind>weight|weight_scale|qweight|qzeros|scales)$")
# A per-expert tensor kind -> the suffix of the FusedMoE parameter it loads into.
_SUFFIX = {"weight": "", "weight_scale": "_scale", "qweight": "_qweight", "qzeros": "_qzeros", "scales": "_scales"}
_STACKED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<proj>gate_up_proj|down_proj)$")


def map_expert_weight(name: str, tensor: torch.Tensor, gate: str, up: str, down: str
                      ) -> Iterator[tuple[str, object, torch.Tensor]] | None:
    """An expert tensor's (parameter, shard, tensor), named ``gate``/``up``/``down`` per expert
    (Mixtral: w1/w3/w2; Qwen: gate_proj/up_proj/down_proj) or stacked; None for other tensors."""
    m = _PER_EXPERT.match(name)
    if m is not None:
        e, proj, prefix = int(m["expert"]), m["proj"], m["prefix"]
        suffix = _SUFFIX[m["kind"]]  # AWQ: w13_qweight, ...; W8A8: w13, w13_scale
        if proj == gate:
            return iter([(f"{prefix}.w13{suffix}", (e, GATE), tensor)])
        if proj == up:
            return iter([(f"{prefix}.w13{suffix}", (e, UP), tensor)])
        if proj == down:
            return iter([(f"{prefix}.w2{suffix}", e, tensor)])
        return None
    m = _STACKED.match(name)
    if m is not None:
        return iter([(f"{m['prefix']}.{'w13' if m['proj'] == 'gate_up_proj' else 'w2'}", None, tensor)])
    return None
