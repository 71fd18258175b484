"""Post-training weight quantization: calibration, AWQ (W4A16) and SmoothQuant (W8A8), their checkpoint layouts."""

from .awq_tool import AwqResult, auto_awq
from .awq_layout import awq_pack, awq_unpack, dequantize_awq_ref, pack_linear, unpack_linear
from .calibration import InputRecord, LayerwiseRunner, calibration_windows, load_causal_lm, read_text
from .checkpoint import dequantize_checkpoint, quantization_config, read_awq_config, w8a8_quantization_config
from .config import SUPPORTED_BITS, SUPPORTED_GROUP_SIZES, AwqConfig, QuantizationError, SmoothQuantConfig
from .quantizer import GroupQuantized, fake_quantize, quantize
from .smooth_quant_tool import SmoothQuantResult, smooth_quant

__all__ = [
    "SUPPORTED_BITS", "SUPPORTED_GROUP_SIZES", "AwqConfig", "AwqResult", "GroupQuantized", "InputRecord",
    "LayerwiseRunner", "QuantizationError", "auto_awq", "awq_pack", "awq_unpack", "calibration_windows",
    "dequantize_awq_ref", "dequantize_checkpoint", "fake_quantize", "load_causal_lm", "pack_linear",
    "quantization_config", "quantize", "read_awq_config", "read_text", "smooth_quant", "unpack_linear",
    "SmoothQuantConfig", "SmoothQuantResult", "w8a8_quantization_config",
]
