"""``auto_awq``: a Hugging Face model directory in, a 4-bit AWQ "gemm" checkpoint out.

Every setting, the model's shapes, the work directory and the calibration text are checked
before the model is loaded. The model then runs one decoder layer at a time over the
calibration windows (``calibration.LayerwiseRunner``); each layer is searched, folded, clipped
and quantized (``awq.awq_layer``) and its output becomes the next layer's input. With
``search_scale=False`` no calibration runs at all: every linear is rounded to nearest.

Mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE) quantize every expert (``moe.py``:
each expert calibrated on the tokens routed to it; one no calibration token reaches is rounded
to nearest with no search, and the log says which) and are written in the layout published AWQ
MoE checkpoints have: one ``experts.{e}.{gate,up,down}.{qweight,qzeros,scales}`` triple per
expert and projection, the router and the shared expert's gate in 16 bits.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from . import tool_run
from .awq import LayerReport, awq_layer, keep_samples, quantize_linears
from .awq_layout import pack_linear
from .checkpoint import quantization_config
from .config import AwqConfig
from .layouts import LAYOUTS
from .moe import ExpertRecorder, is_sparse, published_state
from .moe import recorded_inputs as moe_recorded_inputs
from .scale_groups import recorded_inputs

logger = logging.getLogger(__name__)


@dataclass
class AwqResult:
    """What a run did: where it wrote, how many calibration windows it used, how long it took."""

    work_dir: Path
    calib_samples: int
    seconds: float
    layers: list[LayerReport] = field(default_factory=list)


def auto_awq(model_dir: str | Path, work_dir: str | Path, config: AwqConfig | None = None,
             calib_dataset: str | Path | None = None, device: str = "auto", dtype: str = "auto",
             progress: bool = True) -> AwqResult:
    """Quantize ``model_dir`` to 4-bit AWQ and write the checkpoint to ``work_dir``.

    ``calib_dataset`` is a ``.txt`` or ``.jsonl`` file (needed unless ``config.search_scale`` is
    False). Raises ``QuantizationError`` before any work for a bad setting, an unsupported or
    ill-fitting model, a non-empty ``work_dir`` or an unusable calibration file.
    """
    config = config or AwqConfig()
    run = tool_run.begin("auto_awq", model_dir, work_dir, config, config.search_scale, calib_dataset, device, dtype,
                         needs_dataset="the AWQ search", check_model=config.check_model)
    runner, num_samples = run.runner, run.num_samples
    layers = run.model.model.layers
    reports: list[LayerReport] = []
    packed: dict[str, dict[str, torch.Tensor]] = {}
    if config.search_scale:
        keep = keep_samples(config, num_samples)
    model_type = run.hf_config["model_type"]
    for i, layer in enumerate(tqdm(layers, desc="AWQ" if config.search_scale else "RTN", disable=not progress)):
        if config.search_scale:
            sparse = is_sparse(layer.mlp)
            if sparse:
                experts = ExpertRecorder(layer.mlp, keep, runner.dtype)
                handle = layer.mlp.register_forward_pre_hook(experts)
                try:
                    outputs, records = runner.record(layer, moe_recorded_inputs(layer), keep)
                finally:
                    handle.remove()
                records.update(experts.records())
                _log_unsearched(i, experts, layer.mlp.experts.gate_up_proj.shape[0])
            else:
                outputs, records = runner.record(layer, recorded_inputs(layer), keep)
            report = awq_layer(layer, runner, config, records)
            del records
            reports.append(report)
            logger.debug("layer %d: alpha %s", i, report.alphas)
        quantized = quantize_linears(layer, config, model_type)
        if config.search_scale:
            runner.advance(runner.forward(layer) if config.propagate == "quantized" else outputs)
            del outputs
        for name, q in quantized.items():
            packed[f"model.layers.{i}.{name}"] = pack_linear(q)
    layout = LAYOUTS[model_type]
    state = published_state(run.model, layout) if layout.experts else None
    seconds = tool_run.finish(run, work_dir, packed, quantization_config(config.w_bits, config.w_group_size), state)
    return AwqResult(Path(work_dir).expanduser(), num_samples, seconds, reports)


def _log_unsearched(layer: int, experts: ExpertRecorder, num_experts: int) -> None:
    """Name the experts of a layer that get no scale search of their own (``moe.py``)."""
    tokens = experts.tokens()
    searched = {int(name.split(".")[2]) for name in experts.records()}
    unreached = [e for e in range(num_experts) if e not in tokens]
    unsearched = [e for e in range(num_experts) if e in tokens and e not in searched]
    if unreached:
        logger.info("layer %d: no calibration token reaches expert(s) %s: round-to-nearest, no scale search",
                    layer, unreached)
    if unsearched:
        logger.info("layer %d: expert(s) %s get no token of the searched samples: round-to-nearest, no scale "
                    "search", layer, unsearched)
