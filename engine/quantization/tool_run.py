"""What both quantization tools (``auto_awq``, ``smooth_quant``) do around their per-layer loop.

``begin`` checks every input before anything heavy happens (the model directory, the work
directory, the calibration file), then loads the Hugging Face model and, when the tool
calibrates, its calibration windows and ``LayerwiseRunner``. ``finish`` writes the quantized
checkpoint atomically and returns the run's seconds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from .calibration import (LayerwiseRunner, checked_model_dir, load_causal_lm, model_windows, pick_device, pick_dtypes,
                          read_text)
from .checkpoint import atomic_directory, check_work_dir, quantized_state_dict, write_quantized_checkpoint
from .config import QuantizationError

logger = logging.getLogger(__name__)


class CalibrationSettings(Protocol):
    """The calibration fields AwqConfig and SmoothQuantConfig share."""

    calib_samples: int
    calib_seqlen: int
    batch_size: int


@dataclass
class ToolRun:
    """A started tool run: the checked model, its loaded Hugging Face model and, when the tool
    calibrates, the runner over the calibration windows (None otherwise)."""

    name: str
    model_dir: Path
    hf_config: dict[str, Any]
    model: nn.Module | None
    runner: LayerwiseRunner | None
    num_samples: int
    start: float


def begin(name: str, model_dir: str | Path, work_dir: str | Path, settings: CalibrationSettings, calibrate: bool,
          calib_dataset: str | Path | None, device: str, dtype: str, needs_dataset: str,
          check_model: Callable[[dict[str, Any]], None] | None = None) -> ToolRun:
    """Check the inputs (raising QuantizationError before any work), then load the model and,
    with ``calibrate``, its calibration windows. ``needs_dataset`` names what wants the
    calibration file in the error for its absence; ``check_model`` is the tool's own check of
    the model's config."""
    start = time.perf_counter()
    model_dir, hf_config = checked_model_dir(model_dir, name)
    if check_model is not None:
        check_model(hf_config)
    check_work_dir(work_dir)
    text = None
    if calibrate:
        if calib_dataset is None:
            raise QuantizationError(f"{needs_dataset} needs a calibration dataset (a .txt or .jsonl file)")
        text = read_text(calib_dataset)
    dev = pick_device(device)
    weights_dtype, compute_dtype = pick_dtypes(dtype, dev, hf_config)

    model = load_causal_lm(model_dir, dev, weights_dtype)
    runner, num_samples = None, 0
    if calibrate:
        windows = model_windows(model_dir, text, settings.calib_samples, settings.calib_seqlen)
        num_samples = windows.shape[0]
        logger.info("%s calibration: %d windows of %d tokens; weights %s, compute %s", name, num_samples,
                    settings.calib_seqlen, weights_dtype, compute_dtype)
        runner = LayerwiseRunner(model, windows, settings.batch_size, compute_dtype)
    return ToolRun(name, model_dir, hf_config, model, runner, num_samples, start)


def finish(run: ToolRun, work_dir: str | Path, stored: Mapping[str, Mapping[str, torch.Tensor]],
           quant_config: dict[str, Any], state: Mapping[str, torch.Tensor] | None = None) -> float:
    """Write the checkpoint (the model's other tensors as they are, ``stored`` for the decoder
    linears) to ``work_dir`` atomically; returns the run's seconds so far. ``state``: the model's
    tensors under other names than its state dict's (the MoE families' published per-expert ones)."""
    tied = bool(run.hf_config.get("tie_word_embeddings", False))
    tensors = quantized_state_dict(run.model.state_dict() if state is None else state, stored, tied)
    run.model = run.runner = None  # the calibration model's memory goes before the writing
    with atomic_directory(work_dir) as tmp:
        write_quantized_checkpoint(run.model_dir, tmp, tensors, quant_config)
    seconds = time.perf_counter() - run.start
    logger.info("%s checkpoint written to %s in %.1f s", run.name, work_dir, seconds)
    return seconds
