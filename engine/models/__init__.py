"""Model implementations, one file per family, and ``build_model``; which class serves which
``architectures`` name is ``engine/model_registry.py``'s table (its modules load on first use)."""

from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn

from ..model_config import ModelConfig
from ..model_registry import SUPPORTED_ARCHITECTURES, model_class

logger = logging.getLogger(__name__)


def build_model(
    config: ModelConfig,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    rope_scaling_factor: float = 0.0,
    max_position: int | None = None,
) -> nn.Module:
    """Instantiate the model for ``config`` with uninitialized weights, in eval / no-grad mode.

    ``dtype`` defaults to ``config.dtype``; ``device`` to the current default device.
    ``rope_scaling_factor > 0`` turns on dynamic NTK RoPE with that factor (LMDeploy's setting)
    unless the config already scales RoPE. ``max_position`` sizes the RoPE table (default: the
    context the config's scaling reaches).
    """
    cls = model_class(config.architecture)
    dtype = dtype or config.dtype
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device) if device is not None else contextlib.nullcontext():
            model = cls(config, rope_scaling_factor=rope_scaling_factor, max_position=max_position)
    finally:
        torch.set_default_dtype(previous)
    model.requires_grad_(False)
    model.eval()
    logger.debug("built %s (%s, %s)", cls.__name__, dtype, device)
    return model


__all__ = ["SUPPORTED_ARCHITECTURES", "build_model"]
