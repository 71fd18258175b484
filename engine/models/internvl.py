"""InternVL 2.5 / 3: InternViT, a pixel shuffle, a two-layer projector, and one of the engine's
language models (Qwen2 for InternVL3 and the small 2.5s, InternLM2 for InternVL2.5-8B, Llama).

Each image arrives as its dynamic tiles (448 pixels a side in the published models: the canvas
of tiles closest to its aspect ratio, plus a thumbnail of the whole when there is more than one
tile), ``[tiles, 3, side, side]``. Each tile goes through the tower alone; the chosen layer's
patch states (the CLS row dropped) are pixel-shuffled (``downsample_ratio`` 0.5: each 2x2 block
of patches becomes one row four times as wide), then projected by LayerNorm -> Linear -> GELU ->
Linear. An image's rows are its tiles' rows in tile order: 256 a tile at 448 pixels.

Two checkpoint layouts, one computation:

- ``InternVLForConditionalGeneration`` (transformers' ``internvl``, the ``-hf`` repositories):
  ``text_config`` / ``vision_config`` (``internvl_vision``), ``vision_feature_layer``,
  ``image_token_id``; weights ``model.vision_tower.*``, ``model.multi_modal_projector.*``,
  ``model.language_model.*``, ``lm_head.*`` (or 4.x's ``vision_tower.*``, ``language_model.model.*``).
- ``InternVLChatModel`` (OpenGVLab's remote code, what most users download): ``llm_config``,
  ``vision_config`` (``InternVisionModel``: ``qkv_bias``, ``qk_normalization``, ``norm_type``),
  ``select_layer``, ``downsample_ratio``, ``ps_version``, ``force_image_size``; weights
  ``vision_model.*`` (a fused ``qkv``, ``ls1`` / ``ls2``), ``mlp1.{0,1,3}.*`` and
  ``language_model.*`` in the language model's own names (InternLM2's ``tok_embeddings`` /
  ``output`` included). Its image token, ``<IMG_CONTEXT>``, is named only by the tokenizer:
  ``ModelConfig.from_pretrained`` reads its id from there into ``image_token_id``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ...protocol.errors import UnsupportedModelError
from ..layers.intern_vit import InternVisionModel, check_shuffle, remote_names
from ..layers.vision import activation
from ..model_config import ModelConfig
from .vision_language import VisionLanguageModel, build_language_model, refuse_quantized

# transformers' layouts: checkpoint prefix -> (part, the name inside it), newest first.
_HF_PREFIXES = (
    ("model.vision_tower.", "vision", ""),
    ("model.multi_modal_projector.", "projector", ""),
    ("model.language_model.", "text", "model."),
    ("lm_head.", "text", "lm_head."),
    ("vision_tower.", "vision", ""),
    ("multi_modal_projector.", "projector", ""),
    ("language_model.model.", "text", "model."),
    ("language_model.lm_head.", "text", "lm_head."),
)
# the remote code's: the language model keeps its own names under language_model.
_REMOTE_PREFIXES = (
    ("vision_model.", "vision", ""),
    ("mlp1.", "projector", ""),
    ("language_model.", "text", ""),
)
_REMOTE_PROJECTOR = {"0.": "layer_norm.", "1.": "linear_1.", "3.": "linear_2."}


class InternVLProjector(nn.Module):
    """LayerNorm -> linear_1 -> activation -> linear_2: shuffled vision rows into the language
    model's width (the remote code's ``mlp1`` Sequential: indices 0, 1, 3)."""

    def __init__(self, width: int, text_width: int, act: str) -> None:
        super().__init__()
        self.layer_norm = nn.LayerNorm(width)
        self.linear_1 = nn.Linear(width, text_width)
        self.act = activation(act)
        self.linear_2 = nn.Linear(text_width, text_width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(self.layer_norm(x))))


def pixel_shuffle(x: torch.Tensor, factor: int, v1: bool = False) -> torch.Tensor:
    """[N, side, side, C] -> [N, side/f, side/f, C·f²]: each f x f block of patches as one row
    (InternVL's ``pixel_shuffle`` at scale 1/f; ``v1`` leaves its last transpose out, as
    ``ps_version`` v1 checkpoints were trained)."""
    n, rows, cols, c = x.shape
    x = x.reshape(n, rows, cols // factor, c * factor).transpose(1, 2)
    x = x.reshape(n, cols // factor, rows // factor, c * factor * factor)
    return x if v1 else x.transpose(1, 2)


class _InternVL(VisionLanguageModel):
    """What both layouts share: the interface the model runner drives (``llava.py``'s)."""

    layout_prefixes: tuple[tuple[str, str, str], ...] = ()

    def __init__(self, config: ModelConfig, rope_scaling_factor: float, max_position: int | None, *,
                 vision: dict[str, Any], feature_layer: int, qk_eps: float, final_norm: bool,
                 downsample_ratio: float, ps_v1: bool, projector_act: str, image_token_id: int | None) -> None:
        super().__init__()
        self.config = config
        refuse_quantized(config)
        if image_token_id is None:
            raise UnsupportedModelError("InternVL's image token is unknown: the model directory's tokenizer has no "
                                        "<IMG_CONTEXT> token and config.json no image_token_id; add one of them")
        self.language_model = build_language_model(config, rope_scaling_factor, max_position)
        self.final_norm = final_norm
        self.vision_tower = InternVisionModel(vision, feature_layer, qk_eps, final_norm)
        side = self.vision_tower.embeddings.image_size
        self.shuffle = check_shuffle(side, self.vision_tower.embeddings.patch_size, downsample_ratio)
        self.ps_v1 = ps_v1
        width = int(vision["hidden_size"]) * self.shuffle * self.shuffle
        self.multi_modal_projector = InternVLProjector(width, config.hidden_size, projector_act)
        self.image_token_id: int = int(image_token_id)

    # ---- the model runner's interface (the rest: VisionLanguageModel) ------------------------
    def encode_images(self, pixel_values: torch.Tensor, grids: list[list[int]] | None = None) -> list[torch.Tensor]:
        """[B, tiles, 3, side, side] pixels (images of one tile count; [B, 3, side, side]: one tile
        each) -> each image's [tiles · rows_per_tile, hidden] features, every tile through the tower
        in one batch."""
        if pixel_values.dim() == 4:
            pixel_values = pixel_values[:, None]
        b, tiles = pixel_values.shape[:2]
        features = self.tile_features(pixel_values.flatten(0, 1))
        return list(features.reshape(b, tiles * features.shape[1], features.shape[2]))

    def image_rows_for(self, shape: list[int], grid: list[int]) -> int:
        side = self.vision_tower.embeddings.image_size
        if len(shape) == 3:  # one tile, [3, side, side]
            shape = [1, *shape]
        if len(shape) != 4 or shape[0] < 1 or shape[1:] != [3, side, side]:
            raise ValueError(f"InternVL takes [tiles, 3, {side}, {side}] pixels")
        return shape[0] * (side // self.vision_tower.embeddings.patch_size // self.shuffle) ** 2

    def warmup_images(self, tokens: int) -> tuple[list[int], list[list[int]]]:
        """Images of 13 tiles (the published max_dynamic_patch 12 and a thumbnail), fewer when
        ``tokens`` holds less."""
        side = self.vision_tower.embeddings.image_size
        per_tile = (side // self.vision_tower.embeddings.patch_size // self.shuffle) ** 2
        tiles = max(1, min(13, tokens // per_tile))
        n = max(1, tokens // (tiles * per_tile))
        return [n, tiles, 3, side, side], [[]] * n

    def tile_features(self, tiles: torch.Tensor) -> torch.Tensor:
        """[N, 3, side, side] tiles -> [N, rows_per_tile, hidden]: the chosen layer's patch states
        (CLS dropped), shuffled, projected."""
        states = self.vision_tower(tiles)[:, 1:]
        n, patches, c = states.shape
        side = int(patches ** 0.5)
        shuffled = pixel_shuffle(states.reshape(n, side, side, c), self.shuffle, self.ps_v1)
        return self.multi_modal_projector(shuffled.reshape(n, -1, shuffled.shape[-1]))

    # ---- weight loading ---------------------------------------------------------------------
    def _own_names(self, part: str, rest: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """A tower or projector tensor as this module's (name, tensor) pairs (a layout renames)."""
        yield f"{'vision_tower' if part == 'vision' else 'multi_modal_projector'}.{rest}", tensor

    def _route(self, weights: Iterable[tuple[str, torch.Tensor]],
               own: dict[str, tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The language model's tensors, renamed to its layout; the tower's and projector's
        collected into ``own`` (parameter name -> (checkpoint name, tensor))."""
        skip = tuple(f"vision_tower.{p}" for p in self.vision_tower.unused_prefixes(self.final_norm))
        for name, tensor in weights:
            match = next((m for m in self.layout_prefixes if name.startswith(m[0])), None)
            if match is None:
                parts = ", ".join(p.rstrip(".") for p, _, _ in self.layout_prefixes)
                raise ValueError(f"checkpoint tensor {name} belongs to no part of {type(self).__name__} ({parts})")
            prefix, part, renamed = match
            rest = renamed + name[len(prefix):]
            if part == "text":
                yield rest, tensor
                continue
            for param, piece in self._own_names(part, rest, tensor):
                if not param.startswith(skip):
                    own[param] = (name, piece)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the checkpoint; raise if any parameter stays unloaded or a tensor fits none."""
        own: dict[str, tuple[str, torch.Tensor]] = {}
        self.language_model.load_weights(self._route(weights, own))
        self.load_own(own)


class InternVLForConditionalGeneration(_InternVL):
    """transformers' layout (``-hf`` repositories, model_type ``internvl``)."""

    layout_prefixes = _HF_PREFIXES

    def __init__(self, config: ModelConfig, rope_scaling_factor: float = 0.0, max_position: int | None = None) -> None:
        full = config.vision or {}
        vision = full.get("vision_config") or {}
        layer = full.get("vision_feature_layer", -1)
        if not isinstance(layer, int):
            raise UnsupportedModelError(f"InternVL with several vision_feature_layer {layer} is not supported: "
                                        "its projector reads one layer")
        if full.get("vision_feature_select_strategy", "default") != "default":
            raise UnsupportedModelError("InternVL with vision_feature_select_strategy 'full' is not supported: the "
                                        "pixel shuffle takes the patch grid without the CLS row")
        if vision.get("use_mask_token"):
            raise UnsupportedModelError("InternViT with use_mask_token is not supported: set it false (serving "
                                        "masks no patches)")
        if not vision.get("use_absolute_position_embeddings", True):
            raise UnsupportedModelError("InternViT without absolute position embeddings is not supported: "
                                        "the published towers all have them")
        super().__init__(config, rope_scaling_factor, max_position, vision=vision, feature_layer=layer,
                         qk_eps=1e-6, final_norm=not vision.get("use_mean_pooling", True),
                         downsample_ratio=float(full.get("downsample_ratio", 0.5)), ps_v1=False,
                         projector_act=full.get("projector_hidden_act", "gelu"),
                         image_token_id=full.get("image_token_id", full.get("image_token_index", 151667)))


class InternVLChatModel(_InternVL):
    """OpenGVLab's remote-code layout (``InternVLChatModel``, model_type ``internvl_chat``)."""

    layout_prefixes = _REMOTE_PREFIXES

    def __init__(self, config: ModelConfig, rope_scaling_factor: float = 0.0, max_position: int | None = None) -> None:
        full = config.vision or {}
        remote = full.get("vision_config") or {}
        side = int(remote.get("image_size", 448))
        if full.get("force_image_size") and int(full["force_image_size"]) != side:
            raise UnsupportedModelError(
                f"InternVL with force_image_size {full['force_image_size']} beside a {side}-pixel tower is not "
                "supported: its positions would be interpolated on every tile; use a checkpoint whose "
                "vision_config.image_size equals force_image_size")
        ps = full.get("ps_version", "v1")
        if ps not in ("v1", "v2"):
            raise UnsupportedModelError(f"InternVL ps_version {ps!r} is not supported: v1 or v2")
        norm = remote.get("norm_type", "rms_norm")
        # the remote config's names as transformers' (what InternVisionModel reads)
        vision = {"hidden_size": remote["hidden_size"], "num_hidden_layers": remote["num_hidden_layers"],
                  "num_attention_heads": remote["num_attention_heads"],
                  "intermediate_size": remote["intermediate_size"], "hidden_act": remote.get("hidden_act", "gelu"),
                  "image_size": side, "patch_size": remote.get("patch_size", 14),
                  "num_channels": remote.get("num_channels", 3), "norm_type": norm,
                  "layer_norm_eps": remote.get("layer_norm_eps", 1e-6),
                  "attention_bias": remote.get("qkv_bias", False),
                  "use_qk_norm": remote.get("qk_normalization", False)}
        super().__init__(config, rope_scaling_factor, max_position, vision=vision,
                         feature_layer=int(full.get("select_layer", -1)),
                         qk_eps=float(vision["layer_norm_eps"]), final_norm=False,
                         downsample_ratio=float(full.get("downsample_ratio", 0.5)), ps_v1=ps == "v1",
                         projector_act="gelu", image_token_id=full.get("image_token_id"))

    def _own_names(self, part: str, rest: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if part == "vision":
            for name, piece in remote_names(rest, tensor):
                yield f"vision_tower.{name}", piece
            return
        index = next((k for k in _REMOTE_PROJECTOR if rest.startswith(k)), None)
        if index is None:
            raise ValueError(f"checkpoint tensor mlp1.{rest} is not one of the projector's (mlp1.0, mlp1.1, mlp1.3)")
        yield f"multi_modal_projector.{_REMOTE_PROJECTOR[index]}{rest[len(index):]}", tensor
