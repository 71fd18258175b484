"""AWQ for the sparse blocks of the mixture-of-experts families (``layouts.LAYOUTS`` entries with
``experts``): which inputs to record, the scale groups, the experts' clip search and rounding, and
the published per-expert checkpoint names. SmoothQuant (``smooth_quant_tool``) smooths the same
scale groups, each expert's down projection on its routed tokens' ranges (``ExpertRecorder``).

transformers holds a block's experts stacked (``experts.gate_up_proj`` [E, 2I, H],
``experts.down_proj`` [E, H, I]); each expert's gate, up and down rows are taken as ``nn.Linear``
views of those tensors, so the dense path's search, folding and clipping write through them.

* **gate/up**: every expert reads the block's input (the MLP norm's output), so one scale is
  searched for all of them together (and the shared expert's gate/up), judged on the whole
  block's output, and folded into the norm; the router and the shared expert's gate read that
  input too and are multiplied by the scale (never quantized), so routing is unchanged.
* **down**, per expert, calibrated on the tokens routed to it: ``act(gate) * up`` of those tokens
  (recorded by ``ExpertRecorder`` over every calibration token, the first samples' kept for the
  search), its scale folded into the expert's up rows. The clip search likewise uses each
  expert's routed tokens.
* An expert no calibration token reaches (or none of the searched samples' tokens) gets no
  scale search and no clipping of its own: plain round-to-nearest of its weights, which still
  carry the block's shared gate/up scale (function-preserving). The log names those experts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .calibration import InputRecord
from .layouts import DecoderLayout
from .quantizer import GroupQuantized, quantize
from .scale_groups import ScaleGroup

# The input each shared-expert linear reads, as the name of the module recorded for it.
MOE_INPUT_OF = {"mlp.shared_expert.gate_proj": "mlp", "mlp.shared_expert.up_proj": "mlp",
                "mlp.shared_expert.down_proj": "mlp.shared_expert.down_proj"}


def is_sparse(mlp: nn.Module) -> bool:
    """Whether a decoder layer's MLP is a sparse block with stacked experts (transformers 5)."""
    return hasattr(getattr(mlp, "experts", None), "gate_up_proj")


def _view(weight: torch.Tensor) -> nn.Linear:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    lin.weight = nn.Parameter(weight, requires_grad=False)  # shares the stacked tensor's storage
    return lin


@dataclass
class ExpertViews:
    """One expert's rows of the stacked tensors, as linears: gate and up together, each, and down."""

    gate_up: nn.Linear
    gate: nn.Linear
    up: nn.Linear
    down: nn.Linear


def expert_views(mlp: nn.Module) -> list[ExpertViews]:
    gate_up, down = mlp.experts.gate_up_proj, mlp.experts.down_proj
    inter = down.shape[2]
    return [ExpertViews(_view(gate_up[e]), _view(gate_up[e, :inter]), _view(gate_up[e, inter:]), _view(down[e]))
            for e in range(gate_up.shape[0])]


