"""LLaVA 1.5 and LLaVA-NeXT (1.6) images in a prompt: CLIP's square, or NeXT's whole image plus
the tiles of its best canvas, each ``<image>`` expanded to the tower's row count."""

from __future__ import annotations

from typing import Any

from ...protocol.multimodal import llava_next_rows
from .image_prompt import ImagePrompt, PreparedImage


class LlavaImages(ImagePrompt):
    """LLaVA 1.5 (llava-hf layout): one ``<image>`` per image, the CLIP processor's resized and
    centre-cropped square, (side / patch)² encoder rows (+1 with the CLS row kept, ``full``)."""


    def _prepare(self, image: Any) -> PreparedImage:
        pixels = self.processor(images=[image], return_tensors="np")["pixel_values"][0]
        vision = self.config.get("vision_config") or {}
        patch = int(vision.get("patch_size", 14))
        height, width = pixels.shape[-2:]
        rows = (height // patch) * (width // patch)
        if self.config.get("vision_feature_select_strategy", "default") == "full":
            rows += 1  # the CLS row
        return PreparedImage(pixels=pixels, grid=(), num_tokens=rows)


class LlavaNextImages(LlavaImages):
    """LLaVA-NeXT (1.6): each image as its resized whole plus the tiles of the canvas that fits it
    best (``image_grid_pinpoints``), pixels ``[tiles, 3, side, side]``; ``grid`` is the original
    ``[height, width]``, from which the model unpads its features."""


    def _prepare(self, image: Any) -> PreparedImage:
        out = self.processor(images=[image], return_tensors="np")
        pixels, (height, width) = out["pixel_values"][0], (int(v) for v in out["image_sizes"][0])
        vision = self.config.get("vision_config") or {}
        pinpoints = self.config.get("image_grid_pinpoints") or self.processor.image_grid_pinpoints
        rows = llava_next_rows(height, width, pinpoints, int(vision.get("image_size", 336)),
                               int(vision.get("patch_size", 14)),
                               self.config.get("vision_feature_select_strategy", "default") == "full")
        return PreparedImage(pixels=pixels, grid=(height, width), num_tokens=rows)
