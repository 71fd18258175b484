"""``smooth_quant``: a Hugging Face model directory in, a W8A8 (int8 weights and activations) checkpoint out.

SmoothQuant (Xiao et al. 2023): per-token int8 activations lose the small channels of a row whose
few outlier channels set its scale. For each group of linears that read one input (q/k/v after
``input_layernorm``, gate/up after ``post_attention_layernorm``, ``down_proj`` after ``up_proj``,
``o_proj`` after ``v_proj`` where their shapes allow: ``scale_groups``) every input channel ``j``
is divided by ``s_j = max|x_j|**alpha / max|w_j|**(1 - alpha)`` in the op that produces it and
multiplied into the group's weights, with ``max|x_j|`` measured on calibration text and
``max|w_j|`` over the group's rows. The model's function is unchanged; the activations' range is
flattened at the weights' expense. Then every decoder linear is rounded to int8, symmetric per
output channel (``kernels.w8a8.quant_per_token_ref`` on its rows); activations are quantized per
token by the engine at run time, so no activation scale is stored.

Calibration runs the model one decoder layer at a time (``calibration.LayerwiseRunner``): the
peak memory is the model plus one layer's activations. Smoothing preserves each layer's output,
so the next layer's inputs are the unquantized ones (as in SmoothQuant and LMDeploy). With
``smooth=False`` no calibration runs: the weights are rounded as they are.

Mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE: ``layouts.LAYOUTS`` entries with
``experts``) smooth their sparse blocks with ``moe.moe_scale_groups``: every expert reads the
block's input, so one scale over all experts' gate/up (and the shared expert's), from the block
input's range and every such weight column, is folded into the MLP norm; the router and the
shared expert's gate read that input too and are multiplied by it, never quantized (routing is
unchanged). Each expert's down projection is smoothed on the range of ``act(gate) * up`` over the
calibration tokens routed to it (``moe.ExpertRecorder``; an expert no token reaches keeps its
down projection as it is). Every expert is rounded to int8 per output channel and written under
the published names (``experts.{e}.{w1,w3,w2 | gate_proj,up_proj,down_proj}.weight`` and
``.weight_scale``, Mixtral's under ``block_sparse_moe``), the layout ``engine/layers/moe_w8a8``
reads.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from ...kernels.w8a8 import quant_per_token_ref
from . import tool_run
from .calibration import LayerwiseRunner
from .checkpoint import w8a8_quantization_config
from .config import SmoothQuantConfig
from .layouts import LAYOUTS, DecoderLayout
from .moe import ExpertRecorder, expert_views, is_sparse, moe_scale_groups, published_state
from .moe import recorded_inputs as moe_recorded_inputs
from .scale_groups import apply_scale, attention_groups, decoder_linears, recorded_inputs, scale_groups

logger = logging.getLogger(__name__)

_MIN_RANGE = 1e-5  # a channel that never fired (or an all-zero weight column) must not divide by zero


@dataclass
class SmoothQuantResult:
    """What a run did: where it wrote, how many calibration windows it used, how long it took, and per
    layer and group the largest smoothing factor ``max(s)`` (how much outliers were flattened)."""

    work_dir: Path
    calib_samples: int
    seconds: float
    max_scales: list[dict[str, float]] = field(default_factory=list)


def smoothing_scales(x_absmax: torch.Tensor, linears: list[nn.Linear], alpha: float) -> torch.Tensor:
    """``s_j = max|x_j|**alpha / max|w_j|**(1 - alpha)`` per input channel (float32)."""
    w_absmax = torch.cat([lin.weight.detach().abs().float() for lin in linears]).amax(0)
    x = x_absmax.float().to(w_absmax.device).clamp(min=_MIN_RANGE)
    s = x.pow(alpha) / w_absmax.clamp(min=_MIN_RANGE).pow(1 - alpha)
    return torch.where(torch.isfinite(s), s, torch.ones_like(s)).clamp(min=_MIN_RANGE)


@torch.no_grad()
def smooth_layer(layer: nn.Module, runner: LayerwiseRunner, absmax: dict[str, torch.Tensor],
                 alpha: float, routed: frozenset[int] = frozenset()) -> dict[str, float]:
    """Fold SmoothQuant's scales into every group of ``layer`` (in place); returns each group's
    ``max(s)``. ``routed``: in a sparse block, the experts calibration tokens reach (their down
    projections are smoothed on ``absmax['mlp.experts.{e}.down_proj']``)."""
    if is_sparse(layer.mlp):
        layout = LAYOUTS[runner.model.config.model_type]
        groups = attention_groups(layer, runner) + moe_scale_groups(layer, layout, set(routed))
    else:
        groups = scale_groups(layer, runner)
    largest = {}
    for group in groups:
        s = smoothing_scales(absmax[group.input_name], list(group.linears.values()), alpha)
        apply_scale(group, s)
        largest[group.name] = float(s.max())
    return largest


def _int8(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    q, scale = quant_per_token_ref(weight)
    return {"weight": q.cpu(), "weight_scale": scale.cpu()}


@torch.no_grad()
def quantize_int8(layer: nn.Module, layout: DecoderLayout | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """Every decoder linear of ``layer`` as stored tensors: ``weight`` int8 [out, in], ``weight_scale``
    float32 [out, 1]; in a sparse block (``layout`` names its experts) every expert's gate, up and
    down too, by published name relative to the layer (``block_sparse_moe.experts.3.w1``)."""
    stored = {name: _int8(lin.weight) for name, lin in decoder_linears(layer).items()}
    if is_sparse(layer.mlp):
        gate, up, down = layout.experts
        for e, v in enumerate(expert_views(layer.mlp)):
            for name, lin in ((gate, v.gate), (up, v.up), (down, v.down)):
                stored[f"{layout.moe_prefix}.experts.{e}.{name}"] = _int8(lin.weight)
    return stored


def _record(runner: LayerwiseRunner, layer: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor], frozenset]:
    """The layer's outputs, the input ranges its groups are smoothed on, and (sparse block) the
    experts calibration tokens reach, whose ``act(gate) * up`` ranges ``ExpertRecorder`` takes."""
    if not is_sparse(layer.mlp):
        outputs, records = runner.record(layer, recorded_inputs(layer))
        return outputs, {k: r.absmax for k, r in records.items()}, frozenset()
    experts = ExpertRecorder(layer.mlp, 0, runner.dtype)  # ranges only: no token kept
    handle = layer.mlp.register_forward_pre_hook(experts)
    try:
        outputs, records = runner.record(layer, moe_recorded_inputs(layer))
    finally:
        handle.remove()
    absmax = {k: r.absmax for k, r in records.items()}
    absmax |= {f"mlp.experts.{e}.down_proj": st[1] for e, st in experts.stats.items()}
    return outputs, absmax, frozenset(experts.stats)


def _left_16_bit(model: nn.Module, layout: DecoderLayout) -> tuple[str, ...]:
    """compressed-tensors ``ignore`` entries for the sparse blocks' routers and shared-expert gates
    (they stay 16-bit; loaders that quantize every Linear must skip them)."""
    if not layout.experts:
        return ()
    gates = [f"re:.*{layout.moe_prefix}.gate$"]
    if any(getattr(layer.mlp, "shared_expert_gate", None) is not None for layer in model.model.layers):
        gates.append("re:.*shared_expert_gate$")
    return tuple(gates)


def smooth_quant(model_dir: str | Path, work_dir: str | Path, config: SmoothQuantConfig | None = None,
                 calib_dataset: str | Path | None = None, device: str = "auto", dtype: str = "auto",
                 progress: bool = True) -> SmoothQuantResult:
    """Smooth ``model_dir`` on ``calib_dataset`` and write its W8A8 checkpoint to ``work_dir``.

    ``calib_dataset`` is a ``.txt`` or ``.jsonl`` file (needed unless ``config.smooth`` is False).
    Raises ``QuantizationError`` before any work for a bad setting, an unsupported model, a
    non-empty ``work_dir`` or an unusable calibration file.
    """
    config = config or SmoothQuantConfig()
    run = tool_run.begin("smooth_quant", model_dir, work_dir, config, config.smooth, calib_dataset, device, dtype,
                         needs_dataset="SmoothQuant")
    stored: dict[str, dict[str, torch.Tensor]] = {}
    max_scales: list[dict[str, float]] = []
    layers = run.model.model.layers
    layout = LAYOUTS[run.hf_config["model_type"]]
    for i, layer in enumerate(tqdm(layers, desc="SmoothQuant" if config.smooth else "int8", disable=not progress)):
        if run.runner is not None:
            outputs, absmax, routed = _record(run.runner, layer)
            max_scales.append(smooth_layer(layer, run.runner, absmax, config.alpha, routed))
            run.runner.advance(outputs)
            del outputs, absmax
        for name, tensors in quantize_int8(layer, layout).items():
            stored[f"model.layers.{i}.{name}"] = tensors
    state = published_state(run.model, layout) if layout.experts else None
    quant_config = w8a8_quantization_config(_left_16_bit(run.model, layout))
    seconds = tool_run.finish(run, work_dir, stored, quant_config, state)
    return SmoothQuantResult(Path(work_dir).expanduser(), run.num_samples, seconds, max_scales)
