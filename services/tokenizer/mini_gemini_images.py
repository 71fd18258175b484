"""Images for Mini-Gemini (dvlab-research/MGM: ``MGMLlamaForCausalLM``,
``MiniGeminiLlamaForCausalLM``), as its ``serve/cli.py`` prepares them.

The original layout's CLIP processor (``llava_original_images``), its resize and centre crop set
to ``image_size_aux`` (768) instead of the tower's side, after ``pad``'s mean-colour square: one
[3, 768, 768] tensor per image, which the aux ConvNeXt reads as it is and the model resizes to
CLIP's side for the CLIP tower (``engine/models/mini_gemini.py``). Each image is (CLIP side /
patch)² rows (576 for the 336 tower); the placeholder is LLaVA's ``<image>``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ...engine.models.llava_original import placeholder_id, tower_config
from ...engine.models.mini_gemini import with_hub_tower
from .image_prompt import PreparedImage
from .llava_original_images import OriginalLlavaImages, expand_to_square


class MiniGeminiImages(OriginalLlavaImages):
    """One ``<image>`` per image: the image at ``image_size_aux``, (side / patch)² rows."""

    def __init__(self, model_path: Path, config: dict[str, Any], tokenizer: Any) -> None:
        # the original layout's set-up on config.json as written, MGM's local CLIP path made the hub id
        self.model_path = Path(model_path)
        self.config = with_hub_tower(json.loads((self.model_path / "config.json").read_text()))
        self.placeholder = "<image>"
        if len(tokenizer.encode(self.placeholder, add_special_tokens=False)) != 1:
            tokenizer.add_tokens([self.placeholder], special_tokens=True)
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.placeholder)
        self.fill_id = placeholder_id(self.config)
        vision = tower_config(self.config, self.model_path)
        self.side, self.patch = int(vision["image_size"]), int(vision["patch_size"])
        self.aux_side = int(self.config.get("image_size_aux") or 320)
        self._processor = None
        self._tiler = None

    @property
    def processor(self) -> Any:
        """CLIP's processor for this model with its size and crop at ``image_size_aux``."""
        if self._processor is None:
            from transformers import CLIPImageProcessor

            clip = super().processor
            self._processor = CLIPImageProcessor(**{
                **clip.to_dict(), "size": {"shortest_edge": self.aux_side},
                "crop_size": {"height": self.aux_side, "width": self.aux_side}})
        return self._processor

    def _prepare(self, image: Any) -> PreparedImage:
        if self.config.get("image_aspect_ratio") == "pad":
            image = expand_to_square(image, tuple(int(c * 255) for c in self.processor.image_mean))
        pixels = self.processor(images=[image], return_tensors="np")["pixel_values"][0]
        return PreparedImage(pixels=pixels, grid=(), num_tokens=(self.side // self.patch) ** 2)
