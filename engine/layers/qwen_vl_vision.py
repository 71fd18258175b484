"""Qwen-VL's vision tower (``transformer.visual`` of Qwen/Qwen-VL-Chat's remote code), in plain torch.

A 448-pixel image (the tokenizer stage resizes every image to that square) is cut into 14-pixel
patches by a convolution whose kernel is its stride (one GEMM here), gets learned absolute
positions, and runs through a pre-norm ViT (OpenCLIP's ViT-bigG shape: width 1664, 48 blocks, 16
heads, GELU MLP 8192 wide). A Resampler then pools the 32 x 32 patch states into ``n_queries``
(256) rows: learned queries cross-attend to the patches (one ``nn.MultiheadAttention`` of
``output_dim // 128`` heads), queries and keys both carrying 2-D sin-cos positions. A final
LayerNorm and a square projection give rows of the language model's width, one per image token.

Two things the remote code does that a reader may not expect, both followed here:

* The ViT's ``positional_embedding`` has 256 rows (a 16 x 16 grid, as trained at 224 pixels) and
  is resized bicubically to the image's patch grid on every call; likewise the Resampler's keys
  get its ``pos_embed`` (a ``sqrt(n_queries)`` grid) resized to the patch grid, while its queries
  get ``pos_embed`` as it is. The resize runs in float32, as the remote code's ``get_abs_pos``.
* A ViT block's ``attn.in_proj`` (a plain Linear) lays its output head by head, ``[q_h | k_h |
  v_h]`` for each head h (Megatron's layout), not ``[q | k | v]``; the Resampler's
  MultiheadAttention (``in_proj_weight``) is torch's ``[q | k | v]``.

Modules carry the checkpoint's names under ``transformer.visual.`` (``conv1``,
``transformer.resblocks.N.attn.in_proj``, ``attn_pool.kv_proj``, ...) so tensors load by name.
Like the other towers (``vision.py``) it keeps no KV cache and is replicated on every
tensor-parallel rank.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import sdpa_kernel

from ...protocol.errors import UnsupportedModelError
from .layer_norm import LayerNorm
from .vision import _SDPA_BACKENDS

_EPS = 1e-6  # every LayerNorm of the tower (the remote code's partial(nn.LayerNorm, eps=1e-6))


def resized_positions(table: torch.Tensor, side: int) -> torch.Tensor:
    """A ``[n * n, C]`` table of positions on an n x n grid as ``[side * side, C]``: bicubic, in
    float32, back in the table's dtype (unchanged when the grids already agree)."""
    n = math.isqrt(table.shape[0])
    if n == side:
        return table
    grid = table.float().reshape(1, n, n, -1).permute(0, 3, 1, 2)
    grid = F.interpolate(grid, size=(side, side), mode="bicubic", align_corners=False)
    return grid.permute(0, 2, 3, 1).flatten(0, 2).to(table.dtype)


