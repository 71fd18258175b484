"""InternLM-XComposer2 images in a prompt (internlm-xcomposer2-vl-7b, -7b), as its remote code
prepares them.

- Pixels: the image resized to ``img_size`` x ``img_size`` (config.json; 490 for -vl-7b) with
  bicubic filtering, no crop, scaled to [0, 1] and normalized by CLIP's mean and std (the remote
  ``vis_processor``: torchvision's Resize on a PIL image, ToTensor, Normalize): ``[3, side, side]``.
- Rows: ``(side / 14)²`` a picture (1225 at 490), every patch of the tower's last layer.
- The placeholder: ``<ImageHere>``, where the remote ``chat()`` splices an image (its query is
  ``'<ImageHere>' + text``: no separator, which a template that reads strings gets here too). The
  tokenizer lacks it: it is added as one special token, found by ``expand``, and the span written
  with ``<unk>`` (id 0, an in-vocabulary id the engine overwrites and checks: the model's
  ``image_token_id``).

Not reproduced: the remote ``interleav_wrap_chat`` tokenizes the text before and after each image
separately, each part with its own ``<s>``; here the chat is tokenized once, as LMDeploy does
(one ``<s>``, at the start).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ...protocol.multimodal import ImageInput
from .image_prompt import ImagePrompt, PreparedImage

CLIP_MEAN = np.array([0.48145466, 0.4578275, 0.40821073], dtype=np.float32)
CLIP_STD = np.array([0.26862954, 0.26130258, 0.27577711], dtype=np.float32)
PATCH = 14


class XComposer2Images(ImagePrompt):
    placeholder = "<ImageHere>"

    def __init__(self, model_path: Path, config: dict[str, Any], tokenizer: Any) -> None:
        self.model_path = Path(model_path)
        self.config = config
        if len(tokenizer.encode(self.placeholder, add_special_tokens=False)) != 1:
            tokenizer.add_tokens([self.placeholder], special_tokens=True)
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.placeholder)  # the text's, found by expand
        self.fill_id = int(config.get("image_token_id", 0))  # the span's: <unk>, as the model expects
        self.side = int(config.get("img_size", 490))
        self._processor = None

    def _prepare(self, image: Any) -> PreparedImage:
        from PIL import Image

        resized = image.convert("RGB").resize((self.side, self.side), Image.BICUBIC)
        pixels = np.asarray(resized, dtype=np.float32) / np.float32(255)
        pixels = np.ascontiguousarray(((pixels - CLIP_MEAN) / CLIP_STD).transpose(2, 0, 1))
        return PreparedImage(pixels=pixels, grid=(), num_tokens=(self.side // PATCH) ** 2)

    def _string_content(self, images: int, text: str) -> str:
        """A string template gets ``<ImageHere>`` straight before the text (the remote ``chat()``'s
        query), not followed by a newline."""
        return self.placeholder * images + text

    def expand(self, ids: list[int], prepared: list[PreparedImage]) -> tuple[list[int], list[ImageInput]]:
        """The base class's expansion at ``<ImageHere>``, each span then written with ``fill_id``
        (the added token has no embedding row)."""
        out, images = super().expand(ids, prepared)
        return [self.fill_id if t == self.image_token_id else t for t in out], images
