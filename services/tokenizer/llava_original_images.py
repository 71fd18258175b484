"""Images for the original LLaVA repository's layout (liuhaotian/llava-v1.5 / v1.6:
``LlavaLlamaForCausalLM``, ``LlavaMistralForCausalLM``) and Yi-VL, as that repository prepares them.

- The processor: CLIP's, from the model's ``preprocessor_config.json`` when it has one, else from
  the tower's (``mm_vision_tower``: a folder of the model's, a path, the OpenAI towers' known
  settings, or the hub id's, downloaded).
- ``image_aspect_ratio`` ``pad`` (1.5, Yi-VL): the image padded to a square with the processor's
  mean colour, then CLIP's resize and centre crop; ``square`` / unset: CLIP's alone; ``anyres``
  (1.6): NeXT's whole image plus the tiles of its best canvas (transformers'
  ``LlavaNextImageProcessor`` on CLIP's settings, which does what the original's
  ``process_anyres_image`` does; its canvases swapped to ``[height, width]``:
  ``engine/models/llava_original.hf_pinpoints``).
- The placeholder: ``<image>`` (Yi-VL: ``<image_placeholder>``), which these tokenizers lack (the
  original splices features at a -200 id instead): it is added to the tokenizer as one special
  token, found by ``expand``, and the span written with ``placeholder_id`` (an id inside the
  vocabulary, whose embeddings the engine overwrites).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ...engine.models.llava_original import (KNOWN_PROCESSORS, hf_pinpoints, is_yi_vl, placeholder_id,
                                             tower_config, tower_directory, tower_path, uses_anyres)
from ...protocol.multimodal import ImageInput, llava_next_rows
from .image_prompt import ImagePrompt, PreparedImage

YI_VL_PLACEHOLDER = "<image_placeholder>"


def expand_to_square(image: Any, color: tuple[int, ...]) -> Any:
    """The image centred on a square canvas of ``color`` as wide as its longer side (LLaVA's ``pad``)."""
    from PIL import Image

    width, height = image.size
    if width == height:
        return image
    side = max(width, height)
    canvas = Image.new(image.mode, (side, side), color)
    canvas.paste(image, ((side - width) // 2, (side - height) // 2))
    return canvas


class OriginalLlavaImages(ImagePrompt):
    """One placeholder per image; ``pad`` / square images give (side / patch)² rows (+1 with
    ``cls_patch``), ``anyres`` images NeXT's rows (``llava_next_rows``)."""


    def __init__(self, model_path: Path, config: dict[str, Any], tokenizer: Any) -> None:
        # config.json as written: the defaults multimodal.py fills are transformers' LlavaConfig's
        # (a text_config, image_token_index 32000), which are not this layout's fields
        self.model_path = Path(model_path)
        self.config = json.loads((self.model_path / "config.json").read_text())
        self.placeholder = YI_VL_PLACEHOLDER if is_yi_vl(self.config) else "<image>"
        if len(tokenizer.encode(self.placeholder, add_special_tokens=False)) != 1:
            tokenizer.add_tokens([self.placeholder], special_tokens=True)
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.placeholder)  # the text's, found by expand
        self.fill_id = placeholder_id(self.config)  # the span's, which the engine checks
        vision = tower_config(self.config, self.model_path)
        self.side, self.patch = int(vision["image_size"]), int(vision["patch_size"])
        self._processor = None
        self._tiler = None

    @property
    def processor(self) -> Any:
        """CLIP's image processor for this model, loaded on first use."""
        if self._processor is None:
            from transformers import CLIPImageProcessor

            name = str(self.config["mm_vision_tower"])
            local = [d for d in (self.model_path, tower_path(self.config, self.model_path))
                     if d is not None and (d / "preprocessor_config.json").is_file()]
            if local:
                self._processor = CLIPImageProcessor.from_pretrained(local[0])
            elif name in KNOWN_PROCESSORS:
                self._processor = CLIPImageProcessor(**KNOWN_PROCESSORS[name])
            else:
                self._processor = CLIPImageProcessor.from_pretrained(tower_directory(self.config, self.model_path))
        return self._processor

    @property
    def tiler(self) -> Any:
        """NeXT's image processor on CLIP's settings and the original's canvases (``anyres``)."""
        if self._tiler is None:
            from transformers import LlavaNextImageProcessor

            clip = self.processor
            self._tiler = LlavaNextImageProcessor(
                size={"shortest_edge": self.side}, crop_size={"height": self.side, "width": self.side},
                image_mean=list(clip.image_mean), image_std=list(clip.image_std),
                image_grid_pinpoints=hf_pinpoints(self.config), do_convert_rgb=True)
        return self._tiler

    def _prepare(self, image: Any) -> PreparedImage:
        if uses_anyres(self.config):
            out = self.tiler(images=[image], return_tensors="np")
            pixels, (height, width) = out["pixel_values"][0], (int(v) for v in out["image_sizes"][0])
            rows = llava_next_rows(height, width, hf_pinpoints(self.config), self.side, self.patch, keep_cls=False)
            return PreparedImage(pixels=pixels, grid=(height, width), num_tokens=rows)
        if self.config.get("image_aspect_ratio") == "pad":
            image = expand_to_square(image, tuple(int(c * 255) for c in self.processor.image_mean))
        pixels = self.processor(images=[image], return_tensors="np")["pixel_values"][0]
        rows = (pixels.shape[-2] // self.patch) * (pixels.shape[-1] // self.patch)
        if self.config.get("mm_vision_select_feature", "patch") == "cls_patch":
            rows += 1
        return PreparedImage(pixels=pixels, grid=(), num_tokens=rows)

    def expand(self, ids: list[int], prepared: list[PreparedImage]) -> tuple[list[int], list[ImageInput]]:
        """The base class's expansion at the placeholder token, each span then written with the
        in-vocabulary ``fill_id`` (the added token has no embedding row)."""
        out, images = super().expand(ids, prepared)
        return [self.fill_id if t == self.image_token_id else t for t in out], images
