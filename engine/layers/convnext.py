"""ConvNeXt (Liu et al. 2022) as timm builds it, in timm's parameter names: the trunk that
open_clip's ConvNeXt towers wrap (``visual.trunk.*``) and that Mini-Gemini's auxiliary
high-resolution tower keeps (``vision_stem`` / ``vision_stages``).

- ``stem``: a 4x4 stride-4 convolution, then a channels-first LayerNorm (``stem.0``, ``stem.1``).
- ``stages.{i}``: stage 0 keeps the stem's resolution; each later one first halves it
  (``downsample.0`` LayerNorm, ``downsample.1`` a 2x2 stride-2 convolution), then runs
  ``blocks.{j}``: a 7x7 depthwise convolution (``conv_dw``), LayerNorm over channels (``norm``),
  Linear -> GELU -> Linear (``mlp.fc1`` / ``mlp.fc2``), scaled per channel (``gamma``), plus the
  block's input.

Every LayerNorm's epsilon is timm's 1e-6. ``stage_outputs`` returns each stage's feature map,
which is what Mini-Gemini reads (no pooling, no head).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

EPS = 1e-6


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channels of an NCHW map."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(0, 2, 3, 1)
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps).permute(0, 3, 1, 2)


class ConvNextMlp(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class ConvNextBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv_dw = nn.Conv2d(width, width, 7, padding=3, groups=width)
        self.norm = nn.LayerNorm(width, eps=EPS)
        self.mlp = ConvNextMlp(width)
        self.gamma = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv_dw(x).permute(0, 2, 3, 1)
        y = self.mlp(self.norm(y)) * self.gamma
        return x + y.permute(0, 3, 1, 2)


class ConvNextStage(nn.Module):
    def __init__(self, width_in: int, width: int, depth: int, downsample: bool) -> None:
        super().__init__()
        self.downsample = (nn.Sequential(LayerNorm2d(width_in, eps=EPS), nn.Conv2d(width_in, width, 2, stride=2))
                           if downsample else nn.Identity())
        self.blocks = nn.Sequential(*(ConvNextBlock(width) for _ in range(depth)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.downsample(x))


class ConvNextTrunk(nn.Module):
    """timm's ConvNeXt without its final norm and head: ``widths`` / ``depths`` per stage."""

    def __init__(self, widths: list[int], depths: list[int], channels: int = 3) -> None:
        super().__init__()
        if len(widths) != len(depths) or not widths:
            raise ValueError("ConvNeXt needs one width and one depth per stage")
        self.widths = list(widths)
        self.stem = nn.Sequential(nn.Conv2d(channels, widths[0], 4, stride=4), LayerNorm2d(widths[0], eps=EPS))
        self.stages = nn.ModuleList(ConvNextStage(widths[max(i - 1, 0)], w, d, downsample=i > 0)
                                    for i, (w, d) in enumerate(zip(widths, depths)))

    def stage_outputs(self, pixels: torch.Tensor) -> list[torch.Tensor]:
        """[B, 3, H, W] -> each stage's [B, width_i, H / 2^(i+2), W / 2^(i+2)] map."""
        x = self.stem(pixels)
        out = []
        for stage in self.stages:
            x = stage(x)
            out.append(x)
        return out
