"""Qwen2-VL's and Qwen2.5-VL's vision transformer, in plain torch.

An image arrives as its patches at native resolution (``[t * h * w, C * T * P * P]``: the
processor's rows, already in the order the merger reads, each ``merge x merge`` block of
neighbouring patches consecutive) with its patch grid ``[t, h, w]``. The tower embeds the patches
(a 3-D convolution whose kernel is its stride: one GEMM), rotates q and k by each patch's
(row, column) with a 2-D rotary, runs bidirectional attention over each image's patches (Qwen2.5:
over 112-pixel windows except in the ``fullatt_block_indexes`` blocks), and merges each block of
``merge x merge`` patches into one row of the language model's width. Those rows are what the
image's placeholder tokens carry.

Modules carry transformers' names (``patch_embed.proj``, ``blocks.N.attn.qkv``, ``merger.mlp.0``)
so a checkpoint's ``visual.*`` tensors load by name. Like CLIP (``vision.py``) the tower keeps no
KV cache and is replicated on every tensor-parallel rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import sdpa_kernel

from ...kernels.rotary import apply_rotary
from .layer_norm import LayerNorm
from .norm import RMSNorm
from .vision import _SDPA_BACKENDS, VisionMLP, activation

# GEMM widths are padded to a multiple of this: Qwen2.5-VL's MLP is 3420 wide, whose rows
# (6,840 bytes in 16 bits) are not 16-byte aligned, which keeps cuBLAS off Hopper's TMA kernels
# (an SM80 kernel at ~250 TFLOP/s instead); zero rows and columns leave the products unchanged.
_GEMM_ALIGN = 64


@dataclass
class Segments:
    """Attention segments of a packed sequence (each attends only within itself), grouped by
    length so that segments of one length run as one batched SDPA call: ``groups`` holds, per
    length, the ``[segments, length]`` row indices; ``uniform`` the length when all segments
    have it (then they are views of the sequence, no gather)."""

    groups: list[torch.Tensor]
    uniform: int = 0

    @classmethod
    def from_lengths(cls, lengths: list[int], device: torch.device) -> "Segments":
        lengths = [n for n in lengths if n]
        if lengths and all(n == lengths[0] for n in lengths):
            return cls([], lengths[0])
        by_length: dict[int, list[int]] = {}
        start = 0
        for n in lengths:
            by_length.setdefault(n, []).append(start)
            start += n
        groups = [torch.tensor(starts, device=device)[:, None] + torch.arange(n, device=device)
                  for n, starts in by_length.items()]
        return cls(groups)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``[N, heads, D]`` q, k, v -> ``[N, heads, D]``, each row attending its own segment."""
        if self.uniform:
            def split(x: torch.Tensor) -> torch.Tensor:
                return x.reshape(-1, self.uniform, *x.shape[1:]).transpose(1, 2)

            return F.scaled_dot_product_attention(split(q), split(k), split(v)).transpose(1, 2).flatten(0, 1)
        out = torch.empty_like(q)
        for rows in self.groups:  # x[rows]: [segments, length, heads, D]
            attended = F.scaled_dot_product_attention(q[rows].transpose(1, 2), k[rows].transpose(1, 2),
                                                      v[rows].transpose(1, 2))
            out[rows] = attended.transpose(1, 2)
        return out


class PatchEmbed(nn.Module):
    """The patches' ``[N, C * T * P * P]`` rows times the 3-D convolution's kernel (stride = kernel,
    no bias): one GEMM, no convolution algorithm search per new shape."""

    def __init__(self, channels: int, temporal: int, patch: int, hidden: int) -> None:
        super().__init__()
        self.proj = nn.Conv3d(channels, hidden, kernel_size=(temporal, patch, patch),
                              stride=(temporal, patch, patch), bias=False)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        if patches.shape[-1] != weight[0].numel():
            raise ValueError(f"image patches of {patches.shape[-1]} values do not fit this tower's "
                             f"{tuple(weight.shape[1:])} patch: preprocess with the model's image processor")
        return patches.to(weight.dtype) @ weight.view(weight.shape[0], -1).t()


