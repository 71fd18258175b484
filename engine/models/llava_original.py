"""The original LLaVA repository's layout (liuhaotian/llava-v1.5-*, llava-v1.6-*: config.json's
``LlavaLlamaForCausalLM`` / ``LlavaMistralForCausalLM``) and Yi-VL (01-ai/Yi-VL-6B / 34B, the
same layout with a LayerNorm projector): LMDeploy serves these repos, so conveyor does too.

The model is ``llava.py``'s (a CLIP tower's chosen layer, projected, over the image placeholders;
NeXT's tiles and ``image_newline`` for 1.6), reached by translating the layout:

- config.json is a Llama / Mistral config at top level plus ``mm_*`` fields: the tower named by
  ``mm_vision_tower`` (a hub id such as ``openai/clip-vit-large-patch14-336``, a path, or a folder
  of the model's: Yi-VL's ``./vit/...``), ``mm_vision_select_layer``, ``mm_vision_select_feature``
  (``patch``: the CLS row dropped; ``cls_patch``: kept), ``mm_projector_type``, and
  ``image_aspect_ratio`` (``pad`` / square: one CLIP image; ``anyres`` with ``mm_patch_merge_type``
  ``spatial_unpad``: NeXT's tiles).
- Weights: ``model.*`` and ``lm_head.*`` are the language model's own names;
  ``model.mm_projector.{i}.*`` the projector (an ``nn.Sequential``: ``mlp2x_gelu`` is Linear, GELU,
  Linear; Yi-VL's ``mlp2x_gelu_Norm`` Linear, LayerNorm, GELU, Linear, LayerNorm; ``linear`` a bare
  Linear); ``model.image_newline`` (1.6); the tower under ``model.vision_tower.vision_tower.`` when
  the checkpoint carries it (1.6 repos), else read from the tower's own directory (1.5 repos ship
  without it: a ``CLIPVisionModel`` or whole ``CLIPModel`` checkpoint, downloaded like a model when
  it is a hub id).
- The tower's shape comes from its directory's config.json, or, for the OpenAI towers the
  published repos name, from ``KNOWN_TOWERS`` (so a config parses and builds without a download).
- The image token: the original splices features where the prompt says ``<image>`` (Yi-VL:
  ``<image_placeholder>``) with no vocabulary entry (IMAGE_TOKEN_INDEX -200). Here the tokenizer
  stage finds that text as one added token and fills the image's span with ``placeholder_id``:
  the config's ``image_token_index`` when it names a vocabulary id, else 0 (``<unk>`` in the
  Llama / Vicuna / Mistral / Yi vocabularies, which no text encodes to under byte fallback). The
  engine overwrites those embeddings, and the prefix cache keys a span by its image's digest, so
  one shared id for every image is safe.
- LLaVA's canvases (``image_grid_pinpoints``) are ``[width, height]`` pairs in the original code
  and ``[height, width]`` in transformers'; ``hf_pinpoints`` swaps them so that the shared NeXT
  geometry (``protocol/multimodal.llava_next_layout``) picks the canvas the original picks, ties
  included.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import replace
from itertools import chain
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...protocol.errors import UnsupportedModelError
from ..hf_config import with_defaults
from ..model_config import ModelConfig
from ..weight_loader import iter_checkpoint, or_else
from .llava import LlavaForConditionalGeneration, LlavaNextForConditionalGeneration

# The towers the published configs name, as CLIPVisionConfig fields (their config.json's
# vision_config): a config names one by hub id and 1.6 repos carry its weights, so its shape is
# known without fetching the tower's repository.
_OPENAI_CLIP_L = {"model_type": "clip_vision_model", "hidden_size": 1024, "intermediate_size": 4096,
                  "num_hidden_layers": 24, "num_attention_heads": 16, "patch_size": 14, "hidden_act": "quick_gelu",
                  "layer_norm_eps": 1e-5, "num_channels": 3, "projection_dim": 768}
KNOWN_TOWERS: dict[str, dict[str, Any]] = {
    "openai/clip-vit-large-patch14-336": {**_OPENAI_CLIP_L, "image_size": 336},
    "openai/clip-vit-large-patch14": {**_OPENAI_CLIP_L, "image_size": 224},
}
# Their preprocessor_config.json (CLIPImageProcessor's fields), for the tokenizer stage.
_OPENAI_MEAN, _OPENAI_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
KNOWN_PROCESSORS: dict[str, dict[str, Any]] = {
    name: {"size": {"shortest_edge": cfg["image_size"]},
           "crop_size": {"height": cfg["image_size"], "width": cfg["image_size"]},
           "image_mean": _OPENAI_MEAN, "image_std": _OPENAI_STD, "do_center_crop": True, "do_convert_rgb": True,
           "resample": 3}
    for name, cfg in KNOWN_TOWERS.items()}

_TOWER = "model.vision_tower.vision_tower."
_PROJECTOR = re.compile(r"^(linear|mlp(\d+)x_gelu(_Norm)?)$")
_FEATURES = {"patch": "default", "cls_patch": "full"}


def is_original_layout(cfg: dict[str, Any]) -> bool:
    """Whether a config.json dict is the original LLaVA layout (``mm_vision_tower``, no ``text_config``)."""
    return "mm_vision_tower" in cfg and not cfg.get("text_config")


def is_yi_vl(cfg: dict[str, Any]) -> bool:
    """Yi-VL: its own projector type (``mlp2x_gelu_Norm``) tells it from liuhaotian's releases."""
    return str(cfg.get("mm_projector_type", "linear")).endswith("_Norm")


