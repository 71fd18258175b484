"""Qwen-VL / Qwen-VL-Chat images in a prompt: ``Picture n: <img>`` + 256 ``<imgpad>`` + ``</img>``.

Qwen-VL-Chat's ``tokenizer.from_list_format`` writes a message's parts in order, each image as
``Picture {n}: <img>{path or URL}</img>\\n`` (n counted from 1 within the message) and each text
as it is; its tokenizer turns the span between ``<img>`` and ``</img>`` into the path's bytes
padded with ``<imgpad>`` to 256 tokens, all of which the model overwrites with the tower's rows.
Here the template gets ``<img></img>`` for each image, and ``expand`` makes whatever lies between
each ``<img>`` / ``</img>`` pair (nothing, with a tokenizer that has the tags as plain special
tokens; 256 ``<imgpad>``, with Qwen's own) exactly ``n_queries`` ``<imgpad>`` tokens: the ids
the model gives the same embeddings.

Pixels: Qwen-VL ships no image processor config; its ``image_transform`` resizes to
``image_size`` squared (PIL bicubic, through torchvision's Resize, aspect ratio not kept), scales
to [0, 1] and normalizes with CLIP's mean and std. Done here with PIL and numpy.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from ...protocol.errors import InvalidRequestError
from ...protocol.multimodal import ImageInput
from .image_prompt import IMAGE_PART_TYPES, ImagePrompt, PreparedImage

CLIP_MEAN = np.array([0.48145466, 0.4578275, 0.40821073], dtype=np.float32)
CLIP_STD = np.array([0.26862954, 0.26130258, 0.27577711], dtype=np.float32)


def qwen_vl_pixels(image: Any, side: int) -> np.ndarray:
    """An (RGB PIL) image as Qwen-VL's float32 ``[3, side, side]`` pixels."""
    from PIL import Image

    pixels = np.asarray(image.convert("RGB").resize((side, side), Image.BICUBIC), dtype=np.float32) / np.float32(255)
    return np.ascontiguousarray(((pixels - CLIP_MEAN) / CLIP_STD).transpose(2, 0, 1))


class QwenVLImages(ImagePrompt):
    placeholder = "<img></img>"

    def __init__(self, model_path, config: dict[str, Any], tokenizer: Any) -> None:
        visual = config.get("visual") or {}
        start = int(visual.get("image_start_id", 151857))
        # <img>, </img>, <imgpad>: consecutive ids in Qwen's tokenizer, as its model code counts them
        self.start_id, self.end_id = start, start + 1
        super().__init__(model_path, {**config, "image_token_id": start + 2}, tokenizer)
        self.side = int(visual.get("image_size", 448))
        self.num_tokens = int(visual.get("n_queries", 256))

    def _prepare(self, image: Any) -> PreparedImage:
        return PreparedImage(pixels=qwen_vl_pixels(image, self.side), grid=(), num_tokens=self.num_tokens)

    def _template_content(self, content: list[dict[str, Any]], reads_parts: bool) -> str:
        """A message with image parts as ``from_list_format``'s string (whatever the template: the
        picture numbering is the model's prompt format, not the template's)."""
        text, pictures = "", 0
        for part in content:
            if part.get("type") in IMAGE_PART_TYPES:
                pictures += 1
                text += f"Picture {pictures}: {self.placeholder}\n"
            elif part.get("type", "text") == "text":
                text += part.get("text", "")
        return text

    def expand(self, ids: list[int], prepared: list[PreparedImage]) -> tuple[list[int], list[ImageInput]]:
        """The span between each ``<img>`` and the ``</img>`` after it as ``num_tokens`` ``<imgpad>``
        tokens, and the images with the spans they fill."""
        starts = [i for i, t in enumerate(ids) if t == self.start_id]
        if len(starts) != len(prepared):
            raise InvalidRequestError(
                f"the prompt has {len(starts)} <img> tags for {len(prepared)} images: give one image part per image, "
                "and no <img> in the text", param="messages")
        out: list[int] = []
        images: list[ImageInput] = []
        prev = 0
        for start, image in zip(starts, prepared):
            end = next((i for i in range(start + 1, len(ids)) if ids[i] in (self.end_id, self.start_id)), None)
            if end is None or ids[end] != self.end_id:
                raise InvalidRequestError("an <img> in the prompt has no </img> after it: leave image tags out of "
                                          "the text", param="messages")
            out.extend(ids[prev:start + 1])
            data = image.pixels.tobytes()
            images.append(ImageInput(offset=len(out), length=image.num_tokens,
                                     digest=hashlib.sha256(data).hexdigest()[:32], pixels=data,
                                     shape=list(image.pixels.shape), dtype=str(image.pixels.dtype)))
            out.extend([self.image_token_id] * image.num_tokens)
            prev = end
        out.extend(ids[prev:])
        return out, images
