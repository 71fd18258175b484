"""Compute kernels, each with the plain-torch reference it is tested against.

Each public function dispatches to a Triton kernel for CUDA tensors when Triton imports and to
its ``*_ref`` otherwise; ``set_kernel_mode("ref" | "triton")`` forces one side for the process
(the engine applies ``EngineConfig.kernels`` so; see ``_triton``).
"""

from ._triton import HAS_TRITON, KERNEL_MODES, kernel_mode, set_kernel_mode
from .activation import silu_and_mul, silu_and_mul_ref, silu_and_mul_triton
from .attention import alibi_slopes, paged_attention, paged_attention_ref, paged_attention_triton
from .kv_cache import (
    rotate_and_store_kv,
    rotate_and_store_kv_ref,
    rotate_and_store_kv_triton,
    store_kv,
    store_kv_ref,
    store_kv_triton,
)
from .rms_norm import (
    add_rms_norm,
    add_rms_norm_ref,
    add_rms_norm_triton,
    rms_norm,
    rms_norm_ref,
    rms_norm_triton,
)
from .rotary import apply_rotary, apply_rotary_ref, apply_rotary_triton
from .sampling import seeded_race, seeded_race_ref, seeded_race_triton
from .w4a16 import (
    awq_pack,
    awq_unpack,
    dequantize_awq_ref,
    w4a16_matmul,
    w4a16_matmul_ref,
    w4a16_matmul_triton,
)
from .w8a8 import (
    int8_matmul,
    int8_matmul_int_mm,
    int8_matmul_ref,
    int8_matmul_triton,
    quant_per_token,
    quant_per_token_ref,
    quant_per_token_triton,
    rms_norm_quant,
    rms_norm_quant_ref,
    rms_norm_quant_triton,
)

__all__ = [
    "HAS_TRITON", "KERNEL_MODES", "kernel_mode", "set_kernel_mode", "add_rms_norm", "add_rms_norm_ref",
    "add_rms_norm_triton", "apply_rotary", "apply_rotary_ref", "apply_rotary_triton", "paged_attention",
    "paged_attention_ref", "paged_attention_triton", "rms_norm", "rotate_and_store_kv", "rotate_and_store_kv_ref",
    "rotate_and_store_kv_triton", "rms_norm_ref", "rms_norm_triton", "seeded_race", "seeded_race_ref",
    "seeded_race_triton", "silu_and_mul", "silu_and_mul_ref", "silu_and_mul_triton", "store_kv", "store_kv_ref",
    "store_kv_triton", "awq_pack", "awq_unpack", "dequantize_awq_ref", "w4a16_matmul", "w4a16_matmul_ref",
    "w4a16_matmul_triton", "int8_matmul", "int8_matmul_int_mm", "int8_matmul_ref", "int8_matmul_triton",
    "quant_per_token", "quant_per_token_ref", "quant_per_token_triton", "rms_norm_quant", "rms_norm_quant_ref",
    "rms_norm_quant_triton", "alibi_slopes",
]
