"""``auto_awq``: a Hugging Face model directory in, a 4-bit AWQ "gemm" checkpoint out.

Every setting, the model's shapes, the work directory and the calibration text are checked
before the model is loaded. The model then runs one decoder layer at a time over the
calibration windows (``calibration.LayerwiseRunner``); each layer is searched, folded, clipped
and quantized (``awq.awq_layer``) and its output becomes the next layer's input. With
``search_scale=False`` no calibration runs at all: every linear is rounded to nearest.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from .awq import LayerReport, awq_layer, keep_samples, quantize_linears
from .awq_layout import pack_linear
from .calibration import (
    LayerwiseRunner,
    checked_model_dir,
    load_causal_lm,
    model_windows,
    pick_device,
    pick_dtypes,
    read_text,
)
from .checkpoint import atomic_directory, check_work_dir, quantization_config, quantized_state_dict, write_quantized_checkpoint
from .config import AwqConfig, QuantizationError
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
    start = time.perf_counter()
    model_dir, hf_config = checked_model_dir(model_dir, "auto_awq")
    config.check_model(hf_config)
    check_work_dir(work_dir)
    text = None
    if config.search_scale:
        if calib_dataset is None:
            raise QuantizationError("the AWQ search needs a calibration dataset (a .txt or .jsonl file)")
        text = read_text(calib_dataset)
    dev = pick_device(device)
    weights_dtype, compute_dtype = pick_dtypes(dtype, dev, hf_config)

    model = load_causal_lm(model_dir, dev, weights_dtype)
    layers = model.model.layers
    reports: list[LayerReport] = []
    packed: dict[str, dict[str, torch.Tensor]] = {}
    num_samples = 0
    if config.search_scale:
        windows = model_windows(model_dir, text, config.calib_samples, config.calib_seqlen)
        num_samples = windows.shape[0]
        logger.info("AWQ calibration: %d windows of %d tokens; weights %s, compute %s", num_samples,
                    config.calib_seqlen, weights_dtype, compute_dtype)
        runner = LayerwiseRunner(model, windows, config.batch_size, compute_dtype)
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
    tensors = quantized_state_dict(model.state_dict(), packed, bool(hf_config.get("tie_word_embeddings", False)))
    del model
    with atomic_directory(work_dir) as tmp:
        write_quantized_checkpoint(model_dir, tmp, tensors, quantization_config(config.w_bits, config.w_group_size))
    seconds = time.perf_counter() - start
    logger.info("AWQ checkpoint written to %s in %.1f s", work_dir, seconds)
    return AwqResult(Path(work_dir).expanduser(), num_samples, seconds, reports)
