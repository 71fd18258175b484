"""Images in the tokenizer stage: a chat's image parts become pixel data and placeholder tokens.

For a vision-language model the stage finds the chat's ``image_url`` parts (in order), fetches and
decodes each (``images.py``, with the server's limits), runs the family's image processor from
transformers on them, lets the chat template write one placeholder per image (the family's
``<image>`` text: a Jinja template that loops over content parts gets ``{"type": "image"}``
parts, as transformers' processors pass them; any other template gets the placeholders ahead of
the message's text, as LMDeploy and vLLM put them), and expands each placeholder token into as
many tokens as the vision encoder gives that image. The engine writes the encoder's rows over
those tokens' embeddings (``protocol/multimodal.py``).

Preprocessing uses transformers' image processors, which import torch: the tokenizer stage of a
vision-language model holds torch (about 250 MiB more); a text model's stage still does not.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterator
from typing import Any, ClassVar

from ...engine.hf_config import with_defaults
from ...protocol.errors import InvalidRequestError
from ...protocol.multimodal import ImageInput, llava_next_rows
from .images import ImageLimits, check_image_count, resolve_image

IMAGE_PART_TYPES = ("image_url", "image")


def _image_parts(messages: Any) -> Iterator[dict[str, Any]]:
    """The image parts of an OpenAI message list, in order."""
    if not isinstance(messages, list):
        return
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            yield from (p for p in content if isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES)


def image_sources(messages: Any) -> list[Any]:
    """The image parts' sources of an OpenAI message list, in order (an ``image_url`` part's URL;
    an ``image`` part's ``image``, which only ``pipeline()`` sends)."""
    sources = []
    for part in _image_parts(messages):
        if part["type"] == "image":
            sources.append(part.get("image"))
            continue
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str) or not url:
            raise InvalidRequestError('an image_url part needs {"url": "data:image/...;base64,..." or '
                                      '"https://..."}', param="messages")
        sources.append(url)
    return sources


def has_image_parts(messages: Any) -> bool:
    """Whether a message list holds any image part."""
    return next(_image_parts(messages), None) is not None


@dataclass(frozen=True)
class PreparedImage:
    """One image after its family's processor: pixels, what else the encoder needs, and how many
    tokens (encoder rows) stand for it in the prompt."""

    pixels: Any  # numpy array
    grid: tuple[int, ...]
    num_tokens: int


class ImagePrompt:
    """A family's way of putting images into a prompt. Subclasses set ``architectures`` and
    implement ``_prepare``; ``placeholder`` is the text one image takes in the rendered chat."""

    architectures: ClassVar[tuple[str, ...]] = ()
    placeholder: ClassVar[str] = "<image>"

    def __init__(self, model_path: Path, config: dict[str, Any], tokenizer: Any) -> None:
        self.model_path = model_path
        self.config = config
        token = config.get("image_token_index", config.get("image_token_id"))
        if not isinstance(token, int):
            token = tokenizer.convert_tokens_to_ids(self.placeholder)
        self.image_token_id: int = token
        self._processor = None

    @property
    def processor(self) -> Any:
        """The family's image processor from the model directory, loaded on first use."""
        if self._processor is None:
            from transformers import AutoImageProcessor

            self._processor = AutoImageProcessor.from_pretrained(self.model_path)
        return self._processor

    def prepare(self, images: list[Any]) -> list[PreparedImage]:
        """Each (RGB PIL) image processed for the encoder."""
        return [self._prepare(image) for image in images]

    def _prepare(self, image: Any) -> PreparedImage:
        raise NotImplementedError

    def messages_for_template(self, messages: list[dict[str, Any]], reads_parts: bool) -> list[dict[str, Any]]:
        """The chat with each image part as the template can write it: a ``{"type": "image"}`` part
        for a template that loops over parts, else the placeholders ahead of the text."""
        out = []
        for m in messages:
            content = m.get("content")
            if not isinstance(content, list) or not any(
                    isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES for p in content):
                out.append(m)
                continue
            if reads_parts:
                parts = [{"type": "image"} if p.get("type") in IMAGE_PART_TYPES else p for p in content]
                out.append({**m, "content": parts})
                continue
            n = sum(1 for p in content if p.get("type") in IMAGE_PART_TYPES)
            text = "\n".join(p.get("text", "") for p in content if p.get("type", "text") == "text")
            out.append({**m, "content": f"{self.placeholder}\n" * n + text})
        return out

    def expand(self, ids: list[int], prepared: list[PreparedImage]) -> tuple[list[int], list[ImageInput]]:
        """``ids`` with each image's placeholder token repeated ``num_tokens`` times, and the images
        with the spans they fill."""
        at = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(at) != len(prepared):
            raise InvalidRequestError(
                f"the prompt has {len(at)} image placeholders ({self.placeholder!r}) for {len(prepared)} images: "
                f"give one image part per image, and no {self.placeholder!r} in the text", param="messages")
        out: list[int] = []
        images: list[ImageInput] = []
        prev = 0
        for pos, image in zip(at, prepared):
            out.extend(ids[prev:pos])
            pixels = image.pixels
            data = pixels.tobytes()
            images.append(ImageInput(offset=len(out), length=image.num_tokens,
                                     digest=hashlib.sha256(data).hexdigest()[:32], pixels=data,
                                     shape=list(pixels.shape), dtype=str(pixels.dtype), grid=list(image.grid)))
            out.extend([self.image_token_id] * image.num_tokens)
            prev = pos + 1
        out.extend(ids[prev:])
        return out, images


class LlavaImages(ImagePrompt):
    """LLaVA 1.5 (llava-hf layout): one ``<image>`` per image, the CLIP processor's resized and
    centre-cropped square, (side / patch)² encoder rows (+1 with the CLS row kept, ``full``)."""

    architectures = ("LlavaForConditionalGeneration",)

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

    architectures = ("LlavaNextForConditionalGeneration",)

    def _prepare(self, image: Any) -> PreparedImage:
        out = self.processor(images=[image], return_tensors="np")
        pixels, (height, width) = out["pixel_values"][0], (int(v) for v in out["image_sizes"][0])
        vision = self.config.get("vision_config") or {}
        pinpoints = self.config.get("image_grid_pinpoints") or self.processor.image_grid_pinpoints
        rows = llava_next_rows(height, width, pinpoints, int(vision.get("image_size", 336)),
                               int(vision.get("patch_size", 14)),
                               self.config.get("vision_feature_select_strategy", "default") == "full")
        return PreparedImage(pixels=pixels, grid=(height, width), num_tokens=rows)


VISION_FAMILIES: dict[str, type[ImagePrompt]] = {
    arch: cls for cls in (LlavaImages, LlavaNextImages) for arch in cls.architectures}


def image_prompt_for(model_path: Path, tokenizer: Any) -> ImagePrompt | None:
    """The model's ImagePrompt, or None when it takes no images (a text model)."""
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    for arch in config.get("architectures") or ():
        if arch in VISION_FAMILIES:  # the fields a published config leaves out, as the engine reads them
            return VISION_FAMILIES[arch](Path(model_path), with_defaults(config), tokenizer)
    return None


def load_images(sources: list[Any], limits: ImageLimits) -> list[Any]:
    """The sources fetched and decoded under ``limits`` (each refusal a 400 naming the limit)."""
    check_image_count(len(sources), limits)
    return [resolve_image(source, limits) for source in sources]