class Qwen2VisionAttention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, rotary: torch.Tensor, segments: Segments) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.heads, self.head_dim).unbind(1)
        # rotated in float32 as transformers does (one kernel on the GPU): row i of ``rotary`` is
        # patch i's cos and sin
        q, k = apply_rotary(q, k, torch.arange(n, device=x.device), rotary)
        return self.proj(segments.attend(q, k, v).reshape(n, -1))


class VisionGatedMLP(nn.Module):
    """Qwen2.5-VL's down(act(gate(x)) * up(x)), biased; the intermediate width padded to
    ``_GEMM_ALIGN`` with zeros (act(0) * 0 adds nothing)."""

    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        padded = -(-intermediate // _GEMM_ALIGN) * _GEMM_ALIGN
        self.gate_proj = nn.Linear(hidden, padded)
        self.up_proj = nn.Linear(hidden, padded)
        self.down_proj = nn.Linear(padded, hidden)
        for param in (self.gate_proj.weight, self.gate_proj.bias, self.up_proj.weight, self.up_proj.bias,
                      self.down_proj.weight):
            param.zero_padded = True  # a checkpoint's smaller tensor fills its leading slice
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Qwen2VisionBlock(nn.Module):
    def __init__(self, hidden: int, heads: int, mlp: nn.Module, rms_norm: bool) -> None:
        super().__init__()
        self.norm1 = RMSNorm(hidden, 1e-6) if rms_norm else LayerNorm(hidden, 1e-6)
        self.norm2 = RMSNorm(hidden, 1e-6) if rms_norm else LayerNorm(hidden, 1e-6)
        self.attn = Qwen2VisionAttention(hidden, heads)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, rotary: torch.Tensor, segments: Segments) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rotary, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Norm each patch, concatenate each ``merge x merge`` block's patches, two-layer MLP into the
    language model's width."""

    def __init__(self, hidden: int, out: int, merge: int, rms_norm: bool) -> None:
        super().__init__()
        self.width = hidden * merge * merge
        self.ln_q = RMSNorm(hidden, 1e-6) if rms_norm else LayerNorm(hidden, 1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).reshape(-1, self.width))


