"""DeepSeek-VL's vision towers in plain torch: the SigLIP ViT (timm's layout), the SAM-B ViT with
its neck and downsampling convolutions, and the hybrid tower that runs both on one image.

DeepSeek-VL's remote code builds its towers from timm / segment-anything modules by a model name
(``siglip_large_patch16_384``, ``sam_b_downsample``); the checkpoint's names are those modules'
(``blocks.N.attn.qkv``, ``pos_embed``, ``neck.0``, ``downsamples.1``, ...), and the modules here
carry the same names, so the tensors load as they are.

- SigLIP (``SiglipViT``): patches by a biased convolution, learned positions, no class token;
  pre-norm blocks (fused qkv, exact GELU, LayerNorm eps 1e-6); the output is the kept blocks'
  last state through the final ``norm`` (the remote code builds ``layers + select_layer + 1``
  blocks and always applies ``norm``). Its attention-pool head is built but never run there, so
  its tensors are skipped (``unused_prefixes``).
- SAM (``SamViT``): patches and a ``[grid, grid, C]`` position table, blocks with decomposed
  relative positions, windowed (14 patches, zero-padded to a multiple) except the global ones;
  then the neck (1x1 conv, LayerNorm2d, 3x3 conv, LayerNorm2d), a bilinear resize of the map to
  4x the low-res grid (96 at 1024 / 384 pixels) and two stride-2 convolutions (24 x 24 x 1024).
  The remote code's ``sam_hd`` branch adds the first global block's state through ``neck_hd`` and
  the same resize and convolutions, scaled by ``hd_alpha_downsamples``.
- Hybrid (``HybridTower``): the image (1024 pixels) through SAM; the same image resized to the
  low-res side (bilinear, antialiased: torchvision's ``Resize``) through SigLIP; each tower
  normalizes its own input with its ``pixel_mean`` / ``pixel_std``. Both give one row per cell of
  the low-res grid (576); the projector joins them.

Relative positions enter attention as an additive mask of torch's ``scaled_dot_product_attention``;
the global blocks run one image at a time (their mask is heads x 4096² at 1024 pixels).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import sdpa_kernel

from .layer_norm import LayerNorm
from .vision import _SDPA_BACKENDS

# The remote code's model names -> their geometry (siglip_vit.SigLIP_MODEL_CONFIG, sam.SAM_MODEL_CONFIG).
SIGLIP_MODELS: dict[str, dict[str, Any]] = {
    "siglip_large_patch16_384": {"patch_size": 16, "width": 1024, "layers": 24, "heads": 16, "mlp_ratio": 4.0},
    "siglip_so400m_patch14_384": {"patch_size": 14, "width": 1152, "layers": 27, "heads": 16, "mlp_ratio": 3.7362},
    "siglip_so400m_patch14_224": {"patch_size": 14, "width": 1152, "layers": 27, "heads": 16, "mlp_ratio": 3.7362},
}
SAM_MODELS: dict[str, dict[str, Any]] = {
    "sam_b_downsample": {"patch_size": 16, "width": 768, "layers": 12, "heads": 12, "window_size": 14,
                         "global_attn_indexes": [2, 5, 8, 11], "out_chans": 256, "downsample_channels": [512, 1024]},
}


def tower_geometry(params: dict[str, Any], table: dict[str, dict[str, Any]], kind: str) -> dict[str, Any]:
    """A tower's geometry: its model name's, with any of those keys given in ``params`` over it
    (conveyor's own extension, which the published configs do not use: tests build tiny towers)."""
    name = params.get("model_name")
    if name not in table:
        raise ValueError(f"DeepSeek-VL {kind} tower {name!r} is not supported: {', '.join(table)}")
    geometry = dict(table[name])
    geometry.update({k: params[k] for k in geometry if k in params})
    geometry["image_size"] = int(params.get("image_size", 384 if kind == "SigLIP" else 1024))
    return geometry


class _Mlp(nn.Module):
    """fc1 -> exact GELU -> fc2 (timm's Mlp)."""

    def __init__(self, width: int, hidden: int, names: tuple[str, str] = ("fc1", "fc2")) -> None:
        super().__init__()
        self.names = names
        setattr(self, names[0], nn.Linear(width, hidden))
        setattr(self, names[1], nn.Linear(hidden, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.names[1])(F.gelu(getattr(self, self.names[0])(x)))


class _SiglipAttention(nn.Module):
    """Bidirectional attention with a fused, biased qkv projection (timm's Attention)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"SigLIP width {width} is not a multiple of its {heads} heads")
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, n, c))


class _SiglipBlock(nn.Module):
    def __init__(self, width: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.norm1 = LayerNorm(width, 1e-6)
        self.attn = _SiglipAttention(width, heads)
        self.norm2 = LayerNorm(width, 1e-6)
        self.mlp = _Mlp(width, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class SiglipViT(nn.Module):
    """The SigLIP trunk DeepSeek-VL keeps: [B, 3, S, S] normalized pixels -> [B, (S/p)², width]."""

    def __init__(self, params: dict[str, Any]) -> None:
        super().__init__()
        g = tower_geometry(params, SIGLIP_MODELS, "SigLIP")
        self.image_size, self.patch_size, self.width = g["image_size"], int(g["patch_size"]), int(g["width"])
        if self.image_size % self.patch_size:
            raise ValueError(f"SigLIP image_size {self.image_size} is not a multiple of its patch {self.patch_size}")
        layers, select = int(g["layers"]), int(params.get("select_layer", -1))
        self.depth = min(layers, layers + select + 1) if select <= 0 else min(layers, select)
        if self.depth <= 0:
            raise ValueError(f"SigLIP select_layer {select} leaves no block of its {layers}")
        self.grid = self.image_size // self.patch_size
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv2d(3, self.width, self.patch_size, self.patch_size)
        self.pos_embed = nn.Parameter(torch.zeros(1, self.grid * self.grid, self.width))
        hidden = int(self.width * float(g["mlp_ratio"]))
        self.blocks = nn.ModuleList(_SiglipBlock(self.width, int(g["heads"]), hidden) for _ in range(self.depth))
        self.norm = LayerNorm(self.width, 1e-6)

    @staticmethod
    def unused_prefixes() -> tuple[str, ...]:
        """Checkpoint names the remote code builds but never runs (the attention-pool head)."""
        return ("attn_pool.",)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed.proj(pixels.to(self.pos_embed.dtype)).flatten(2).transpose(1, 2) + self.pos_embed
        with sdpa_kernel(_SDPA_BACKENDS):
            for block in self.blocks:
                x = block(x)
        return self.norm(x)


class LayerNorm2d(nn.Module):
    """LayerNorm over the channels of a [B, C, H, W] map (SAM's neck), eps 1e-6."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.permute(0, 2, 3, 1), self.weight.shape, self.weight, self.bias, 1e-6).permute(0, 3, 1, 2)


def _rel_index(size: int, device: torch.device) -> torch.Tensor:
    """[size, size] indices into a (2·size - 1)-row relative-position table: q - k + size - 1."""
    r = torch.arange(size, device=device)
    return r[:, None] - r[None, :] + (size - 1)


class _SamAttention(nn.Module):
    """Attention over a [B, H, W, C] window with decomposed relative positions (rows, columns)."""

    def __init__(self, width: int, heads: int, size: int) -> None:
        super().__init__()
        self.heads, self.size = heads, size
        self.head_dim = width // heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.rel_pos_h = nn.Parameter(torch.zeros(2 * size - 1, self.head_dim))
        self.rel_pos_w = nn.Parameter(torch.zeros(2 * size - 1, self.head_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, h, w, c = x.shape
        q, k, v = self.qkv(x).view(b, h * w, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        # the bias of query (i, j) on key (k, l): q · Rh[i - k] + q · Rw[j - l], unscaled q
        rel_h = self.rel_pos_h[_rel_index(h, x.device)]  # [h, h, d]
        rel_w = self.rel_pos_w[_rel_index(w, x.device)]  # [w, w, d]
        grid_q = q.reshape(b, self.heads, h, w, self.head_dim)
        bias_h = torch.einsum("bnhwd,hkd->bnhwk", grid_q, rel_h)
        bias_w = torch.einsum("bnhwd,wkd->bnhwk", grid_q, rel_w)
        bias = (bias_h[..., :, None] + bias_w[..., None, :]).reshape(b, self.heads, h * w, h * w)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.proj(out.transpose(1, 2).reshape(b, h, w, c))


class _SamBlock(nn.Module):
    """Pre-norm block; windowed attention (zero-padded to whole windows) unless ``window`` is 0."""

    def __init__(self, width: int, heads: int, window: int, grid: int) -> None:
        super().__init__()
        self.window = window
        self.norm1 = nn.LayerNorm(width, eps=1e-6)
        self.attn = _SamAttention(width, heads, window or grid)
        self.norm2 = nn.LayerNorm(width, eps=1e-6)
        self.mlp = _Mlp(width, 4 * width, ("lin1", "lin2"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, h, w, c = x.shape
        y = self.norm1(x)
        if self.window:
            s = self.window
            ph, pw = -h % s, -w % s
            y = F.pad(y, (0, 0, 0, pw, 0, ph))
            hp, wp = h + ph, w + pw
            y = y.view(b, hp // s, s, wp // s, s, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, s, s, c)
            y = self.attn(y)
            y = y.view(b, hp // s, wp // s, s, s, c).permute(0, 1, 3, 2, 4, 5).reshape(b, hp, wp, c)[:, :h, :w]
        else:  # one image at a time: the bias mask grows with the square of the patches
            y = torch.cat([self.attn(y[i:i + 1]) for i in range(b)])
        x = x + y
        return x + self.mlp(self.norm2(x))


def _neck(width: int, out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(width, out, 1, bias=False), LayerNorm2d(out),
                         nn.Conv2d(out, out, 3, padding=1, bias=False), LayerNorm2d(out))


class SamViT(nn.Module):
    """SAM-B with DeepSeek-VL's downsampling: [B, 3, S, S] normalized pixels -> [B, out², channels]
    (``out``: the low-res tower's grid; the neck's map is resized to ``out · 2^downsamples``)."""

    def __init__(self, params: dict[str, Any], out_grid: int) -> None:
        super().__init__()
        g = tower_geometry(params, SAM_MODELS, "SAM")
        self.image_size, self.patch_size, width = g["image_size"], int(g["patch_size"]), int(g["width"])
        if self.image_size % self.patch_size:
            raise ValueError(f"SAM image_size {self.image_size} is not a multiple of its patch {self.patch_size}")
        self.grid = self.image_size // self.patch_size
        downsample = [int(c) for c in g["downsample_channels"]]
        self.resize = out_grid * 2 ** len(downsample)  # 96 at 1024 pixels beside a 384-pixel SigLIP
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv2d(3, width, self.patch_size, self.patch_size)
        self.pos_embed = nn.Parameter(torch.zeros(1, self.grid, self.grid, width))
        global_layers = {int(i) for i in g["global_attn_indexes"]}
        if not global_layers:
            raise ValueError("SAM needs a global-attention block (global_attn_indexes): DeepSeek-VL's sam_hd "
                             "branch reads the first one")
        self.first_global = min(global_layers)
        window = int(g["window_size"])
        self.blocks = nn.ModuleList(
            _SamBlock(width, int(g["heads"]), 0 if i in global_layers else window, self.grid)
            for i in range(int(g["layers"])))
        out = int(g["out_chans"])
        self.neck = _neck(width, out)
        convs, c = [], out
        for channels in downsample:
            convs.append(nn.Conv2d(c, channels, 3, stride=2, padding=1, bias=False))
            c = channels
        self.downsamples = nn.Sequential(*convs)
        self.channels = c
        self.hd_alpha_downsamples = nn.Parameter(torch.zeros(1))
        self.neck_hd = _neck(width, out)

    def _down(self, neck: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """[B, g, g, width] -> [B, channels, out, out]: neck, resize (in float32), downsamples."""
        y = neck(x.permute(0, 3, 1, 2))
        y = F.interpolate(y.float(), size=(self.resize, self.resize), mode="bilinear", align_corners=False)
        return self.downsamples(y.to(x.dtype))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed.proj(pixels.to(self.pos_embed.dtype)).permute(0, 2, 3, 1) + self.pos_embed
        first = None
        with sdpa_kernel(_SDPA_BACKENDS):
            for i, block in enumerate(self.blocks):
                x = block(x)
                if i == self.first_global:
                    first = x
        y = self._down(self.neck, x) + self._down(self.neck_hd, first) * self.hd_alpha_downsamples
        return y.flatten(2).transpose(1, 2)


class _Tower(nn.Module):
    """One of the remote code's ``CLIPVisionTower``: its own normalization, then the ViT."""

    def __init__(self, params: dict[str, Any], vit: nn.Module) -> None:
        super().__init__()
        self.vision_tower = vit
        mean, std = params.get("pixel_mean"), params.get("pixel_std")
        # plain floats, not buffers: the model's cast to bfloat16 would round them
        self.stats = None if mean is None or std is None else ([float(m) for m in mean], [float(s) for s in std])

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        if self.stats is not None:
            mean, std = (torch.tensor(v, dtype=torch.float32, device=pixels.device).view(1, -1, 1, 1)
                         for v in self.stats)
            pixels = (pixels.float() - mean) / std
        return self.vision_tower(pixels)


def siglip_tower(params: dict[str, Any]) -> _Tower:
    """The remote ``CLIPVisionTower`` of a ``siglip_*`` model (``select_feature`` is moot: all rows)."""
    return _Tower(params, SiglipViT(params))


class HybridTower(nn.Module):
    """SAM at high resolution beside SigLIP at low: [B, 3, S, S] -> ([B, n, C_high], [B, n, C_low])."""

    def __init__(self, params: dict[str, Any]) -> None:
        super().__init__()
        high, low = params.get("high_res_cfg") or {}, params.get("low_res_cfg") or {}
        self.vision_tower_low = siglip_tower(low)
        low_vit = self.vision_tower_low.vision_tower
        self.low_size = low_vit.image_size
        self.vision_tower_high = _Tower(high, SamViT(high, low_vit.grid))
        self.image_size = self.vision_tower_high.vision_tower.image_size

    @staticmethod
    def unused_prefixes() -> tuple[str, ...]:
        """Checkpoint names the remote code builds but never runs: its two LayerNorms and SigLIP's head."""
        return ("high_layer_norm.", "low_layer_norm.", "vision_tower_low.vision_tower.attn_pool.")

    def forward(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        low = F.interpolate(pixels.float(), size=(self.low_size, self.low_size), mode="bilinear",
                            align_corners=False, antialias=True)
        return self.vision_tower_high(pixels), self.vision_tower_low(low)
