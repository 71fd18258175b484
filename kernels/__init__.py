"""Compute kernels, each with the plain-torch reference it is tested against."""

from conveyor.kernels.activation import silu_and_mul, silu_and_mul_ref
from conveyor.kernels.attention import paged_attention, paged_attention_ref
from conveyor.kernels.kv_cache import store_kv, store_kv_ref
from conveyor.kernels.rms_norm import add_rms_norm, add_rms_norm_ref, rms_norm, rms_norm_ref
from conveyor.kernels.rotary import apply_rotary, apply_rotary_ref

__all__ = [
    "add_rms_norm", "add_rms_norm_ref", "apply_rotary", "apply_rotary_ref",
    "paged_attention", "paged_attention_ref", "rms_norm", "rms_norm_ref",
    "silu_and_mul", "silu_and_mul_ref", "store_kv", "store_kv_ref",
]