def uses_anyres(cfg: dict[str, Any]) -> bool:
    """LLaVA 1.6's tiles (``image_aspect_ratio`` ``anyres``) rather than one square image."""
    return cfg.get("image_aspect_ratio") == "anyres"


def placeholder_id(cfg: dict[str, Any]) -> int:
    """The id an image's span holds: the config's ``image_token_index`` when it is a vocabulary
    id, else 0 (``<unk>``; the embeddings are overwritten)."""
    token = cfg.get("image_token_index")
    if isinstance(token, int) and 0 <= token < int(cfg.get("vocab_size") or 0):
        return token
    return 0


def hf_pinpoints(cfg: dict[str, Any]) -> list[list[int]]:
    """The original's ``[width, height]`` canvases as transformers' ``[height, width]``, in order."""
    return [[int(h), int(w)] for w, h in cfg.get("image_grid_pinpoints") or ()]


def tower_path(cfg: dict[str, Any], model_dir: Path | None = None) -> Path | None:
    """The local directory ``mm_vision_tower`` names (a folder of the model's, or a path), or None
    for a hub id."""
    name = str(cfg["mm_vision_tower"])
    for candidate in ((model_dir / name) if model_dir is not None else None, Path(name).expanduser()):
        if candidate is not None and candidate.is_dir():
            return candidate
    return None


def tower_directory(cfg: dict[str, Any], model_dir: Path | None = None) -> Path:
    """``tower_path``, or the hub id downloaded (``weight_loader.resolve_model_path``)."""
    from ..weight_loader import resolve_model_path

    return tower_path(cfg, model_dir) or resolve_model_path(str(cfg["mm_vision_tower"]))


def tower_config(cfg: dict[str, Any], model_dir: Path | None = None) -> dict[str, Any]:
    """The CLIP tower's vision config (defaults filled): its directory's config.json (a
    ``CLIPVisionModel``'s, or a whole ``CLIPModel``'s ``vision_config``), else ``KNOWN_TOWERS``,
    else the hub id's, downloaded."""
    name = str(cfg["mm_vision_tower"])
    local = tower_path(cfg, model_dir)
    if local is None and name in KNOWN_TOWERS:
        vision = dict(KNOWN_TOWERS[name])
    else:
        directory = local or tower_directory(cfg, model_dir)
        data = json.loads((directory / "config.json").read_text())
        vision = dict(data.get("vision_config") or data)
        if data.get("model_type") == "clip":
            vision["model_type"] = "clip_vision_model"
    if vision.get("model_type", "clip_vision_model") != "clip_vision_model":
        raise UnsupportedModelError(f"LLaVA with a {vision.get('model_type')!r} vision tower ({name}) is not "
                                    "supported: conveyor runs the original LLaVA layout with CLIP towers "
                                    "(clip_vision_model)")
    return with_defaults({"model_type": "clip_vision_model", **vision})


