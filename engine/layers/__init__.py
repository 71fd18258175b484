"""Model building blocks: linear, norm, rotary, attention, activation, embedding layers."""

from conveyor.engine.layers.activation import SiluAndMul
from conveyor.engine.layers.attention import Attention
from conveyor.engine.layers.embedding import LMHead, VocabEmbedding
from conveyor.engine.layers.linear import (
    LinearBase,
    LinearMethod,
    MergedLinear,
    QKVLinear,
    ReplicatedLinear,
    UnquantizedLinearMethod,
)
from conveyor.engine.layers.norm import RMSNorm
from conveyor.engine.layers.rotary import RotaryEmbedding, get_rope

__all__ = [
    "Attention", "LMHead", "LinearBase", "LinearMethod", "MergedLinear", "QKVLinear", "RMSNorm",
    "ReplicatedLinear", "RotaryEmbedding", "SiluAndMul", "UnquantizedLinearMethod", "VocabEmbedding",
    "get_rope",
]
