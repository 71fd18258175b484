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
from .config import QuantizationError, SmoothQuantConfig
from .layouts import LAYOUTS
from .scale_groups import apply_scale, decoder_linears, recorded_inputs, scale_groups

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
                 alpha: float) -> dict[str, float]:
    """Fold SmoothQuant's scales into every group of ``layer`` (in place); returns each group's ``max(s)``."""
    largest = {}
    for group in scale_groups(layer, runner):
        s = smoothing_scales(absmax[group.input_name], list(group.linears.values()), alpha)
        apply_scale(group, s)
        largest[group.name] = float(s.max())
    return largest


@torch.no_grad()
def quantize_int8(layer: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """Every decoder linear of ``layer`` as stored tensors: ``weight`` int8 [out, in], ``weight_scale``
    float32 [out, 1]."""
    stored = {}
    for name, lin in decoder_linears(layer).items():
        q, scale = quant_per_token_ref(lin.weight)
        stored[name] = {"weight": q.cpu(), "weight_scale": scale.cpu()}
    return stored


def _refuse_experts(hf_config: dict) -> None:
    if LAYOUTS[hf_config["model_type"]].experts:
        raise QuantizationError(f"{hf_config['model_type']} is a mixture-of-experts model, whose experts have no W8A8 "
                                "kernel: quantize it with `conveyor lite auto_awq` (AWQ) instead")


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
                         needs_dataset="SmoothQuant", check_model=_refuse_experts)
    stored: dict[str, dict[str, torch.Tensor]] = {}
    max_scales: list[dict[str, float]] = []
    layers = run.model.model.layers
    for i, layer in enumerate(tqdm(layers, desc="SmoothQuant" if config.smooth else "int8", disable=not progress)):
        if run.runner is not None:
            outputs, records = run.runner.record(layer, recorded_inputs(layer))
            absmax = {k: r.absmax for k, r in records.items()}
            max_scales.append(smooth_layer(layer, run.runner, absmax, config.alpha))
            run.runner.advance(outputs)
            del outputs, records, absmax
        for name, tensors in quantize_int8(layer).items():
            stored[f"model.layers.{i}.{name}"] = tensors
    seconds = tool_run.finish(run, work_dir, stored, w8a8_quantization_config())
    return SmoothQuantResult(Path(work_dir).expanduser(), run.num_samples, seconds, max_scales)
