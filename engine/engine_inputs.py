"""What one engine rank is built from: the model's directory and config, its device and dtype.

Rank 0 (``LLMEngine``) and the other tensor-parallel ranks (``tp_workers.run_tp_rank``) resolve
them the same way, so both import this module (and neither imports the other for it).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..protocol.errors import EngineConfigError
from .config import EngineConfig
from .distributed import check_tp_shapes
from .model_config import ModelConfig, parse_dtype
from .model_registry import check_tp_support
from .quant_format import resolve_quant_format
from .weight_loader import load_model_config, resolve_model_path


def pick_device(name: str, rank: int = 0, tp: int = 1) -> torch.device:
    """The device of tensor-parallel rank ``rank``: ``cuda:<rank>`` of the visible GPUs (pick
    them with CUDA_VISIBLE_DEVICES), or the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type != "cuda" or (tp == 1 and device.index is not None):
        return device
    if tp > 1 and device.index is not None:
        raise EngineConfigError(f"device={name!r} names one GPU but tp={tp}: use device='cuda' (rank r takes "
                                "cuda:r) and choose the GPUs with CUDA_VISIBLE_DEVICES")
    if tp > torch.cuda.device_count():
        raise EngineConfigError(f"tp={tp} needs {tp} GPUs; {torch.cuda.device_count()} visible")
    return torch.device("cuda", rank)


def pick_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The activation dtype: ``name``, or for "auto" the checkpoint's (bfloat16 for a float32
    checkpoint on the GPU; float32 on the CPU)."""
    if name != "auto":
        return parse_dtype(name)
    if device.type == "cpu":
        return torch.float32  # CPU matmuls in half precision are slow and less exact
    return torch.bfloat16 if model_dtype == torch.float32 else model_dtype


def resolve_engine_inputs(model_path: str | Path, config: EngineConfig, rank: int = 0
                          ) -> tuple[Path, ModelConfig, torch.device, torch.dtype]:
    """(model directory, model config with its weight format, device, dtype) of one rank."""
    path = resolve_model_path(model_path, config.revision, download_dir=config.download_dir)
    model_config = load_model_config(path)
    model_config.quant = resolve_quant_format(model_config, config.model_format,
                                              dummy_weights=config.load_format == "dummy")
    quant = model_config.quant
    check_tp_support(model_config.architecture, config.tp)
    check_tp_shapes(model_config.num_heads, model_config.num_kv_heads, model_config.head_dim,
                    model_config.intermediate_size, config.tp,
                    quant.group_size if quant and quant.method == "awq" else None)
    device = pick_device(config.device, rank, config.tp)
    return path, model_config, device, pick_dtype(config.dtype, model_config.dtype, device)
