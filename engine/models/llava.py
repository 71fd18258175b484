"""LLaVA 1.5 (``LlavaForConditionalGeneration``): a CLIP vision tower, a two-layer projector, and
one of the engine's language models (config.json's ``text_config``: Llama / Vicuna, Mistral,
Qwen2, ...).

The model runner asks three things of a vision-language model: ``embed_input_ids`` (the language
model's input embeddings), ``encode_images`` (each image's projected features, one row per
placeholder token the tokenizer stage expanded), and ``forward(..., inputs_embeds=...)`` with the
image rows written over the placeholders' embeddings. Everything else (the KV cache, attention,
logits, CUDA graphs at decode) is the language model's.

Checkpoints load in transformers 5's layout (``model.vision_tower.*``,
``model.multi_modal_projector.*``, ``model.language_model.*``, ``lm_head.*``) and 4.x's
(``vision_tower.*``, ``multi_modal_projector.*``, ``language_model.model.*``,
``language_model.lm_head.*``), the tower's names with or without ``vision_model.``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from ...protocol.errors import UnsupportedModelError
from ...protocol.multimodal import llava_next_layout, llava_next_rows
from ..layers.vision import ClipVisionModel, activation
from ..model_config import ModelConfig
from .vision_language import VisionLanguageModel, build_language_model, refuse_quantized

logger = logging.getLogger(__name__)

# Checkpoint prefixes -> the part they belong to and the name inside it, newest layout first.
_PREFIXES = (
    ("model.image_newline", "own", "image_newline"),
    ("image_newline", "own", "image_newline"),
    ("model.vision_tower.", "vision", ""),
    ("model.multi_modal_projector.", "projector", ""),
    ("model.language_model.", "text", "model."),
    ("vision_tower.", "vision", ""),
    ("multi_modal_projector.", "projector", ""),
    ("language_model.model.", "text", "model."),
    ("language_model.lm_head.", "text", "lm_head."),
    ("lm_head.", "text", "lm_head."),
)


class LlavaProjector(nn.Module):
    """linear_1 -> activation -> linear_2: vision features into the language model's width."""

    def __init__(self, vision_width: int, text_width: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(vision_width, text_width, bias=bias)
        self.act = activation(act)
        self.linear_2 = nn.Linear(text_width, text_width, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(VisionLanguageModel):
    """A CLIP tower's chosen hidden states (the CLS row dropped unless the strategy is ``full``),
    projected, in place of the image placeholders; the language model does the rest."""

    def __init__(self, config: ModelConfig, rope_scaling_factor: float = 0.0, max_position: int | None = None) -> None:
        super().__init__()
        self.config = config
        full = config.vision or {}
        vision = full.get("vision_config") or {}
        if vision.get("model_type", "clip_vision_model") != "clip_vision_model":
            raise UnsupportedModelError(f"LLaVA with a {vision.get('model_type')!r} vision tower is not supported: "
                                        "conveyor runs LLaVA's CLIP towers (clip_vision_model)")
        refuse_quantized(config)
        self.language_model = build_language_model(config, rope_scaling_factor, max_position)
        layers = full.get("vision_feature_layer", -2)
        self.feature_layers = [layers] if isinstance(layers, int) else list(layers)
        self.keep_cls = full.get("vision_feature_select_strategy", "default") == "full"
        self.vision_tower = ClipVisionModel(vision, self.feature_layers)
        self.tile, self.patch = int(vision["image_size"]), int(vision["patch_size"])
        self.multi_modal_projector = LlavaProjector(
            int(vision["hidden_size"]) * len(self.feature_layers), config.hidden_size,
            full.get("projector_hidden_act", "gelu"), bool(full.get("multimodal_projector_bias", True)))
        token = full.get("image_token_id", full.get("image_token_index"))
        self.image_token_id: int = int(token if token is not None else 32000)

    # ---- the model runner's interface (the rest: VisionLanguageModel) ------------------------
    def encode_images(self, pixel_values: torch.Tensor, grids: list[list[int]] | None = None) -> list[torch.Tensor]:
        """[B, 3, H, W] pixels -> each image's [rows, hidden] features (rows: patches, +1 with the
        CLS row kept), through the tower once for the batch."""
        return list(self._features(pixel_values))

    def image_rows_for(self, shape: list[int], grid: list[int]) -> int:
        if shape != [3, self.tile, self.tile]:
            raise ValueError(f"LLaVA's tower takes [3, {self.tile}, {self.tile}] pixels")
        return (self.tile // self.patch) ** 2 + (1 if self.keep_cls else 0)

    def warmup_images(self, tokens: int) -> tuple[list[int], list[list[int]]]:
        rows = (self.tile // self.patch) ** 2 + (1 if self.keep_cls else 0)
        n = max(1, tokens // rows)
        return [n, 3, self.tile, self.tile], [[]] * n

    def _features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] pixels -> [B, rows, hidden]: the chosen layers' states, projected."""
        states = self.vision_tower.hidden_states(pixel_values)
        if not self.keep_cls:
            states = [s[:, 1:] for s in states]
        return self.multi_modal_projector(torch.cat(states, dim=-1))

    # ---- weight loading ---------------------------------------------------------------------
    def _route(self, weights: Iterable[tuple[str, torch.Tensor]],
               own: dict[str, tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The language model's tensors, renamed to its own layout; the tower's and projector's
        collected into ``own`` (parameter name -> (checkpoint name, tensor))."""
        skip = tuple(f"vision_tower.{p}" for p in self.vision_tower.unused_prefixes())
        for name, tensor in weights:
            match = next((m for m in _PREFIXES if name.startswith(m[0])), None)
            if match is None:
                raise ValueError(f"checkpoint tensor {name} belongs to no part of LLaVA (vision_tower, "
                                 "multi_modal_projector, language_model)")
            prefix, part, renamed = match
            rest = renamed + name[len(prefix):]
            if part == "text":
                yield rest, tensor
            elif part == "vision":
                # the hub's llava-hf files nest the tower in vision_model.; transformers 5 may save it bare
                rest = rest if rest.startswith("vision_model.") else f"vision_model.{rest}"
                if not f"vision_tower.{rest}".startswith(skip):
                    own[f"vision_tower.{rest}"] = (name, tensor)
            elif part == "own":
                own[renamed] = (name, tensor)
            else:
                own[f"multi_modal_projector.{rest}"] = (name, tensor)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load a LLaVA checkpoint; raise if any parameter stays unloaded or a tensor fits none."""
        own: dict[str, tuple[str, torch.Tensor]] = {}
        self.language_model.load_weights(self._route(weights, own))
        self.load_own(own)


class LlavaNextForConditionalGeneration(LlavaForConditionalGeneration):
    """LLaVA-NeXT (1.6): each image arrives as its resized whole plus the tiles of the canvas among
    ``image_grid_pinpoints`` that fits it best (``[tiles, 3, side, side]``, the original
    ``[height, width]`` as the image's grid). Its features: the whole's patches, then the tiles'
    patches as one grid with the canvas padding cut off, each grid row ended by the learned
    ``image_newline``."""

    def __init__(self, config: ModelConfig, rope_scaling_factor: float = 0.0, max_position: int | None = None) -> None:
        super().__init__(config, rope_scaling_factor, max_position)
        full = config.vision or {}
        if self.keep_cls:
            raise UnsupportedModelError("LLaVA-NeXT with vision_feature_select_strategy 'full' is not supported: "
                                        "its tiles' grid holds patches only")
        self.pinpoints = [list(p) for p in full.get("image_grid_pinpoints") or ()]
        self.image_newline = nn.Parameter(torch.empty(config.hidden_size))

    def image_rows_for(self, shape: list[int], grid: list[int]) -> int:
        if len(grid) != 2 or min(grid) < 1 or len(shape) != 4 or shape[1:] != [3, self.tile, self.tile]:
            raise ValueError(f"LLaVA-NeXT takes [tiles, 3, {self.tile}, {self.tile}] pixels and the original "
                             "[height, width] as the grid")
        height, width = grid
        down, across, _, _ = llava_next_layout(height, width, self.pinpoints, self.tile, self.patch)
        if shape[0] != 1 + down * across:
            raise ValueError(f"an image of {height}x{width} is {1 + down * across} tiles (the whole and its canvas)")
        return llava_next_rows(height, width, self.pinpoints, self.tile, self.patch, False)

    def warmup_images(self, tokens: int) -> tuple[list[int], list[list[int]]]:
        """Images of the largest canvas: the whole plus its tiles."""
        height, width = max(self.pinpoints, key=lambda p: p[0] * p[1]) if self.pinpoints else (self.tile, self.tile)
        tiles = 1 + (height // self.tile) * (width // self.tile)
        rows = llava_next_rows(height, width, self.pinpoints, self.tile, self.patch, False) if self.pinpoints else 1
        n = max(1, tokens // rows)
        return [n, tiles, 3, self.tile, self.tile], [[height, width]] * n

    def encode_images(self, pixel_values: torch.Tensor, grids: list[list[int]] | None = None) -> list[torch.Tensor]:
        """[B, tiles, 3, side, side] pixels and each image's original [height, width] -> each
        image's packed [rows, hidden] features (``protocol/multimodal.llava_next_rows``
        rows)."""
        b, tiles = pixel_values.shape[:2]
        features = self._features(pixel_values.flatten(0, 1))
        features = features.view(b, tiles, *features.shape[1:])  # [B, tiles, side * side, hidden]
        side = self.tile // self.patch
        newline = self.image_newline.to(features.dtype)
        out = []
        for image, (height, width) in zip(features, grids):
            base, rest = image[0], image[1:]
            if not len(rest):
                out.append(torch.cat([base, newline[None]]))
                continue
            down, across, pad_rows, pad_cols = llava_next_layout(height, width, self.pinpoints, self.tile, self.patch)
            rows, cols = down * side, across * side
            grid = rest.view(down, across, side, side, -1).permute(4, 0, 2, 1, 3).reshape(-1, rows, cols)
            grid = grid[:, pad_rows:rows - pad_rows, pad_cols:cols - pad_cols]
            grid = torch.cat([grid, newline[:, None, None].expand(-1, grid.shape[1], 1)], dim=2)
            out.append(torch.cat([base, grid.flatten(1, 2).t()]))
        return out
