"""Activation-aware weight quantization (AWQ, Lin et al. 2023), one decoder layer at a time.

For each group of linear layers that read the same input (q/k/v after ``input_layernorm``;
``o_proj`` after attention; gate/up after ``post_attention_layernorm``; ``down_proj`` after the
MLP activation) the search picks per-input-channel scales ``s = mean|x|**alpha`` (or, with
``duo_scaling``, AutoAWQ's ``mean|x|**alpha / mean|w|**(1 - alpha)``; normalised so that
``max(s) * min(s) == 1``), ``alpha`` on a grid over ``[0, 1)``, minimising the MSE between the
block's output with ``Q(W * s) / s`` and with ``W``. The block is the one the group feeds
(self-attention for q/k/v, the MLP for gate/up, the linear itself otherwise), as in AutoAWQ.
No scaling (plain round-to-nearest) is always a candidate too, so the search never does worse
than RTN on its objective. The chosen ``1 / s`` is folded into the op before the group (the RMSNorm weight, or
the rows of ``v_proj`` / ``up_proj`` that produce the group's input), which leaves the
unquantized model's function unchanged. ``o_proj`` is scaled only when ``v_proj`` and ``o_proj``
have the same shape: with grouped-query attention one ``v_proj`` row feeds several ``o_proj``
columns (AutoAWQ and LMDeploy skip it too). A clip search then shrinks each group's range
(``max |w|`` times ``1 - i / 20``, up to half) where that lowers the error of the linear's output
on calibration inputs; q/k are not clipped (their error is amplified by the q-k product).
The sparse blocks of the mixture-of-experts families have their own groups (``moe.py``): one
gate/up scale for all experts, a down scale per expert on the tokens routed to it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from .calibration import InputRecord, LayerwiseRunner
from .config import AwqConfig
from .layouts import LAYOUTS
from .moe import MOE_INPUT_OF, clip_experts, is_sparse, moe_scale_groups, quantize_experts
from .quantizer import GroupQuantized, fake_quantize, quantize
from .scale_groups import INPUT_OF, ScaleGroup, apply_scale, attention_groups, decoder_linears, scale_groups

logger = logging.getLogger(__name__)

_NO_CLIP = ("q_proj", "k_proj")
_CLIP_MAX_SHRINK = 0.5
_CLIP_ROW_CHUNK = 256


@dataclass
class LayerReport:
    """What the search chose for one decoder layer: per group the alpha (None: no scaling), RTN's loss and the best."""

    alphas: dict[str, float | None] = field(default_factory=dict)
    rtn_loss: dict[str, float] = field(default_factory=dict)
    best_loss: dict[str, float] = field(default_factory=dict)


def candidate_scales(x_mean: torch.Tensor, alpha: float, w_mean: torch.Tensor | None = None) -> torch.Tensor:
    """``mean|x|**alpha`` (or AutoAWQ's duo form ``mean|x|**alpha / mean|w|**(1-alpha)``), normalised."""
    if w_mean is None:
        s = x_mean.pow(alpha).clamp(min=1e-4)
    else:
        s = (x_mean.pow(alpha) / (w_mean.pow(1 - alpha) + 1e-4)).clamp(min=1e-4)
    s = s / (s.max() * s.min()).sqrt()
    return torch.where(torch.isfinite(s), s, torch.ones_like(s))


def _weight_mean(linears: list[nn.Linear], group_size: int) -> torch.Tensor:
    """Per input channel, the mean over output rows of ``|w|`` relative to its quantization group's max."""
    w = torch.cat([lin.weight for lin in linears]).float()
    g = w.abs().view(w.shape[0], -1, group_size)
    return (g / (g.amax(-1, keepdim=True) + 1e-6)).view_as(w).mean(0)


@torch.no_grad()
def _block_loss(block: Callable[[torch.Tensor], torch.Tensor], inputs: list[torch.Tensor],
                refs: list[torch.Tensor]) -> float:
    total, count = 0.0, 0
    for x, ref in zip(inputs, refs):
        out = block(x)
        total += float((out.float() - ref.float()).pow(2).sum())
        count += ref.numel()
    return total / count


@torch.no_grad()
def search_scale(group: ScaleGroup, record: InputRecord, config: AwqConfig,
                 runner: LayerwiseRunner) -> tuple[torch.Tensor, float | None, float, float]:
    """The best scales for ``group``: returns (scales, alpha, round-to-nearest's loss, best loss).

    The candidates are no scaling at all (plain round-to-nearest; alpha None) and the
    ``n_grid`` values of alpha, so the result is never worse than RTN on the objective. The
    group's weights are restored before returning; nothing is folded yet.
    """
    assert record.kept is not None, "the scale search needs the kept calibration inputs"
    inputs = list(runner.batches(record.kept))
    with runner.autocast():
        refs = [group.block(x) for x in inputs]
    linears = list(group.linears.values())
    originals = [lin.weight.detach().clone() for lin in linears]
    x_mean = record.absmean.to(originals[0].device)
    w_mean = _weight_mean(linears, config.w_group_size) if config.duo_scaling else None
    candidates: list[tuple[float | None, torch.Tensor]] = [(None, torch.ones_like(x_mean))]
    for step in range(config.n_grid):
        if step == 0 and w_mean is None:
            continue  # mean|x|**0 is no scaling, already a candidate
        alpha = step / config.n_grid
        candidates.append((alpha, candidate_scales(x_mean, alpha, w_mean)))
    losses = []
    try:
        for _alpha, s in candidates:
            sw = s.to(originals[0].dtype).view(1, -1)
            for lin, w in zip(linears, originals):
                lin.weight.copy_(fake_quantize(w * sw, config.w_bits, config.w_group_size) / sw)
            with runner.autocast():
                losses.append(_block_loss(group.block, inputs, refs))
    finally:
        for lin, w in zip(linears, originals):
            lin.weight.copy_(w)
    finite = [i for i, loss in enumerate(losses) if math.isfinite(loss)]
    if not finite:
        logger.warning("AWQ scale search for %s found no finite loss; leaving it unscaled", group.name)
        return candidates[0][1], None, losses[0], losses[0]
    best = min(finite, key=lambda i: losses[i])
    return candidates[best][1], candidates[best][0], losses[0], losses[best]


