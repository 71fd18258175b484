"""Mini-Gemini (dvlab-research/MGM: YanweiLi/MGM-7B / 13B; config.json's ``MGMLlamaForCausalLM``,
earlier ``MiniGeminiLlamaForCausalLM``): the original LLaVA layout (``llava_original.py``) plus an
auxiliary high-resolution ConvNeXt tower and "patch info mining".

Per image (the non-HD models: ``image_grid`` 1, no ``image_global``):

- The tokenizer stage sends one ``image_size_aux`` square (768: CLIP's processor at that size, the
  image first padded to a square with its mean colour under ``pad``). The CLIP image is that
  tensor resized to the tower's side (bilinear, ``align_corners=False``), as the original's
  ``serve/cli.py`` makes it; CLIP's chosen layer without its CLS row gives (336 / 14)² = 576 rows.
- The aux tower (open_clip's ConvNeXt trunk, ``engine/layers/convnext.py``) runs on the 768
  square; its four stages' maps, the later three resized to stage 0's (bilinear,
  ``align_corners=False``), are concatenated along channels: ``mm_hidden_size_aux`` (2880 for
  ``convnext_large_d_320``) channels on a 192 x 192 grid.
- Mining: each CLIP row i is a query, ``vlm_uni_query_projector`` (LayerNorm, Linear); the aux
  grid is cut into one p x p window per CLIP patch (p = 192 / 24 = 8), whose cells give keys
  (``vlm_uni_aux_projector``) and values (``vlm_uni_val_projector``), each LayerNorm, Linear into
  the CLIP width. The row's scores are query . key / sqrt(width) (NaN as 0), softmaxed over the
  window; the weighted values' sum is added to the CLIP row. Then ``mm_projector`` as LLaVA's.

Weights: LLaVA's original names plus ``model.vision_tower_aux.vision_stem.*`` /
``model.vision_tower_aux.vision_stages.*`` (timm's ``stem`` / ``stages``) and
``model.vlm_uni_{query,aux,val}_projector.{0,1}.*``. A checkpoint without the aux tower reads it
from ``mm_vision_tower_aux``'s directory (open_clip's ``visual.trunk.stem`` / ``stages``).

The aux tower's shape: its directory's config.json in transformers' ``ConvNextConfig`` fields
(``hidden_sizes``, ``depths``) when it has one, else the open_clip model its name says (as the
original tells them apart: ``large`` + ``d-320``, ``base`` + ``w-320``, ``xxlarge``).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...protocol.errors import UnsupportedModelError
from ..layers.convnext import ConvNextTrunk
from ..model_config import ModelConfig
from ..weight_loader import iter_checkpoint, or_else
from .llava import LlavaForConditionalGeneration
from .llava_original import KNOWN_TOWERS, _OriginalLayout

_AUX = "model.vision_tower_aux."
_UNI = ("vlm_uni_query_projector", "vlm_uni_aux_projector", "vlm_uni_val_projector")
# open_clip's ConvNeXt trunks the original recognises by name: (widths, depths)
KNOWN_AUX_TOWERS: dict[str, tuple[list[int], list[int]]] = {
    "convnext_large_d_320": ([192, 384, 768, 1536], [3, 3, 27, 3]),
    "convnext_base_w_320": ([128, 256, 512, 1024], [3, 3, 27, 3]),
    "convnext_xxlarge": ([384, 768, 1536, 3072], [3, 4, 30, 3]),
}


def aux_tower_path(cfg: dict[str, Any]) -> Path | None:
    """``mm_vision_tower_aux`` as a local directory, or None."""
    path = Path(str(cfg.get("mm_vision_tower_aux") or "")).expanduser()
    return path if str(path) not in ("", ".") and path.is_dir() else None


def aux_tower_shape(cfg: dict[str, Any]) -> tuple[list[int], list[int]]:
    """The aux ConvNeXt's (widths, depths): its directory's ConvNextConfig-style config.json, else
    the open_clip model its name says."""
    name = str(cfg.get("mm_vision_tower_aux") or "")
    local = aux_tower_path(cfg)
    if local is not None and (local / "config.json").is_file():
        data = json.loads((local / "config.json").read_text())
        if data.get("hidden_sizes") and data.get("depths"):
            return [int(w) for w in data["hidden_sizes"]], [int(d) for d in data["depths"]]
    low = Path(name).name.lower()
    if "convnext" in low:
        if "xxlarge" in low:
            return KNOWN_AUX_TOWERS["convnext_xxlarge"]
        if "large" in low and "d-320" in low:
            return KNOWN_AUX_TOWERS["convnext_large_d_320"]
        if "base" in low and "w-320" in low:
            return KNOWN_AUX_TOWERS["convnext_base_w_320"]
    raise UnsupportedModelError(f"Mini-Gemini's aux tower {name!r} is not supported: conveyor runs open_clip's "
                                "ConvNeXt towers (convnext-large-d-320, convnext-base-w-320, convnext-xxlarge) "
                                "or a directory whose config.json gives ConvNeXt's hidden_sizes and depths")


def with_hub_tower(cfg: dict[str, Any]) -> dict[str, Any]:
    """The config with a CLIP tower named by a missing local path whose last part is a known
    OpenAI tower's (MGM's ``model_zoo/OpenAI/clip-vit-large-patch14-336``) named by its hub id,
    so that its shape is known and its weights, when the checkpoint lacks them, download."""
    name = str(cfg.get("mm_vision_tower") or "")
    if not name or name in KNOWN_TOWERS or Path(name).expanduser().is_dir():
        return cfg
    hub = next((k for k in KNOWN_TOWERS if k.split("/")[-1] == Path(name).name), None)
    return {**cfg, "mm_vision_tower": hub} if hub else cfg


def check_mini_gemini(cfg: dict[str, Any]) -> None:
    """UnsupportedModelError, naming the field, for Mini-Gemini configs this port does not run."""
    if not cfg.get("mm_vision_tower_aux"):
        raise UnsupportedModelError("a Mini-Gemini config without mm_vision_tower_aux is not supported: the "
                                    "published MGM models all carry the ConvNeXt tower")
    if int(cfg.get("image_grid") or 1) > 1 or cfg.get("image_global"):
        raise UnsupportedModelError("Mini-Gemini HD (image_grid > 1 / image_global: MGM-*-HD) is not supported: "
                                    "serve the non-HD MGM-7B / 13B")
    if cfg.get("mm_vision_select_feature", "patch") != "patch":
        raise UnsupportedModelError("Mini-Gemini with mm_vision_select_feature other than 'patch' is not supported: "
                                    "its mining windows tile the CLIP patch grid")
    if cfg.get("image_aspect_ratio") == "anyres":
        raise UnsupportedModelError("Mini-Gemini with image_aspect_ratio 'anyres' is not supported: use 'pad'")


def uni_projector(width_in: int, width: int) -> nn.Sequential:
    """LayerNorm then Linear: the original's ``vlm_uni_*_projector``."""
    return nn.Sequential(nn.LayerNorm(width_in), nn.Linear(width_in, width))