def check_supported(cfg: dict[str, Any]) -> None:
    """UnsupportedModelError, naming the field, for what this layout's port does not run."""
    projector = str(cfg.get("mm_projector_type", "linear"))
    if not _PROJECTOR.match(projector):
        raise UnsupportedModelError(f"LLaVA's mm_projector_type {projector!r} is not supported: conveyor runs "
                                    "'linear', 'mlp<N>x_gelu' (LLaVA 1.5 / 1.6) and 'mlp<N>x_gelu_Norm' (Yi-VL)")
    feature = cfg.get("mm_vision_select_feature", "patch")
    if feature not in _FEATURES:
        raise UnsupportedModelError(f"LLaVA's mm_vision_select_feature {feature!r} is not supported: use 'patch' or "
                                    "'cls_patch'")
    aspect, merge = cfg.get("image_aspect_ratio") or "square", cfg.get("mm_patch_merge_type") or "flat"
    if aspect not in ("pad", "square", "anyres"):
        raise UnsupportedModelError(f"LLaVA's image_aspect_ratio {aspect!r} is not supported: conveyor runs 'pad' "
                                    "(1.5), 'square' and 'anyres' (1.6)")
    if (aspect == "anyres") != (merge == "spatial_unpad"):
        raise UnsupportedModelError(f"LLaVA with image_aspect_ratio {aspect!r} and mm_patch_merge_type {merge!r} is "
                                    "not supported: conveyor runs 'anyres' with 'spatial_unpad' (1.6) and 'pad' / "
                                    "'square' with 'flat' (1.5)")
    if aspect == "anyres" and feature != "patch":
        raise UnsupportedModelError("LLaVA 1.6 (anyres) with mm_vision_select_feature 'cls_patch' is not supported: "
                                    "its tiles' grid holds patches only")
    if cfg.get("mm_use_im_start_end") or cfg.get("mm_use_im_patch_token"):
        raise UnsupportedModelError("LLaVA with mm_use_im_start_end / mm_use_im_patch_token is not supported: the "
                                    "published 1.5 / 1.6 / Yi-VL checkpoints set both false")


def hf_layout(cfg: dict[str, Any], model_dir: Path | None = None) -> dict[str, Any]:
    """The original config's vision fields in transformers' LLaVA names, which ``llava.py`` reads."""
    check_supported(cfg)
    vision = tower_config(cfg, model_dir)
    if int(cfg.get("mm_hidden_size") or vision["hidden_size"]) != int(vision["hidden_size"]):
        raise UnsupportedModelError(f"mm_hidden_size {cfg['mm_hidden_size']} is not the hidden size "
                                    f"{vision['hidden_size']} of the tower {cfg['mm_vision_tower']}: check "
                                    "mm_vision_tower")
    return {**cfg, "vision_config": vision, "vision_feature_layer": int(cfg.get("mm_vision_select_layer", -2)),
            "vision_feature_select_strategy": _FEATURES[cfg.get("mm_vision_select_feature", "patch")],
            "image_grid_pinpoints": hf_pinpoints(cfg), "image_token_id": placeholder_id(cfg)}


def build_projector(cfg: dict[str, Any], vision_width: int, text_width: int) -> nn.Module:
    """``mm_projector_type`` as the original builds it, so that ``model.mm_projector.*`` loads by name."""
    match = _PROJECTOR.match(str(cfg.get("mm_projector_type", "linear")))
    if match.group(1) == "linear":
        return nn.Linear(vision_width, text_width)
    depth, norm = int(match.group(2)), bool(match.group(3))
    modules: list[nn.Module] = [nn.Linear(vision_width, text_width)]
    modules += [nn.LayerNorm(text_width)] if norm else []
    for _ in range(1, depth):
        modules += [nn.GELU(), nn.Linear(text_width, text_width)]
        modules += [nn.LayerNorm(text_width)] if norm else []
    return nn.Sequential(*modules)


