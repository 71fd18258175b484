"""Qwen2-VL and Qwen2.5-VL images in a prompt: each image at (about) its native resolution.

transformers' ``Qwen2VLImageProcessor`` resizes an image so both sides are multiples of
``patch_size * merge_size`` (28) and its area lies within ``min_pixels``..``max_pixels`` (the
model directory's ``preprocessor_config.json``), then cuts it into ``[t * h * w, C * T * P * P]``
patch rows with the patch grid ``[t, h, w]``. The chat template writes
``<|vision_start|><|image_pad|><|vision_end|>`` per image; ``<|image_pad|>`` expands to one token
per ``merge x merge`` block of patches. The grid travels with the pixels: the engine's tower
needs it, and so do the language model's multimodal rotary positions.
"""

from __future__ import annotations

import math
from typing import Any

from .image_prompt import ImagePrompt, PreparedImage


class Qwen2VLImages(ImagePrompt):
    placeholder = "<|vision_start|><|image_pad|><|vision_end|>"

    def _prepare(self, image: Any) -> PreparedImage:
        out = self.processor(images=[image], return_tensors="np")
        grid = tuple(int(v) for v in out["image_grid_thw"][0])
        merge = int((self.config.get("vision_config") or {}).get("spatial_merge_size", 2))
        return PreparedImage(pixels=out["pixel_values"], grid=grid, num_tokens=math.prod(grid) // (merge * merge))