def routed_ids(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """[tokens, k] experts transformers' router picks for ``x`` [..., H]."""
    return mlp.gate(x.reshape(-1, x.shape[-1]))[2]


def _expert_input(mlp: nn.Module, view: ExpertViews, x: torch.Tensor) -> torch.Tensor:
    """``act(x @ gate.T) * (x @ up.T)``: what the expert's down projection reads."""
    return mlp.experts.act_fn(F.linear(x, view.gate.weight)) * F.linear(x, view.up.weight)


class ExpertRecorder:
    """A forward pre-hook on a sparse block: per expert, ``|h|`` statistics of ``h = act(gate) * up``
    over the tokens routed to it, and the ``h`` of those among the first ``keep_samples`` samples."""

    def __init__(self, mlp: nn.Module, keep_samples: int, dtype: torch.dtype) -> None:
        self.mlp, self.views = mlp, expert_views(mlp)
        self.keep_samples, self.dtype = keep_samples, dtype
        self.kept_samples = 0
        self.stats: dict[int, list[Any]] = {}  # expert -> [abs sum, abs max, tokens]
        self.kept: dict[int, list[torch.Tensor]] = {}

    @torch.no_grad()
    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        x = args[0].detach()
        samples = x.shape[0]
        flat = x.reshape(-1, x.shape[-1])
        keep_rows = max(0, min(samples, self.keep_samples - self.kept_samples)) * (flat.shape[0] // samples)
        self.kept_samples += samples
        ids = routed_ids(self.mlp, flat)
        for e in ids.unique().tolist():
            rows = (ids == e).any(-1).nonzero(as_tuple=True)[0]
            h = _expert_input(self.mlp, self.views[e], flat[rows])
            a = h.abs().float()
            st = self.stats.setdefault(e, [torch.zeros_like(a[0]), torch.zeros_like(a[0]), 0])
            st[0] += a.sum(0)
            torch.maximum(st[1], a.amax(0), out=st[1])
            st[2] += rows.numel()
            kept = h[rows < keep_rows]
            if kept.numel():
                self.kept.setdefault(e, []).append(kept.to(self.dtype, copy=True))

    def records(self) -> dict[str, InputRecord]:
        """``mlp.experts.{e}.down_proj`` -> the expert's record, for each expert with kept tokens
        (the search re-runs those; ``[1, tokens, I]``: one batch)."""
        out = {}
        for e, chunks in self.kept.items():
            total, peak, tokens = self.stats[e]
            out[f"mlp.experts.{e}.down_proj"] = InputRecord(total / tokens, peak, torch.cat(chunks)[None], tokens)
        return out

    def tokens(self) -> dict[int, int]:
        """Calibration tokens routed to each expert (absent: none)."""
        return {e: st[2] for e, st in self.stats.items()}


def recorded_inputs(layer: nn.Module) -> dict[str, nn.Module]:
    """``scale_groups.recorded_inputs`` of a layer with a sparse block (the block's own input)."""
    mods = {"self_attn.q_proj": layer.self_attn.q_proj, "self_attn.o_proj": layer.self_attn.o_proj, "mlp": layer.mlp}
    shared = getattr(layer.mlp, "shared_expert", None)
    if shared is not None:
        mods["mlp.shared_expert.down_proj"] = shared.down_proj
    return mods


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def moe_scale_groups(layer: nn.Module, layout: DecoderLayout, searched: set[int]) -> list[ScaleGroup]:
    """The sparse block's scale groups (the module doc); ``searched``: the experts with their own
    calibration tokens."""
    mlp = layer.mlp
    views = expert_views(mlp)
    linears: dict[str, nn.Linear] = {}
    also: list[nn.Module] = [mlp.gate]  # the router: reads the scaled input, never quantized
    for e, v in enumerate(views):
        if e in searched:
            linears[f"mlp.experts.{e}.gate_proj"], linears[f"mlp.experts.{e}.up_proj"] = v.gate, v.up
        else:
            also.append(v.gate_up)
    shared = getattr(mlp, "shared_expert", None)
    if shared is not None:
        linears["mlp.shared_expert.gate_proj"], linears["mlp.shared_expert.up_proj"] = shared.gate_proj, shared.up_proj
    if getattr(mlp, "shared_expert_gate", None) is not None:
        also.append(mlp.shared_expert_gate)
    block: Callable[[torch.Tensor], torch.Tensor] = lambda x: _first(mlp(x))
    groups = []
    if linears:
        groups.append(ScaleGroup("gate_up", getattr(layer, layout.mlp_norm), linears, "mlp", block,
                                 layout.norm_offset, tuple(also)))
    for e in sorted(searched):
        groups.append(ScaleGroup(f"down.{e}", views[e].gate_up, {f"mlp.experts.{e}.down_proj": views[e].down},
                                 f"mlp.experts.{e}.down_proj", views[e].down))
    if shared is not None:
        groups.append(ScaleGroup("shared_down", shared.up_proj, {"mlp.shared_expert.down_proj": shared.down_proj},
                                 "mlp.shared_expert.down_proj", shared.down_proj))
    return groups


@torch.no_grad()
def clip_experts(layer: nn.Module, records: dict[str, InputRecord], searched: set[int], clip_tokens: int,
                 clip: Callable[[nn.Linear, torch.Tensor], None]) -> None:
    """``clip(linear, inputs)`` each searched expert's gate, up and down on its routed tokens among
    the kept (already scaled) block inputs."""
    mlp = layer.mlp
    x = records["mlp"].kept
    x = x.reshape(-1, x.shape[-1])
    ids = routed_ids(mlp, x)
    for e, v in enumerate(expert_views(mlp)):
        rows = (ids == e).any(-1).nonzero(as_tuple=True)[0]
        if e not in searched or not rows.numel():
            continue
        xe = x[rows][:clip_tokens]
        clip(v.gate, xe)
        clip(v.up, xe)
        clip(v.down, _expert_input(mlp, v, xe))


@torch.no_grad()
def quantize_experts(layer: nn.Module, layout: DecoderLayout, bits: int, group_size: int
                     ) -> dict[str, GroupQuantized]:
    """Every expert's gate, up and down rounded to the grid, by published name relative to the
    layer (``block_sparse_moe.experts.3.w1``); the stacked tensors become the dequantized values."""
    gate, up, down = layout.experts
    out = {}
    for e, v in enumerate(expert_views(layer.mlp)):
        for name, lin in ((gate, v.gate), (up, v.up), (down, v.down)):
            q = quantize(lin.weight, bits, group_size)
            lin.weight.copy_(q.dequantize(lin.weight.dtype))
            out[f"{layout.moe_prefix}.experts.{e}.{name}"] = q
    return out


def published_state(model: nn.Module, layout: DecoderLayout) -> dict[str, torch.Tensor]:
    """The model's state dict under the published names: each sparse block's stacked experts as
    one ``experts.{e}.{proj}.weight`` per expert and projection, the block under ``moe_prefix``."""
    state = dict(model.state_dict())
    gate, up, down = layout.experts
    for i, layer in enumerate(model.model.layers):
        if not is_sparse(layer.mlp):
            continue
        old, new = f"model.layers.{i}.mlp.", f"model.layers.{i}.{layout.moe_prefix}."
        for name in [n for n in state if n.startswith(old)]:
            tensor = state.pop(name)
            if name in (f"{old}experts.gate_up_proj", f"{old}experts.down_proj"):
                continue
            state[new + name[len(old):]] = tensor
        for e, v in enumerate(expert_views(layer.mlp)):
            for proj, lin in ((gate, v.gate), (up, v.up), (down, v.down)):
                state[f"{new}experts.{e}.{proj}.weight"] = lin.weight.detach()
    return state