class _OriginalLayout:
    """What the original layout changes in ``llava.py``'s models: the config read through
    ``hf_layout``, the projector built from ``mm_projector_type``, the checkpoint's names, and the
    tower's weights from its own directory when the checkpoint lacks them."""

    def __init__(self, config: ModelConfig, rope_scaling_factor: float = 0.0, max_position: int | None = None) -> None:
        # (ModelConfig.from_pretrained has made a model folder's mm_vision_tower a full path)
        original = config.vision or {}
        translated = hf_layout(original)
        super().__init__(replace(config, vision=translated), rope_scaling_factor, max_position)
        self.original = original
        self.multi_modal_projector = build_projector(
            original, int(translated["vision_config"]["hidden_size"]), config.hidden_size)

    def _route(self, weights: Iterable[tuple[str, torch.Tensor]],
               own: dict[str, tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The language model's tensors (``model.*``, ``lm_head.*``) as they are; the projector's,
        the tower's and ``image_newline`` collected into ``own``."""
        skip = tuple(f"vision_tower.{p}" for p in self.vision_tower.unused_prefixes())
        for name, tensor in weights:
            if name.startswith("model.mm_projector."):
                own[f"multi_modal_projector.{name[len('model.mm_projector.'):]}"] = (name, tensor)
            elif name.startswith(_TOWER):
                rest = f"vision_tower.{name[len(_TOWER):]}"
                if not rest.startswith(skip):
                    own[rest] = (name, tensor)
            elif name == "model.image_newline":
                own["image_newline"] = (name, tensor)
            else:
                yield name, tensor

    def _tower_from_directory(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The tower directory's ``vision_model.*`` under the checkpoint's tower prefix (a whole
        CLIPModel's text half left out): for a checkpoint that holds none of the tower."""
        directory = tower_directory(self.original)
        tensors = iter_checkpoint(directory, lazy=True)
        try:
            first = next(tensors, None)
        except UnsupportedModelError as exc:
            raise UnsupportedModelError(
                f"the checkpoint has no CLIP tower ({_TOWER}*) and mm_vision_tower's directory {directory} has no "
                "weights: put the tower's weights there (for a hub download, fetch the folder's files too, e.g. "
                "huggingface-cli download <repo> --include 'vit/*')") from exc
        for name, tensor in chain([first] if first is not None else [], tensors):
            if name.startswith("vision_model."):
                yield _TOWER + name, tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(or_else(weights, _TOWER, self._tower_from_directory))


class LlavaOriginal(_OriginalLayout, LlavaForConditionalGeneration):
    """LLaVA 1.5 and Yi-VL in the original layout: one CLIP image (``pad``: padded to a square with
    the processor's mean colour by the tokenizer stage), its patches projected."""


class LlavaOriginalNext(_OriginalLayout, LlavaNextForConditionalGeneration):
    """LLaVA 1.6 in the original layout (``anyres``, ``spatial_unpad``): NeXT's whole image, tiles
    and ``image_newline``."""


class LlavaLlamaForCausalLM(nn.Module):
    """config.json's ``LlavaLlamaForCausalLM`` (liuhaotian's Vicuna / Llama releases, Yi-VL): builds
    ``LlavaOriginalNext`` for an ``anyres`` config, else ``LlavaOriginal``."""

    def __new__(cls, config: ModelConfig, *args: Any, **kwargs: Any) -> nn.Module:
        layout = LlavaOriginalNext if uses_anyres(config.vision or {}) else LlavaOriginal
        return layout(config, *args, **kwargs)


class LlavaMistralForCausalLM(LlavaLlamaForCausalLM):
    """config.json's ``LlavaMistralForCausalLM`` (llava-v1.6-mistral-7b): the same, on Mistral."""
