"""``auto_awq``: a Hugging Face model directory in, a 4-bit AWQ "gemm" checkpoint out.

Every setting, the model's shapes, the work directory and the calibration text are checked
before the model is loaded. The model then runs one decoder layer at a time over the
calibration windows (``calibration.LayerwiseRunner``); each layer is searched, folded, clipped
and quantized (``awq.awq_layer``) and its output becomes the next layer's input. With
``search_scale=False`` no calibration runs at all: every linear is rounded to nearest.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from .awq import LayerReport, awq_layer, keep_samples, quantize_linears, recorded_inputs
from .awq_layout import pack_linear
from .calibration import (
    SUPPORTED_MODEL_TYPES,
    LayerwiseRunner,
    calibration_windows,
    load_causal_lm,
    read_text,
    tokenize_for_calibration,
)
from .checkpoint import atomic_directory, awq_state_dict, check_work_dir, write_awq_checkpoint
from .config import AwqConfig, QuantizationError

logger = logging.getLogger(__name__)


@dataclass
class AwqResult:
    """What a run did: where it wrote, how many calibration windows it used, how long it took."""

    work_dir: Path
    calib_samples: int
    seconds: float
    layers: list[LayerReport] = field(default_factory=list)


def _model_config(model_dir: Path) -> dict:
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise QuantizationError(
            f"{model_dir} is not a Hugging Face model directory (no config.json): pass the directory of an "
            "fp16/bf16/fp32 checkpoint")
    config = json.loads(config_path.read_text())
    if config.get("quantization_config"):
        raise QuantizationError(f"{model_dir} is already quantized ({config['quantization_config'].get('quant_method')})")
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise QuantizationError(
            f"auto_awq supports model types {', '.join(SUPPORTED_MODEL_TYPES)}; {model_dir} is {model_type!r}")
    return config


def _pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AMX or AVX512-BF16; Linux /proc/cpuinfo)."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def pick_dtypes(dtype: str, device: torch.device, hf_config: dict) -> tuple[torch.dtype, torch.dtype]:
    """(weights dtype, compute dtype) of the calibration model.

    On CPU the weights stay float32 (the checkpoint is quantized from them) and ``auto`` computes
    in bfloat16 where the CPU does that natively, else float32. On a GPU both are the model's
    half type (``auto``) or the named one.
    """
    if device.type == "cpu":
        if dtype == "auto":
            return torch.float32, torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
        return torch.float32, _DTYPES[dtype]
    if dtype == "auto":
        stored = hf_config.get("dtype") or hf_config.get("torch_dtype")
        half = torch.bfloat16 if stored == "bfloat16" else torch.float16
        return half, half
    return _DTYPES[dtype], _DTYPES[dtype]


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
    model_dir = Path(model_dir).expanduser()
    if not model_dir.is_dir():
        raise QuantizationError(f"model {model_dir} is not a directory: pass a Hugging Face model directory")
    hf_config = _model_config(model_dir)
    config.check_model(hf_config)
    check_work_dir(work_dir)
    if dtype not in ("auto", "float32", "float16", "bfloat16"):
        raise QuantizationError(f"dtype {dtype!r}: use auto, float32, float16 or bfloat16")
    text = None
    if config.search_scale:
        if calib_dataset is None:
            raise QuantizationError("the AWQ search needs a calibration dataset (a .txt or .jsonl file)")
        text = read_text(calib_dataset)
    dev = _pick_device(device)
    weights_dtype, compute_dtype = pick_dtypes(dtype, dev, hf_config)

    model = load_causal_lm(model_dir, dev, weights_dtype)
    layers = model.model.layers
    reports: list[LayerReport] = []
    packed: dict[str, dict[str, torch.Tensor]] = {}
    num_samples = 0
    if config.search_scale:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        windows = calibration_windows(tokenize_for_calibration(tokenizer, text), config.calib_samples,
                                      config.calib_seqlen)
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
    tensors = awq_state_dict(model.state_dict(), packed, bool(hf_config.get("tie_word_embeddings", False)))
    del model
    with atomic_directory(work_dir) as tmp:
        write_awq_checkpoint(model_dir, tmp, tensors, config.w_bits, config.w_group_size)
    seconds = time.perf_counter() - start
    logger.info("AWQ checkpoint written to %s in %.1f s", work_dir, seconds)
    return AwqResult(Path(work_dir).expanduser(), num_samples, seconds, reports)