class Qwen2VisionTransformer(nn.Module):
    """Qwen2-VL's tower (``qwen2_vl_vision``: LayerNorm, fc1/fc2 MLP, attention over each whole
    image) or, with ``windowed``, Qwen2.5-VL's (``qwen2_5_vl_vision``: RMSNorm, gated MLP,
    attention over windows but in ``fullatt_block_indexes``)."""

    def __init__(self, config: dict[str, Any], windowed: bool) -> None:
        super().__init__()
        self.windowed = windowed
        self.merge = int(config.get("spatial_merge_size", 2))
        self.patch = int(config.get("patch_size", 14))
        heads = int(config.get("num_heads", 16))
        if windowed:  # Qwen2.5: hidden_size is the tower's width, out_hidden_size the language model's
            hidden, out = int(config["hidden_size"]), int(config["out_hidden_size"])
            intermediate = int(config["intermediate_size"])
            self.window = int(config.get("window_size", 112))
            self.full_blocks = set(config.get("fullatt_block_indexes") or ())
        else:  # Qwen2-VL: embed_dim is the tower's width, hidden_size the language model's
            hidden, out = int(config["embed_dim"]), int(config["hidden_size"])
            intermediate = int(hidden * float(config.get("mlp_ratio", 4)))
        act = config.get("hidden_act", "silu" if windowed else "quick_gelu")
        self.patch_embed = PatchEmbed(int(config.get("in_channels", config.get("in_chans", 3))),
                                      int(config.get("temporal_patch_size", 2)), self.patch, hidden)
        head_dim = hidden // heads
        theta = float((config.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        # each of a head's halves: its first half rotated by the patch's row, its second by its column
        quarter = head_dim // 2
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, quarter, 2, dtype=torch.float) / quarter),
                             persistent=False)
        mlp = VisionGatedMLP if windowed else VisionMLP
        self.blocks = nn.ModuleList(Qwen2VisionBlock(hidden, heads, mlp(hidden, intermediate, act), windowed)
                                    for _ in range(int(config["depth"])))
        self.merger = PatchMerger(hidden, out, self.merge, windowed)

    def rows(self, grid: list[int]) -> int:
        """Rows (placeholder tokens) an image of patch grid ``[t, h, w]`` becomes."""
        t, h, w = grid
        return t * h * w // (self.merge * self.merge)

    def _rotary(self, grids: list[list[int]], device: torch.device) -> torch.Tensor:
        """Each patch's float32 ``cat(cos, sin)`` of its ``head_dim / 2`` angles (the first half
        its row's, the second its column's), patches in the processor's order (merge blocks
        consecutive): ``[N, head_dim]``, the table ``apply_rotary`` reads."""
        m = self.merge
        coords = []
        for t, h, w in grids:
            rows = torch.arange(h, device=device)[:, None].expand(h, w)
            cols = torch.arange(w, device=device)[None, :].expand(h, w)
            both = torch.stack([rows, cols], dim=-1).reshape(h // m, m, w // m, m, 2).transpose(1, 2)
            coords.append(both.reshape(-1, 2).repeat(t, 1))
        angles = (torch.cat(coords).float()[..., None] * self.inv_freq.float()).flatten(1)  # [N, head_dim / 2]
        return torch.cat([angles.cos(), angles.sin()], dim=-1)

    def _windows(self, grids: list[list[int]], device: torch.device) -> tuple[torch.Tensor, list[int]]:
        """Qwen2.5's window order: the merged rows' permutation that makes each window of
        ``window_size`` pixels (``window / merge / patch`` merged rows a side) consecutive, and the
        windows' lengths in patches."""
        m, side = self.merge, self.window // self.merge // self.patch
        order, lengths, base = [], [], 0
        for t, h, w in grids:
            lh, lw = h // m, w // m
            index = torch.arange(t * lh * lw, device=device).view(t, lh, lw)
            ph, pw = -lh % side, -lw % side
            padded = F.pad(index, (0, pw, 0, ph), value=-1)
            nh, nw = (lh + ph) // side, (lw + pw) // side
            windows = padded.view(t, nh, side, nw, side).permute(0, 1, 3, 2, 4).reshape(-1, side * side)
            kept = windows >= 0
            order.append(windows[kept] + base)
            lengths.extend((kept.sum(1) * m * m).tolist())
            base += t * lh * lw
        return torch.cat(order), lengths

    def forward(self, patches: torch.Tensor, grids: list[list[int]]) -> torch.Tensor:
        """``[N, C * T * P * P]`` patches of images with patch grids ``grids`` -> ``[N / merge²,
        out]`` merged rows, image after image."""
        device = patches.device
        unit = self.merge * self.merge
        x = self.patch_embed(patches)
        rotary = self._rotary(grids, device)
        per_image = Segments.from_lengths([h * w for t, h, w in grids for _ in range(t)], device)
        order = None
        if self.windowed:
            order, lengths = self._windows(grids, device)
            windows = Segments.from_lengths(lengths, device)

            def permuted(y: torch.Tensor) -> torch.Tensor:
                return y.view(-1, unit, *y.shape[1:])[order].flatten(0, 1)

            x, rotary = permuted(x), permuted(rotary)
        with sdpa_kernel(_SDPA_BACKENDS):
            for i, block in enumerate(self.blocks):
                segments = windows if self.windowed and i not in self.full_blocks else per_image
                x = block(x, rotary, segments)
        merged = self.merger(x)
        if order is not None:
            merged = merged[torch.argsort(order)]
        return merged