@torch.no_grad()
def search_clip(weight: torch.Tensor, x: torch.Tensor, bits: int, group_size: int, n_grid: int = 20,
                max_shrink: float = _CLIP_MAX_SHRINK) -> torch.Tensor:
    """Per output row and quantization group, the clip bound ``[out, in / G]`` that minimises the output error.

    ``x`` is ``[tokens, in]``. Each group's error is measured on its own partial dot products,
    as AutoAWQ's ``_compute_best_clip`` does.
    """
    out_features, in_features = weight.shape
    groups = in_features // group_size
    xg = x.to(weight.dtype).view(-1, groups, group_size).permute(1, 2, 0)  # [groups, G, tokens]
    bounds = []
    for chunk in weight.split(_CLIP_ROW_CHUNK):
        rows = chunk.shape[0]
        wg = chunk.view(rows, groups, group_size).permute(1, 0, 2)  # [groups, rows, G]
        ref = torch.bmm(wg, xg)
        absmax = wg.abs().amax(-1, keepdim=True)
        best_bound, best_err = absmax.clone(), torch.full_like(absmax, math.inf)
        for step in range(int(max_shrink * n_grid)):
            bound = absmax * (1 - step / n_grid)
            clipped = torch.maximum(torch.minimum(wg, bound), -bound)
            q = fake_quantize(clipped.reshape(-1, group_size), bits, group_size).view_as(wg)
            err = (torch.bmm(q, xg) - ref).pow(2).mean(-1, keepdim=True)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_bound = torch.where(better, bound, best_bound)
        bounds.append(best_bound.squeeze(-1).t())  # [rows, groups]
    return torch.cat(bounds)


@torch.no_grad()
def apply_clip(linear: nn.Linear, bound: torch.Tensor, group_size: int) -> None:
    """Clamp each group of ``linear.weight`` to ``[-bound, bound]``."""
    w = linear.weight.view(linear.weight.shape[0], -1, group_size)
    b = bound.to(w.dtype).unsqueeze(-1)
    torch.maximum(torch.minimum(w, b), -b, out=w)


def _clip_tokens(kept: torch.Tensor, count: int) -> torch.Tensor:
    flat = kept.reshape(-1, kept.shape[-1])
    step = max(1, flat.shape[0] // count)
    return flat[::step][:count]


@torch.no_grad()
def quantize_linears(layer: nn.Module, config: AwqConfig, model_type: str | None = None) -> dict[str, GroupQuantized]:
    """Round every linear of ``layer`` (and, in a sparse block, every expert: ``model_type``
    names the layout) to the grid; its weight becomes the dequantized value."""
    quantized = {}
    for name, lin in decoder_linears(layer).items():
        q = quantize(lin.weight, config.w_bits, config.w_group_size)
        lin.weight.copy_(q.dequantize(lin.weight.dtype))
        quantized[name] = q
    if is_sparse(layer.mlp):
        quantized.update(quantize_experts(layer, LAYOUTS[model_type], config.w_bits, config.w_group_size))
    return quantized


@torch.no_grad()
def awq_layer(layer: nn.Module, runner: LayerwiseRunner, config: AwqConfig,
              records: dict[str, InputRecord]) -> LayerReport:
    """Search, fold and clip one decoder layer in place (the weights stay unquantized)."""
    report = LayerReport()
    sparse = is_sparse(layer.mlp)
    # Experts with calibration tokens of their own (moe.ExpertRecorder's records).
    searched = {int(name.split(".")[2]) for name in records if name.startswith("mlp.experts.")}
    if sparse:
        layout = LAYOUTS[runner.model.config.model_type]
        groups = attention_groups(layer, runner) + moe_scale_groups(layer, layout, searched)
    else:
        groups = scale_groups(layer, runner)
    # Every group is searched on the layer as it was (AutoAWQ's order); then all scales are folded.
    found = [(g, search_scale(g, records[g.input_name], config, runner)) for g in groups]
    for group, (_scales, alpha, rtn_loss, best_loss) in found:
        report.alphas[group.name], report.rtn_loss[group.name], report.best_loss[group.name] = (
            alpha, rtn_loss, best_loss)
    for group, (scales, *_) in found:
        apply_scale(group, scales, records[group.input_name])
    if config.apply_clip:
        def clip(lin: nn.Linear, x: torch.Tensor) -> None:
            bound = search_clip(lin.weight, x, config.w_bits, config.w_group_size, config.n_grid)
            apply_clip(lin, bound, config.w_group_size)

        for name, lin in decoder_linears(layer).items():
            if name.rsplit(".", 1)[-1] in _NO_CLIP:
                continue
            clip(lin, _clip_tokens(records[INPUT_OF.get(name) or MOE_INPUT_OF[name]].kept, config.clip_tokens))
        if sparse:
            clip_experts(layer, records, searched, config.clip_tokens, clip)
    return report


def keep_samples(config: AwqConfig, num_samples: int) -> int:
    """How many calibration samples the searches re-run: ``search_tokens`` worth, at least one."""
    return max(1, min(num_samples, math.ceil(config.search_tokens / config.calib_seqlen)))
