"""Post-training weight quantization: calibration, AWQ search, the AWQ "gemm" checkpoint layout."""

from .awq_tool import AwqResult, auto_awq
from .awq_layout import awq_pack, awq_unpack, dequantize_awq_ref, pack_linear, unpack_linear
from .calibration import InputRecord, LayerwiseRunner, calibration_windows, load_causal_lm, read_text
from .checkpoint import dequantize_checkpoint, quantization_config, read_awq_config
from .config import SUPPORTED_BITS, SUPPORTED_GROUP_SIZES, AwqConfig, QuantizationError
from .quantizer import GroupQuantized, fake_quantize, quantize

__all__ = [
    "SUPPORTED_BITS", "SUPPORTED_GROUP_SIZES", "AwqConfig", "AwqResult", "GroupQuantized", "InputRecord",
    "LayerwiseRunner", "QuantizationError", "auto_awq", "awq_pack", "awq_unpack", "calibration_windows",
    "dequantize_awq_ref", "dequantize_checkpoint", "fake_quantize", "load_causal_lm", "pack_linear",
    "quantization_config", "quantize", "read_awq_config", "read_text", "unpack_linear",
]
