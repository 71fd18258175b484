"""InternViT, the vision transformer of InternVL 2.5 / 3, in plain torch.

A pre-norm ViT with learned per-channel scales on both residual branches (layer scale:
``x + lambda_1 * attn(norm(x))``, ``x + lambda_2 * mlp(norm(x))``), LayerNorm or RMSNorm blocks,
an optional RMSNorm over the whole query / key width before the heads split (InternViT-6B's
``qk_normalization``), a biased patch convolution, a learned class token and learned positions.

Modules and parameters carry transformers' names (``InternVLVisionModel``: ``embeddings.cls_token``,
``encoder.layer.N.attention.q_proj``, ``lambda_1``, ...); ``remote_names`` maps the remote-code
checkpoints' names (OpenGVLab's ``InternVisionModel``: ``embeddings.class_embedding``,
``encoder.layers.N.attn.qkv``, ``ls1``, ...) onto them. Like the CLIP tower (``vision.py``) it runs
once per image at prefill, keeps no KV cache, and is replicated on every tensor-parallel rank.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import sdpa_kernel

from ..weight_loader import materialize
from .layer_norm import LayerNorm
from .norm import RMSNorm
from .vision import _SDPA_BACKENDS, VisionMLP


def _pair(value: Any) -> int:
    """A size that transformers' config may give as ``[h, w]`` or one int; InternViT's are square."""
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise ValueError(f"InternViT with a non-square size {list(value)} is not supported")
        return int(value[0])
    return int(value)


def _norm(kind: str, hidden: int, eps: float) -> nn.Module:
    if kind == "layer_norm":
        return LayerNorm(hidden, eps)
    if kind == "rms_norm":
        return RMSNorm(hidden, eps)
    raise ValueError(f"InternViT norm_type {kind!r} is not supported: use layer_norm or rms_norm")


class InternVitAttention(nn.Module):
    """Bidirectional attention over one tile's tokens; q/k optionally RMS-normed over their whole
    width (all heads at once, as InternViT-6B does) before the heads split."""

    def __init__(self, hidden: int, heads: int, bias: bool, qk_norm: bool, qk_eps: float) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"vision hidden size {hidden} is not a multiple of its {heads} heads")
        self.heads, self.head_dim = heads, hidden // heads
        self.q_proj = nn.Linear(hidden, hidden, bias=bias)
        self.k_proj = nn.Linear(hidden, hidden, bias=bias)
        self.v_proj = nn.Linear(hidden, hidden, bias=bias)
        self.q_norm = RMSNorm(hidden, qk_eps) if qk_norm else None
        self.k_norm = RMSNorm(hidden, qk_eps) if qk_norm else None
        self.projection_layer = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)

        def split(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, self.heads, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(split(q), split(k), split(v))
        return self.projection_layer(out.transpose(1, 2).reshape(b, t, -1))


class InternVitLayer(nn.Module):
    """x + lambda_1 * attn(norm_before(x)), then x + lambda_2 * mlp(norm_after(x))."""

    def __init__(self, config: dict[str, Any], qk_eps: float) -> None:
        super().__init__()
        hidden, eps = int(config["hidden_size"]), float(config.get("layer_norm_eps", 1e-6))
        norm = config.get("norm_type", "layer_norm")
        self.attention = InternVitAttention(hidden, int(config["num_attention_heads"]),
                                            bool(config.get("attention_bias", False)),
                                            bool(config.get("use_qk_norm", False)), qk_eps)
        self.mlp = VisionMLP(hidden, int(config["intermediate_size"]), config.get("hidden_act", "gelu"))
        self.layernorm_before = _norm(norm, hidden, eps)
        self.layernorm_after = _norm(norm, hidden, eps)
        self.lambda_1 = nn.Parameter(torch.ones(hidden))
        self.lambda_2 = nn.Parameter(torch.ones(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.lambda_1 * self.attention(self.layernorm_before(x))
        return x + self.lambda_2 * self.mlp(self.layernorm_after(x))


class InternVitEmbeddings(nn.Module):
    """Patches by a strided, biased convolution (one GEMM: its kernel is its stride), the class
    token first, the learned positions added. Tiles come at the trained size, so the positions
    are never interpolated."""

    def __init__(self, hidden: int, image_size: int, patch_size: int, channels: int) -> None:
        super().__init__()
        self.image_size, self.patch_size = image_size, patch_size
        self.cls_token = nn.Parameter(torch.empty(1, 1, hidden))
        self.patch_embeddings = nn.Module()
        self.patch_embeddings.projection = nn.Conv2d(channels, hidden, kernel_size=patch_size, stride=patch_size)
        self.position_embeddings = nn.Parameter(torch.empty(1, (image_size // patch_size) ** 2 + 1, hidden))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        b, c, h, w = pixels.shape
        p = self.patch_size
        if h != self.image_size or w != self.image_size:
            raise ValueError(f"a tile of {h}x{w} pixels does not fit this encoder: it takes "
                             f"{self.image_size}x{self.image_size} tiles (its processor's)")
        conv = self.patch_embeddings.projection
        patches = (pixels.to(conv.weight.dtype).view(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
                   .reshape(b, (h // p) * (w // p), c * p * p))
        patches = patches @ conv.weight.view(conv.weight.shape[0], -1).t() + conv.bias
        cls = self.cls_token.expand(b, 1, -1).to(patches.dtype)
        return torch.cat([cls, patches], dim=1) + self.position_embeddings.to(patches.dtype)


class InternVisionModel(nn.Module):
    """InternViT up to the layer whose output the model reads.

    ``feature_layer`` indexes transformers' ``hidden_states`` (0: the embeddings; ``k``: after
    ``k`` layers; negative from the end of the full depth), so only that many layers are built;
    ``final_norm``: the -hf layout's ``layernorm`` after the last layer (its ``use_mean_pooling``
    false), applied when the last layer is the one read. ``qk_eps``: the q/k norms' epsilon
    (transformers' fixed 1e-6; the remote code's ``layer_norm_eps``).
    """

    def __init__(self, config: dict[str, Any], feature_layer: int, qk_eps: float = 1e-6,
                 final_norm: bool = False) -> None:
        super().__init__()
        self.depth = int(config["num_hidden_layers"])
        self.feature_layer = feature_layer if feature_layer >= 0 else self.depth + 1 + feature_layer
        if not 0 <= self.feature_layer <= self.depth:
            raise ValueError(f"vision feature layer {feature_layer} is outside the tower's {self.depth} layers")
        hidden = int(config["hidden_size"])
        self.embeddings = InternVitEmbeddings(hidden, _pair(config["image_size"]), _pair(config["patch_size"]),
                                              int(config.get("num_channels", 3)))
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(InternVitLayer(config, qk_eps) for _ in range(self.feature_layer))
        self.layernorm = (LayerNorm(hidden, float(config.get("layer_norm_eps", 1e-6)))
                          if final_norm and self.feature_layer == self.depth else None)

    def unused_prefixes(self, final_norm: bool) -> tuple[str, ...]:
        """Names (transformers') under the tower this build leaves out: deeper layers, the final
        norm when an earlier layer is read."""
        skipped = tuple(f"encoder.layer.{i}." for i in range(len(self.encoder.layer), self.depth))
        return (*skipped, "layernorm.") if final_norm and self.layernorm is None else skipped

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[B, C, H, W] tiles -> [B, 1 + patches, hidden]: the chosen layer's states, CLS first."""
        with sdpa_kernel(_SDPA_BACKENDS):  # not cuDNN's attention: see vision.ClipVisionModel
            x = self.embeddings(pixels)
            for layer in self.encoder.layer:
                x = layer(x)
        return x if self.layernorm is None else self.layernorm(x)


# Remote-code (OpenGVLab) InternViT names -> transformers' names, after ``vision_model.``.
_REMOTE_RENAMES = (
    ("embeddings.class_embedding", "embeddings.cls_token"),
    ("embeddings.patch_embedding.", "embeddings.patch_embeddings.projection."),
    ("embeddings.position_embedding", "embeddings.position_embeddings"),
    (".attn.proj.", ".attention.projection_layer."),
    (".attn.q_norm.", ".attention.q_norm."),
    (".attn.k_norm.", ".attention.k_norm."),
    (".norm1.", ".layernorm_before."),
    (".norm2.", ".layernorm_after."),
    (".ls1", ".lambda_1"),
    (".ls2", ".lambda_2"),
)


def remote_names(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """A remote-code InternViT tensor (``embeddings.class_embedding``, ``encoder.layers.N.attn.qkv``,
    ...) as the transformers-named tensors it holds; the fused ``qkv`` splits into q, k, v (its
    rows are ``[q | k | v]``)."""
    name = name.replace("encoder.layers.", "encoder.layer.", 1)
    if ".attn.qkv." in name:
        for part, piece in zip(("q_proj", "k_proj", "v_proj"), materialize(tensor).chunk(3, dim=0)):
            yield name.replace(".attn.qkv.", f".attention.{part}."), piece
        return
    for old, new in _REMOTE_RENAMES:
        if old in name:
            yield name.replace(old, new), tensor
            return
    yield name, tensor


def check_shuffle(image_size: int, patch_size: int, downsample_ratio: float) -> int:
    """The pixel shuffle's factor (1 / ``downsample_ratio``); ValueError unless it is an integer
    that divides a tile's side in patches."""
    factor = 1 / downsample_ratio
    side = image_size // patch_size
    if not math.isclose(factor, round(factor)) or side % round(factor):
        raise ValueError(f"downsample_ratio {downsample_ratio} does not divide a tile's {side} patches a side")
    return round(factor)
