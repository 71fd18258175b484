"""DeepSeek-VL images in a prompt (``MultiModalityCausalLM``), as its remote code prepares them.

- Pixels: the remote ``VLMImageProcessor``, written here with PIL / numpy (it is remote code, not a
  transformers class): the longer side resized to ``image_size`` (bicubic; the shorter side
  ``int(side / longer · image_size)``, at least ``min_size``), the image centred on a square of
  the background colour (``image_mean`` · 255, truncated; grey 127 without a mean), /255, then
  normalized when ``do_normalize``. Settings from the model's ``preprocessor_config.json``, else
  the processor's defaults at the tower's input size (1024 for the hybrid tower, 384 for SigLIP).
  Each tower normalizes again with its own ``pixel_mean`` / ``pixel_std`` (in the engine).
- The placeholder: ``<image_placeholder>``, one token in the published tokenizers (id 100015);
  ``VLChatProcessor`` replaces each by ``num_image_tokens`` copies of itself (576: the low-res
  grid), which ``expand`` does. A chat template that writes strings gets the placeholders right
  before the message's text, as DeepSeek-VL's own examples write them: ``<image_placeholder>Describe
  ...`` for one image, ``<image_placeholder> is Figure 1.\n<image_placeholder> is Figure 2.\n...``
  for several.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from ...engine.layers.deepseek_vl_vision import SIGLIP_MODELS, tower_geometry
from ...protocol.errors import UnsupportedModelError
from .image_prompt import ImagePrompt, PreparedImage

PLACEHOLDER = "<image_placeholder>"
# VLMImageProcessor's defaults (CLIP's mean and std)
_DEFAULTS = {"min_size": 14, "image_mean": [0.48145466, 0.4578275, 0.40821073],
             "image_std": [0.26862954, 0.26130258, 0.27577711], "rescale_factor": 1 / 255, "do_normalize": True}


def tower_sizes(config: dict[str, Any]) -> tuple[int, int]:
    """(the tower's input side, rows an image) of a DeepSeek-VL config.json."""
    vision = config.get("vision_config") or {}
    params = vision.get("params") or {}
    hybrid = str(vision.get("cls", "")).endswith("HybridVisionTower")
    low = (params.get("low_res_cfg") or {}) if hybrid else params
    high = params.get("high_res_cfg") or {}
    side = int(high.get("image_size", 1024)) if hybrid else int(low.get("image_size", 384))
    try:
        g = tower_geometry(low, SIGLIP_MODELS, "SigLIP")
    except ValueError as exc:
        raise UnsupportedModelError(str(exc)) from None
    return side, (g["image_size"] // int(g["patch_size"])) ** 2


def square_pixels(image: Any, side: int, settings: dict[str, Any]) -> np.ndarray:
    """An RGB PIL image -> float32 ``[3, side, side]`` as ``VLMImageProcessor`` makes it."""
    from PIL import Image

    width, height = image.size
    longer = max(width, height)
    min_size = int(settings["min_size"])
    new_h = max(int(height / longer * side), min_size)
    new_w = max(int(width / longer * side), min_size)
    image = image.convert("RGB").resize((new_w, new_h), Image.BICUBIC)
    mean = settings.get("image_mean")
    color = (127, 127, 127) if mean is None else tuple(int(m * 255) for m in mean)
    if new_w != new_h:
        square = max(new_w, new_h)
        canvas = Image.new("RGB", (square, square), color)
        canvas.paste(image, (0, (new_w - new_h) // 2) if new_w > new_h else ((new_h - new_w) // 2, 0))
        image = canvas
    pixels = (np.asarray(image, dtype=np.float64).transpose(2, 0, 1) * float(settings["rescale_factor"]))
    pixels = pixels.astype(np.float32)
    if settings.get("do_normalize", True):
        m = np.asarray(settings["image_mean"], dtype=np.float32)[:, None, None]
        s = np.asarray(settings["image_std"], dtype=np.float32)[:, None, None]
        pixels = (pixels - m) / s
    return np.ascontiguousarray(pixels, dtype=np.float32)


def placeholders(n: int) -> str:
    """The text before a message's own for its ``n`` images: the placeholder alone for one image;
    for several, each named as a figure, as DeepSeek-VL's README prompts several images
    (LMDeploy writes the same lines, numbered from 0)."""
    if n == 1:
        return PLACEHOLDER
    return "".join(f"{PLACEHOLDER} is Figure {i}.\n" for i in range(1, n + 1))


class DeepseekVLImages(ImagePrompt):
    placeholder = PLACEHOLDER

    def __init__(self, model_path: Path, config: dict[str, Any], tokenizer: Any) -> None:
        super().__init__(model_path, config, tokenizer)
        if len(tokenizer.encode(PLACEHOLDER, add_special_tokens=False)) != 1:
            raise UnsupportedModelError(f"this DeepSeek-VL tokenizer has no {PLACEHOLDER} token: serve the model "
                                        "directory's own tokenizer (the published ones have it, id 100015)")
        self.side, self.rows = tower_sizes(config)
        settings = dict(_DEFAULTS, image_size=self.side)
        file = Path(model_path) / "preprocessor_config.json"
        if file.is_file():
            settings.update({k: v for k, v in json.loads(file.read_text()).items() if k in settings})
        if int(settings["image_size"]) != self.side:
            raise UnsupportedModelError(f"preprocessor_config.json's image_size {settings['image_size']} is not the "
                                        f"DeepSeek-VL tower's {self.side}")
        self.settings = settings

    def _prepare(self, image: Any) -> PreparedImage:
        return PreparedImage(pixels=square_pixels(image, self.side, self.settings), grid=(), num_tokens=self.rows)

    def _string_content(self, images: int, text: str) -> str:
        """A string template gets the placeholders right before the text."""
        return placeholders(images) + text
