"""Model building blocks: linear, norm, rotary, attention, activation, embedding layers."""

from .activation import GeluAndMul, SiluAndMul, act_and_mul
from .attention import Attention
from .embedding import LMHead, VocabEmbedding
from .linear import (
    LinearBase,
    LinearMethod,
    MergedLinear,
    QKVLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
)
from .norm import RMSNorm
from .rotary import RotaryEmbedding, get_rope

__all__ = [
    "Attention", "GeluAndMul", "LMHead", "LinearBase", "LinearMethod", "MergedLinear", "QKVLinear", "RMSNorm",
    "RotaryEmbedding", "RowParallelLinear", "SiluAndMul", "UnquantizedLinearMethod", "VocabEmbedding",
    "act_and_mul", "get_rope",
]
