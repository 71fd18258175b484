"""Qwen-VL / Qwen-VL-Chat (Qwen's remote code): a ViT-bigG tower with a Resampler
(``layers/qwen_vl_vision.py``) before the Qwen (v1) language model of ``qwen.py``.

Its config.json names the text model's class, ``QWenLMHeadModel``, and adds a ``visual`` dict
(``image_size``, ``patch_size``, ``width``, ``layers``, ``heads``, ``mlp_ratio``, ``output_dim``,
``image_start_id``; ``n_queries`` 256 unless given); the registry calls such a config
``QWenVLLMHeadModel`` (``model_registry.vision_variant``). Everything but ``visual`` is the
language model's config, and its tensors keep Qwen's names (``transformer.h.N.*``,
``transformer.wte``, ``lm_head``); the tower's are ``transformer.visual.*``.

An image is ``<img>`` + 256 tokens + ``</img>`` in the prompt; the remote code writes the
image's path or URL there as byte ids padded with ``<imgpad>`` (``image_start_id + 2``) and
overwrites all 256 positions with the tower's rows. The tokenizer stage fills the span with
``<imgpad>`` only (``services/tokenizer/qwen_vl_images.py``), which is this model's image token:
the same embeddings after the overwrite, and a span the engine can check.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from ...protocol.errors import UnsupportedModelError
from ..layers.qwen_vl_vision import QwenVLVisionTransformer
from ..model_config import ModelConfig
from .vision_language import VisionLanguageModel, build_language_model, refuse_quantized

_TOWER = "transformer.visual."


class QWenVLLMHeadModel(VisionLanguageModel):
    """Each image's 256 Resampler rows in place of its ``<imgpad>`` tokens; Qwen (v1) does the rest."""

    def __init__(self, config: ModelConfig, rope_scaling_factor: float = 0.0, max_position: int | None = None) -> None:
        super().__init__()
        self.config = config
        visual = dict((config.vision or {}).get("visual") or {})
        refuse_quantized(config)
        output_dim = int(visual.get("output_dim", 0))
        if output_dim != config.hidden_size:
            raise UnsupportedModelError(f"Qwen-VL's visual output_dim {output_dim} differs from the language model's "
                                        f"hidden_size {config.hidden_size}: its rows would not fit the embeddings")
        self.language_model = build_language_model(config, rope_scaling_factor, max_position)
        self.visual = QwenVLVisionTransformer(visual)
        # <img>, </img>, then <imgpad>: the remote code's ids, counted from image_start_id
        self.image_token_id: int = int(visual.get("image_start_id", 151857)) + 2

    # ---- the model runner's interface (the rest: VisionLanguageModel) ------------------------
    def encode_images(self, pixel_values: torch.Tensor, grids: list[list[int]] | None = None) -> list[torch.Tensor]:
        """[B, 3, side, side] pixels -> each image's [n_queries, hidden] rows, one tower call."""
        return list(self.visual(pixel_values))

    def image_rows_for(self, shape: list[int], grid: list[int]) -> int:
        side = self.visual.image_size
        if shape != [3, side, side]:
            raise ValueError(f"Qwen-VL's tower takes [3, {side}, {side}] pixels")
        return self.visual.attn_pool.query.shape[0]

    def warmup_images(self, tokens: int) -> tuple[list[int], list[list[int]]]:
        side, rows = self.visual.image_size, self.visual.attn_pool.query.shape[0]
        n = max(1, tokens // rows)
        return [n, 3, side, side], [[]] * n

    # ---- weight loading ---------------------------------------------------------------------
    def _route(self, weights: Iterable[tuple[str, torch.Tensor]],
               own: dict[str, tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The language model's tensors, as they are (Qwen's names); the tower's collected into ``own``."""
        for name, tensor in weights:
            if name.startswith(_TOWER):
                own[f"visual.{name[len(_TOWER):]}"] = (name, tensor)
            else:
                yield name, tensor

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the checkpoint; raise if any parameter stays unloaded or a tensor fits none."""
        own: dict[str, tuple[str, torch.Tensor]] = {}
        self.language_model.load_weights(self._route(weights, own))
        self.load_own(own)