class MiniGemini(_OriginalLayout, LlavaForConditionalGeneration):
    """LLaVA 1.5's model with the aux tower's windows mined into each CLIP row before projection."""

    def __init__(self, config: ModelConfig, rope_scaling_factor: float = 0.0, max_position: int | None = None) -> None:
        check_mini_gemini(config.vision or {})
        config = replace(config, vision=with_hub_tower(config.vision or {}))
        super().__init__(config, rope_scaling_factor, max_position)
        cfg = self.original
        widths, depths = aux_tower_shape(cfg)
        aux_width = sum(widths)
        if int(cfg.get("mm_hidden_size_aux") or aux_width) != aux_width:
            raise UnsupportedModelError(f"mm_hidden_size_aux {cfg['mm_hidden_size_aux']} is not the aux tower's "
                                        f"{aux_width} channels (its stages' {widths}): check mm_vision_tower_aux")
        self.aux_side = int(cfg.get("image_size_aux") or 320)
        side = self.tile // self.patch
        grid = self.aux_side // 4
        if self.aux_side % 4 or grid % side:
            raise UnsupportedModelError(f"Mini-Gemini's image_size_aux {self.aux_side} does not tile the CLIP grid of "
                                        f"{side} x {side} patches (its stage-0 grid, image_size_aux / 4, must be a "
                                        "multiple)")
        width = int(self.config.vision["vision_config"]["hidden_size"])  # hf_layout's tower config
        self.vision_tower_aux = ConvNextTrunk(widths, depths)
        self.vlm_uni_query_projector = uni_projector(width, width)
        self.vlm_uni_aux_projector = uni_projector(aux_width, width)
        self.vlm_uni_val_projector = uni_projector(aux_width, width)

    # ---- the model runner's interface ---------------------------------------------------------
    def image_rows_for(self, shape: list[int], grid: list[int]) -> int:
        if shape != [3, self.aux_side, self.aux_side]:
            raise ValueError(f"Mini-Gemini takes [3, {self.aux_side}, {self.aux_side}] pixels (image_size_aux)")
        return (self.tile // self.patch) ** 2

    def warmup_images(self, tokens: int) -> tuple[list[int], list[list[int]]]:
        n = max(1, tokens // (self.tile // self.patch) ** 2)
        return [n, 3, self.aux_side, self.aux_side], [[]] * n

    def _features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[B, 3, aux, aux] pixels -> [B, rows, hidden]: CLIP's rows of the resized image, mined
        from the aux tower's windows, projected."""
        small = F.interpolate(pixel_values.float(), size=(self.tile, self.tile), mode="bilinear",
                              align_corners=False).to(pixel_values.dtype)
        states = self.vision_tower.hidden_states(small)
        clip = torch.cat([s[:, 1:] for s in states], dim=-1)
        return self.multi_modal_projector(clip + self.mine(clip, self.aux_features(pixel_values)))

    def aux_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[B, 3, aux, aux] -> [B, sum(widths), aux / 4, aux / 4]: every stage's map at stage 0's size."""
        maps = self.vision_tower_aux.stage_outputs(pixel_values)
        size = maps[0].shape[-2:]
        resized = [maps[0]] + [F.interpolate(m.float(), size=size, mode="bilinear", align_corners=False).to(m.dtype)
                               for m in maps[1:]]
        return torch.cat(resized, dim=1)

    def mine(self, clip: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        """[B, N, C] CLIP rows and [B, C_aux, G, G] aux maps -> [B, N, C]: each row's attention over
        the aux cells of its patch's window, averaged over the query (one) row."""
        b, n, _ = clip.shape
        side = math.isqrt(n)
        p = aux.shape[-1] // side
        cells = aux.permute(0, 2, 3, 1).reshape(b, side, p, side, p, -1).permute(0, 1, 3, 2, 4, 5)
        cells = cells.reshape(b, n, p * p, -1)
        query = self.vlm_uni_query_projector(clip)[:, :, None]  # [B, N, 1, C]
        keys = self.vlm_uni_aux_projector(cells)  # [B, N, p², C]
        values = self.vlm_uni_val_projector(cells)
        scores = (query @ (keys.transpose(-1, -2) / math.sqrt(keys.shape[-1]))).nan_to_num()
        return (scores.softmax(-1) @ values).mean(2)

    # ---- weight loading -----------------------------------------------------------------------
    def _route(self, weights: Iterable[tuple[str, torch.Tensor]],
               own: dict[str, tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The aux tower's and the mining projectors' tensors into ``own``; the rest as the original layout's."""

        def rest() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith(_AUX + "vision_stem."):
                    own["vision_tower_aux.stem." + name[len(_AUX + "vision_stem."):]] = (name, tensor)
                elif name.startswith(_AUX + "vision_stages."):
                    own["vision_tower_aux.stages." + name[len(_AUX + "vision_stages."):]] = (name, tensor)
                elif name.startswith(tuple(f"model.{u}." for u in _UNI)):
                    own[name[len("model."):]] = (name, tensor)
                else:
                    yield name, tensor

        yield from super()._route(rest(), own)

    def _aux_from_directory(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The aux tower directory's open_clip trunk (``visual.trunk.stem`` / ``stages``) under the
        checkpoint's names: for a checkpoint that holds none of the aux tower."""
        directory = aux_tower_path(self.original)
        if directory is None:
            raise UnsupportedModelError(
                f"the checkpoint has no aux tower ({_AUX}*) and mm_vision_tower_aux "
                f"({self.original.get('mm_vision_tower_aux')}) is not a directory: download the open_clip tower "
                "(laion/CLIP-convnext_large_d_320.laion2B-s29B-b131K-ft-soup) and set mm_vision_tower_aux to it")
        renames = (("visual.trunk.stem.", _AUX + "vision_stem."), ("visual.trunk.stages.", _AUX + "vision_stages."))
        for name, tensor in iter_checkpoint(directory, lazy=True):
            match = next((r for r in renames if name.startswith(r[0])), None)
            if match is not None:
                yield match[1] + name[len(match[0]):], tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(or_else(weights, _AUX, self._aux_from_directory))


class MGMLlamaForCausalLM(MiniGemini):
    """config.json's ``MGMLlamaForCausalLM`` (YanweiLi/MGM-7B, MGM-13B), on Llama / Vicuna."""


class MiniGeminiLlamaForCausalLM(MiniGemini):
    """config.json's ``MiniGeminiLlamaForCausalLM`` (the repository's earlier name), the same."""
