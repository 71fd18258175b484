"""Model building blocks: linear, norm, rotary, attention, activation, embedding layers."""

from .activation import Activation, DenseMLP, GeluAndMul, SiluAndMul, act_and_mul, activation
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
from .layer_norm import LayerNorm
from .moe import FusedMoE, Router, SparseMoeBlock
from .norm import RMSNorm
from .rotary import RotaryEmbedding, get_rope

__all__ = [
    "Activation", "Attention", "DenseMLP", "FusedMoE", "GeluAndMul", "LMHead", "LayerNorm", "LinearBase",
    "LinearMethod", "MergedLinear", "QKVLinear", "RMSNorm", "RotaryEmbedding", "Router", "RowParallelLinear",
    "SiluAndMul", "SparseMoeBlock", "UnquantizedLinearMethod", "VocabEmbedding",
    "act_and_mul", "activation", "get_rope",
]
