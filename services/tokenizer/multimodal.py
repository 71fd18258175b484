"""Images in the tokenizer stage: a chat's image parts become pixel data and placeholder tokens.

For a vision-language model the stage finds the chat's ``image_url`` parts (in order), fetches and
decodes each (``images.py``, with the server's limits), runs the family's image processor from
transformers on them (its ``ImagePrompt``: ``image_prompt.py``, one module per family), lets the
chat template write one placeholder per image (the family's ``<image>`` text: a Jinja template
that loops over content parts gets ``{"type": "image"}`` parts, as transformers' processors pass
them; any other template gets the placeholders ahead of the message's text, as LMDeploy and vLLM
put them), and expands each placeholder token into as many tokens as the vision encoder gives
that image. The engine writes the encoder's rows over those tokens' embeddings
(``protocol/multimodal.py``).

Preprocessing uses transformers' image processors, which import torch: the tokenizer stage of a
vision-language model holds torch (about 250 MiB more); a text model's stage still does not.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ...engine.hf_config import with_defaults
from ...engine.model_registry import vision_variant
from ...protocol.errors import InvalidRequestError
from .image_prompt import IMAGE_PART_TYPES, ImagePrompt
from .images import ImageLimits, check_image_count, resolve_image


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


# Each vision-language family's ImagePrompt, by config.json's architecture: (its module in this
# package, its class). Named as strings and imported only for a vision model (the engine's model
# registry does the same): some families' modules reach the engine's layers, which import torch,
# and a text model's tokenizer stage must start without it.
VISION_FAMILIES: dict[str, tuple[str, str]] = {
    "LlavaForConditionalGeneration": ("llava_images", "LlavaImages"),
    "LlavaNextForConditionalGeneration": ("llava_images", "LlavaNextImages"),
    "Qwen2VLForConditionalGeneration": ("qwen2_vl_images", "Qwen2VLImages"),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_vl_images", "Qwen2VLImages"),
    "InternVLForConditionalGeneration": ("internvl_images", "InternVLImages"),
    "InternVLChatModel": ("internvl_images", "InternVLImages"),
    "LlavaLlamaForCausalLM": ("llava_original_images", "OriginalLlavaImages"),
    "LlavaMistralForCausalLM": ("llava_original_images", "OriginalLlavaImages"),
    "QWenVLLMHeadModel": ("qwen_vl_images", "QwenVLImages"),
    "MultiModalityCausalLM": ("deepseek_vl_images", "DeepseekVLImages"),
    "InternLMXComposer2ForCausalLM": ("xcomposer2_images", "XComposer2Images"),
    "MGMLlamaForCausalLM": ("mini_gemini_images", "MiniGeminiImages"),
    "MiniGeminiLlamaForCausalLM": ("mini_gemini_images", "MiniGeminiImages"),
}


def image_prompt_class(arch: str) -> type[ImagePrompt]:
    """The ImagePrompt class of a vision-language architecture, its module imported now."""
    module, name = VISION_FAMILIES[arch]
    return getattr(importlib.import_module(f".{module}", __package__), name)


def image_prompt_for(model_path: Path, tokenizer: Any) -> ImagePrompt | None:
    """The model's ImagePrompt, or None when it takes no images (a text model)."""
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    for arch in config.get("architectures") or ():
        arch = vision_variant(arch, config)  # Qwen-VL is published as its language model's QWenLMHeadModel
        if arch in VISION_FAMILIES:  # the fields a published config leaves out, as the engine reads them
            return image_prompt_class(arch)(Path(model_path), with_defaults(config), tokenizer)
    return None


def load_images(sources: list[Any], limits: ImageLimits) -> list[Any]:
    """The sources fetched and decoded under ``limits`` (each refusal a 400 naming the limit)."""
    check_image_count(len(sources), limits)
    return [resolve_image(source, limits) for source in sources]
