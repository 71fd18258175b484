"""``auto_awq``: a Hugging Face model directory in, a 4-bit AWQ "gemm" checkpoint out.

Every setting, the model's shapes, the work directory and the calibration text are checked
before the model is loaded. The model then runs one decoder layer at a time over the
calibration windows (``calibration.LayerwiseRunner``); each layer is searched, folded, clipped
and quantized (``awq.awq_layer``) and its output becomes the next layer's input. With
``search_scale=False`` no calibration runs at all: every linear is rounded to nearest.
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
    for i, layer in enumerate(tqdm(layers, desc="AWQ" if config.search_scale else "RTN", disable=not progress)):
        if config.search_scale:
            outputs, records = runner.record(layer, recorded_inputs(layer), keep)
            report = awq_layer(layer, runner, config, records)
            del records
            reports.append(report)
            logger.debug("layer %d: alpha %s", i, report.alphas)
        quantized = quantize_linears(layer, config)
        if config.search_scale:
            runner.advance(runner.forward(layer) if config.propagate == "quantized" else outputs)
            del outputs
        for name, q in quantized.items():
            packed[f"model.layers.{i}.{name}"] = pack_linear(q)
    seconds = tool_run.finish(run, work_dir, packed, quantization_config(config.w_bits, config.w_group_size))
    return AwqResult(Path(work_dir).expanduser(), num_samples, seconds, reports)