class _BlockAttention(nn.Module):
    """Self-attention over one image's patches; ``in_proj`` rows head by head, ``[q_h | k_h | v_h]``."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, width // heads
        self.in_proj = nn.Linear(width, 3 * width)
        self.out_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.in_proj(x).view(b, t, self.heads, 3, self.head_dim).permute(3, 0, 2, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v)  # [b, heads, t, head_dim]
        return self.out_proj(out.transpose(1, 2).reshape(b, t, -1))


class _MLP(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(width, hidden)
        self.c_proj = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))  # nn.GELU(): the exact (erf) form


class _Block(nn.Module):
    """x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, width: int, heads: int, mlp_width: int) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(width, _EPS)
        self.attn = _BlockAttention(width, heads)
        self.ln_2 = LayerNorm(width, _EPS)
        self.mlp = _MLP(width, mlp_width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class _PoolAttention(nn.Module):
    """``nn.MultiheadAttention``'s parameters and computation (queries shared by the batch)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * dim, dim))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * dim))
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """[Q, dim] queries, [B, L, dim] keys and values -> [B, Q, dim]."""
        wq, wk, wv = self.in_proj_weight.chunk(3)
        bq, bk, bv = self.in_proj_bias.chunk(3)
        b, n = key.shape[:2]

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.view(x.shape[0], -1, self.heads, self.head_dim).transpose(1, 2)

        # the queries are the same for every image: projected once, copied per image (an expanded
        # view's zero batch stride is not a layout every SDPA backend takes)
        q = heads(F.linear(query, wq, bq)[None]).expand(b, -1, -1, -1).contiguous()
        out = F.scaled_dot_product_attention(q, heads(F.linear(key, wk, bk)), heads(F.linear(value, wv, bv)))
        return self.out_proj(out.transpose(1, 2).reshape(b, -1, self.heads * self.head_dim))


class _Resampler(nn.Module):
    """``n_queries`` learned queries cross-attending to the patch states (the remote ``Resampler``)."""

    def __init__(self, queries: int, dim: int, kv_dim: int) -> None:
        super().__init__()
        self.query = nn.Parameter(torch.empty(queries, dim))
        self.pos_embed = nn.Parameter(torch.empty(queries, dim))  # 2-D sin-cos, stored in the checkpoint
        self.kv_proj = nn.Linear(kv_dim, dim, bias=False) if kv_dim != dim else nn.Identity()
        self.attn = _PoolAttention(dim, dim // 128)
        self.ln_q = LayerNorm(dim, _EPS)
        self.ln_kv = LayerNorm(dim, _EPS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, side * side, kv_dim] patch states -> [B, queries, dim]."""
        keys_pos = resized_positions(self.pos_embed, math.isqrt(x.shape[1]))
        x = self.ln_kv(self.kv_proj(x))
        return self.attn(self.ln_q(self.query) + self.pos_embed, x + keys_pos, x)


def _field(visual: dict[str, Any], name: str) -> Any:
    if name not in visual:
        raise UnsupportedModelError(f"config.json's visual has no {name!r}: Qwen-VL's tower needs image_size, "
                                    "patch_size, width, layers, heads, mlp_ratio and output_dim")
    return visual[name]


class QwenVLVisionTransformer(nn.Module):
    """Qwen-VL's ViT + Resampler, from config.json's ``visual`` dict: ``[B, 3, side, side]``
    normalized pixels -> ``[B, n_queries, output_dim]``."""

    def __init__(self, visual: dict[str, Any]) -> None:
        super().__init__()
        self.image_size, self.patch_size = int(_field(visual, "image_size")), int(_field(visual, "patch_size"))
        width, heads = int(_field(visual, "width")), int(_field(visual, "heads"))
        output_dim, queries = int(_field(visual, "output_dim")), int(visual.get("n_queries", 256))
        self.grid = self.image_size // self.patch_size
        if self.image_size % self.patch_size or width % heads:
            raise UnsupportedModelError(f"Qwen-VL's visual config is inconsistent: image_size {self.image_size} is "
                                        f"not a multiple of patch_size {self.patch_size}, or width {width} of heads "
                                        f"{heads}")
        if math.isqrt(queries) ** 2 != queries or output_dim < 128 or output_dim % 128:
            raise UnsupportedModelError(f"Qwen-VL's Resampler needs a square n_queries ({queries}) and an output_dim "
                                        f"that is a multiple of 128 ({output_dim}): it has output_dim // 128 heads "
                                        "on a square grid")
        self.conv1 = nn.Conv2d(3, width, kernel_size=self.patch_size, stride=self.patch_size, bias=False)
        self.positional_embedding = nn.Parameter(torch.empty(256, width))  # 16 x 16, resized per call
        self.ln_pre = LayerNorm(width, _EPS)
        self.transformer = nn.Module()
        mlp_width = int(width * float(_field(visual, "mlp_ratio")))
        self.transformer.resblocks = nn.ModuleList(_Block(width, heads, mlp_width)
                                                   for _ in range(int(_field(visual, "layers"))))
        self.attn_pool = _Resampler(queries, output_dim, width)
        self.ln_post = LayerNorm(output_dim, _EPS)
        self.proj = nn.Parameter(torch.empty(output_dim, output_dim))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        b, c, h, w = pixels.shape
        p, g = self.patch_size, self.grid
        if h != self.image_size or w != self.image_size:
            raise ValueError(f"an image of {h}x{w} pixels does not fit Qwen-VL's tower: it takes "
                             f"{self.image_size}x{self.image_size} (the tokenizer stage's resize)")
        weight = self.conv1.weight
        # the convolution as one GEMM over all patches, each patch's pixels in (channel, row, col) order
        patches = pixels.to(weight.dtype).view(b, c, g, p, g, p).permute(0, 2, 4, 1, 3, 5).reshape(b, g * g, -1)
        x = patches @ weight.view(weight.shape[0], -1).t()
        x = self.ln_pre(x + resized_positions(self.positional_embedding, g))
        with sdpa_kernel(_SDPA_BACKENDS):
            for block in self.transformer.resblocks:
                x = block(x)
            x = self.attn_pool(x)
        return self.ln_post(x) @ self.proj
