"""Vision encoders of vision-language models, in plain torch: the CLIP vision transformer (LLaVA).

An encoder runs once per image at prefill, on whole images batched together; it keeps no KV
cache, so its attention is torch's ``scaled_dot_product_attention`` over each image's patches.
Modules and parameters carry transformers' names (``vision_model.embeddings.patch_embedding``,
``encoder.layers.N.self_attn.q_proj``, ...), so a checkpoint's tensors load by name. The tower is
replicated on every tensor-parallel rank (it is small beside the language model).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from .layer_norm import LayerNorm


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


# transformers' ACT2FN names the vision configs use, as torch functions.
ACTIVATIONS = {
    "quick_gelu": _quick_gelu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "relu": F.relu,
}


def activation(name: str):
    """The torch function of an ``hidden_act`` / ``projector_hidden_act`` name."""
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported in vision encoders: use one of "
                         f"{', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class VisionAttention(nn.Module):
    """Bidirectional multi-head attention over one image's tokens, with biased projections."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"vision hidden size {hidden} is not a multiple of its {heads} heads")
        self.heads, self.head_dim = heads, hidden // heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape

        def split(proj: nn.Linear) -> torch.Tensor:
            return proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(split(self.q_proj), split(self.k_proj), split(self.v_proj))
        return self.out_proj(out.transpose(1, 2).reshape(b, t, -1))


class VisionMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, intermediate)
        self.fc2 = nn.Linear(intermediate, hidden)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class ClipEncoderLayer(nn.Module):
    """Pre-norm transformer block: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, hidden: int, heads: int, intermediate: int, act: str, eps: float) -> None:
        super().__init__()
        self.layer_norm1 = LayerNorm(hidden, eps)
        self.self_attn = VisionAttention(hidden, heads)
        self.layer_norm2 = LayerNorm(hidden, eps)
        self.mlp = VisionMLP(hidden, intermediate, act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class ClipEmbeddings(nn.Module):
    """Patches by a strided convolution, a learned class token first, learned positions added."""

    def __init__(self, hidden: int, image_size: int, patch_size: int, channels: int) -> None:
        super().__init__()
        self.patch_size = patch_size
        self.class_embedding = nn.Parameter(torch.empty(hidden))
        self.patch_embedding = nn.Conv2d(channels, hidden, kernel_size=patch_size, stride=patch_size, bias=False)
        self.num_positions = (image_size // patch_size) ** 2 + 1
        self.position_embedding = nn.Embedding(self.num_positions, hidden)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        # The convolution's kernel is its stride: each patch's pixels times the kernel, one GEMM over
        # all patches (cuDNN, asked for this convolution, picks its algorithm on each new shape's
        # first call: up to ~1 s for the first image, tens of ms per new image count).
        b, c, h, w = pixels.shape
        p = self.patch_size
        if (h // p) * (w // p) + 1 != self.num_positions or h % p or w % p:
            side = int(math.isqrt(self.num_positions - 1)) * p
            raise ValueError(f"an image of {h}x{w} pixels does not fit this encoder: it takes {side}x{side} images "
                             "(its processor's crop)")
        weight = self.patch_embedding.weight
        patches = (pixels.to(weight.dtype).view(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
                   .reshape(b, (h // p) * (w // p), c * p * p))
        patches = patches @ weight.view(weight.shape[0], -1).t()
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class ClipVisionModel(nn.Module):
    """CLIP's vision transformer up to the deepest layer whose output the model reads.

    ``hidden_states(pixels, layers)`` returns transformers' ``hidden_states[i]`` for each ``i``
    (0: the embeddings after ``pre_layrnorm``; ``k``: after ``k`` layers; negative from the end of
    the full depth ``num_hidden_layers``), so only ``max(i)`` layers are built and run; the
    checkpoint's deeper layers and ``post_layernorm`` are left out (``unused_prefixes``).
    """

    def __init__(self, config: dict[str, Any], feature_layers: list[int]) -> None:
        super().__init__()
        self.depth = int(config["num_hidden_layers"])
        self.feature_layers = [i if i >= 0 else self.depth + 1 + i for i in feature_layers]
        if not all(0 <= i <= self.depth for i in self.feature_layers):
            raise ValueError(f"vision_feature_layer {feature_layers} is outside the tower's {self.depth} layers")
        hidden, eps = int(config["hidden_size"]), float(config.get("layer_norm_eps", 1e-5))
        self.vision_model = nn.Module()
        self.vision_model.embeddings = ClipEmbeddings(hidden, int(config["image_size"]), int(config["patch_size"]),
                                                      int(config.get("num_channels", 3)))
        self.vision_model.pre_layrnorm = LayerNorm(hidden, eps)
        self.vision_model.encoder = nn.Module()
        self.vision_model.encoder.layers = nn.ModuleList(
            ClipEncoderLayer(hidden, int(config["num_attention_heads"]), int(config["intermediate_size"]),
                             config.get("hidden_act", "quick_gelu"), eps)
            for _ in range(max(self.feature_layers)))

    def unused_prefixes(self) -> tuple[str, ...]:
        """Checkpoint names under the tower that this build leaves out (deeper layers, the final norm)."""
        built = len(self.vision_model.encoder.layers)
        return ("vision_model.post_layernorm.", "vision_model.embeddings.position_ids",
                *(f"vision_model.encoder.layers.{i}." for i in range(built, self.depth)))

    def hidden_states(self, pixels: torch.Tensor) -> list[torch.Tensor]:
        """[B, C, H, W] -> each feature layer's [B, 1 + patches, hidden]."""
        # Not cuDNN's attention, which torch may pick on Hopper: it builds a graph on each new
        # shape's first call, and a step's image count is often new. Warm, both run the same.
        with sdpa_kernel(_SDPA_BACKENDS):
            x = self.vision_model.pre_layrnorm(self.vision_model.embeddings(pixels))
            states = [x]
            for layer in self.vision_model.encoder.layers:
                x = layer(x)
                states.append(x)
        return [states[i] for i in self.feature_layers]


_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
