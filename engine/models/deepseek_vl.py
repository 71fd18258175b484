"""DeepSeek-VL (``MultiModalityCausalLM``: deepseek-ai/deepseek-vl-7b-chat, deepseek-vl-1.3b-chat and
their base models): a vision tower, an MLP aligner and a Llama language model.

config.json (the remote code's, github:deepseek-ai/DeepSeek-VL): ``language_config`` (a Llama
config: the language model), ``vision_config`` (``cls`` and ``params``) and ``aligner_config``
(``cls`` ``MlpProjector`` and ``params``: ``projector_type``, ``depth``, ``input_dim``, ``n_embed``).
Two towers (``engine/layers/deepseek_vl_vision.py``):

- ``CLIPVisionTower`` with a ``siglip_*`` model (1.3B): each image [3, 384, 384] -> 576 SigLIP rows;
  aligner ``mlp_gelu`` (Linear, then ``depth - 1`` x (GELU, Linear)) or ``linear``.
- ``HybridVisionTower`` (7B): each image [3, 1024, 1024] -> 576 SAM-B rows beside 576 SigLIP rows
  (the image resized to 384 in the tower); aligner ``low_high_hybrid_split_mlp_gelu``: each half
  up-projected to ``n_embed / 2`` (SAM's by ``high_up_proj``, SigLIP's by ``low_up_proj``),
  concatenated, then ``depth - 1`` x (GELU, Linear).

Every image gives 576 rows at the published sizes, one per ``<image_placeholder>`` token that the
tokenizer stage expanded (``services/tokenizer/deepseek_vl_images.py``); the image token's id is
the tokenizer's (``ModelConfig.from_pretrained`` reads it into ``image_token_id``; 100015 in the
published tokenizers). Weights: ``vision_model.*`` and ``aligner.*`` in the remote modules' own
names (loaded by name), ``language_model.model.*`` / ``language_model.lm_head.*`` (Llama's).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from ...protocol.errors import UnsupportedModelError
from ..layers.deepseek_vl_vision import HybridTower, SiglipViT, siglip_tower
from ..model_config import ModelConfig
from .vision_language import VisionLanguageModel, build_language_model, refuse_quantized

_TOWERS = ("CLIPVisionTower", "HybridVisionTower")
_ALIGNERS = ("linear", "mlp_gelu", "low_high_hybrid_split_mlp_gelu")
DEFAULT_IMAGE_TOKEN_ID = 100015  # <image_placeholder> in the published tokenizers


def _cls_name(section: dict) -> str:
    """``cls`` of a vision / aligner config, as the remote code matches it (a dotted path's tail)."""
    return str(section.get("cls", "")).rsplit(".", 1)[-1]


class MlpAligner(nn.Module):
    """The remote ``MlpProjector``, with its parameter names (``layers.N``, ``high_up_proj``, ...)."""

    def __init__(self, params: dict, text_width: int, tower_widths: tuple[int, ...]) -> None:
        super().__init__()
        kind = params.get("projector_type")
        if kind not in _ALIGNERS:
            raise UnsupportedModelError(f"DeepSeek-VL aligner projector_type {kind!r} is not supported: "
                                        f"{', '.join(_ALIGNERS)}")
        n_embed = int(params.get("n_embed", text_width))
        if n_embed != text_width:
            raise UnsupportedModelError(f"DeepSeek-VL aligner n_embed {n_embed} differs from the language model's "
                                        f"hidden_size {text_width}")
        width = int(params.get("input_dim", tower_widths[-1]))
        if any(w != width for w in tower_widths):
            raise UnsupportedModelError(f"DeepSeek-VL aligner input_dim {width} does not match the tower's widths "
                                        f"{list(tower_widths)}")
        depth = int(params.get("depth", 1))
        self.hybrid = kind == "low_high_hybrid_split_mlp_gelu"
        if self.hybrid != (len(tower_widths) == 2):
            raise UnsupportedModelError(f"DeepSeek-VL aligner {kind!r} does not fit its vision tower: the hybrid "
                                        "tower takes low_high_hybrid_split_mlp_gelu, a single tower linear or mlp_gelu")
        if kind == "linear":
            self.layers = nn.Linear(width, n_embed)
            return
        if self.hybrid:
            if n_embed % 2:
                raise UnsupportedModelError(f"DeepSeek-VL hybrid aligner n_embed {n_embed} is odd")
            self.high_up_proj = nn.Linear(width, n_embed // 2)
            self.low_up_proj = nn.Linear(width, n_embed // 2)
            modules: list[nn.Module] = []
        else:
            modules = [nn.Linear(width, n_embed)]
        for _ in range(1, depth):
            modules += [nn.GELU(), nn.Linear(n_embed, n_embed)]
        self.layers = nn.Sequential(*modules)

    def forward(self, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if self.hybrid:
            high, low = x
            x = torch.cat([self.high_up_proj(high), self.low_up_proj(low)], dim=-1)
        return self.layers(x)


class MultiModalityCausalLM(VisionLanguageModel):
    """DeepSeek-VL: the tower's rows, aligned, in place of the image placeholders."""

    def __init__(self, config: ModelConfig, rope_scaling_factor: float = 0.0, max_position: int | None = None) -> None:
        super().__init__()
        self.config = config
        full = config.vision or {}
        vision, aligner = full.get("vision_config") or {}, full.get("aligner_config") or {}
        tower, aligner_cls = _cls_name(vision), _cls_name(aligner)
        if tower not in _TOWERS:
            raise UnsupportedModelError(f"DeepSeek-VL vision tower {tower!r} is not supported: {', '.join(_TOWERS)}")
        if aligner_cls != "MlpProjector":
            raise UnsupportedModelError(f"DeepSeek-VL aligner {aligner_cls!r} is not supported: MlpProjector")
        params = vision.get("params") or {}
        refuse_quantized(config)
        try:
            if tower == "HybridVisionTower":
                if params.get("concat_type", "tuple") != "tuple":
                    raise UnsupportedModelError(f"DeepSeek-VL hybrid tower concat_type {params['concat_type']!r} "
                                                "is not supported: tuple (what the published models use)")
                self.vision_model = HybridTower(params)
                high = self.vision_model.vision_tower_high.vision_tower
                widths: tuple[int, ...] = (high.channels, self.vision_model.vision_tower_low.vision_tower.width)
                low_vit: SiglipViT = self.vision_model.vision_tower_low.vision_tower
            else:
                if not str(params.get("model_name", "")).startswith("siglip"):
                    raise UnsupportedModelError(
                        f"DeepSeek-VL CLIPVisionTower {params.get('model_name')!r} is not supported: its siglip_* "
                        "towers (siglip_large_patch16_384) are; a transformers CLIP or a SAM alone is not")
                self.vision_model = siglip_tower(params)
                low_vit = self.vision_model.vision_tower
                widths = (low_vit.width,)
        except ValueError as exc:
            raise UnsupportedModelError(str(exc)) from None
        self.image_size = self.vision_model.image_size if tower == "HybridVisionTower" else low_vit.image_size
        self.rows = low_vit.grid * low_vit.grid
        self.aligner = MlpAligner(aligner.get("params") or {}, config.hidden_size, widths)
        self.language_model = build_language_model(config, rope_scaling_factor, max_position)
        token = full.get("image_token_id")
        self.image_token_id: int = int(token if token is not None else DEFAULT_IMAGE_TOKEN_ID)

    # ---- the model runner's interface (the rest: VisionLanguageModel) ------------------------
    def encode_images(self, pixel_values: torch.Tensor, grids: list[list[int]] | None = None) -> list[torch.Tensor]:
        """[B, 3, S, S] pixels (the processor's, before each tower's own normalization) -> each
        image's [rows, hidden] features, the batch through the tower once."""
        return list(self.aligner(self.vision_model(pixel_values)))

    def image_rows_for(self, shape: list[int], grid: list[int]) -> int:
        side = self.image_size
        if shape != [3, side, side]:
            raise ValueError(f"DeepSeek-VL's tower takes [3, {side}, {side}] pixels")
        return self.rows

    def warmup_images(self, tokens: int) -> tuple[list[int], list[list[int]]]:
        n = max(1, tokens // self.rows)
        return [n, 3, self.image_size, self.image_size], [[]] * n

    # ---- weight loading ---------------------------------------------------------------------
    def _route(self, weights: Iterable[tuple[str, torch.Tensor]],
               own: dict[str, tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The language model's tensors under its own names; the tower's and aligner's collected
        into ``own`` (their names are the parameters')."""
        vm = self.vision_model
        unused = vm.unused_prefixes() if isinstance(vm, HybridTower) else tuple(
            f"vision_tower.{p}" for p in SiglipViT.unused_prefixes())
        skip = tuple(f"vision_model.{p}" for p in unused)
        for name, tensor in weights:
            if name.startswith("language_model."):
                yield name[len("language_model."):], tensor
            elif name.startswith(("vision_model.", "aligner.")):
                if not name.startswith(skip):
                    own[name] = (name, tensor)
            else:
                raise ValueError(f"checkpoint tensor {name} belongs to no part of DeepSeek-VL (vision_model, "
                                 "aligner, language_model)")

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the checkpoint; raise if any parameter stays unloaded or a tensor fits none."""
        own: dict[str, tuple[str, torch.Tensor]] = {}
        self.language_model.load_weights(self._route(weights, own))
        self.load_own(own)
