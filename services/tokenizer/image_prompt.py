"""A vision-language family's way of putting images into a prompt (``ImagePrompt``): its image
processor from transformers, the placeholder text its chat template writes for an image, and the
expansion of each placeholder into the encoder's row count. Each family's subclass lives in its
own module (``llava_images.py``, ...); ``multimodal.VISION_FAMILIES`` names it by architecture.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ...protocol.errors import InvalidRequestError
from ...protocol.multimodal import ImageInput

IMAGE_PART_TYPES = ("image_url", "image")


def image_parts_of(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat message's image parts, in order (none for string content)."""
    content = message.get("content")
    if not isinstance(content, list):
        return []
    return [p for p in content if isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES]


@dataclass(frozen=True)
class PreparedImage:
    """One image after its family's processor: pixels, what else the encoder needs, and how many
    tokens (encoder rows) stand for it in the prompt."""

    pixels: Any  # numpy array
    grid: tuple[int, ...]
    num_tokens: int


class ImagePrompt:
    """A family's way of putting images into a prompt. Subclasses implement ``_prepare``;
    ``placeholder`` is the text one image takes in the rendered chat."""

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
        return [{**m, "content": self._template_content(m["content"], reads_parts)} if image_parts_of(m) else m
                for m in messages]

    def _template_content(self, content: list[dict[str, Any]], reads_parts: bool) -> Any:
        """A message's content parts, images among them, as the template takes them."""
        if reads_parts:
            return [{"type": "image"} if p.get("type") in IMAGE_PART_TYPES else p for p in content]
        n = sum(1 for p in content if p.get("type") in IMAGE_PART_TYPES)
        text = "\n".join(p.get("text", "") for p in content if p.get("type", "text") == "text")
        return self._string_content(n, text)

    def _string_content(self, images: int, text: str) -> str:
        """A message's text with its ``images`` placeholders, for a template that writes strings."""
        return f"{self.placeholder}\n" * images + text

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
