"""Images for ``pipeline()``: ``load_image``, as LMDeploy's ``lmdeploy.vl.load_image``.

    from conveyor import pipeline
    from conveyor.vl import load_image

    image = load_image("https://raw.githubusercontent.com/open-mmlab/mmdeploy/main/tests/data/tiger.jpeg")
    print(pipeline("llava-hf/llava-1.5-7b-hf")(("describe this image", image)).text)

The same reader as the server's tokenizer stage (``services/tokenizer/images.py``), with the
caller's own files allowed. Unlike LMDeploy's, a bad image raises (``InvalidRequestError`` naming
the problem) instead of turning into a blank 32 x 32 picture.
"""

from __future__ import annotations

from os import PathLike
from typing import TYPE_CHECKING

from conveyor.services.tokenizer.images import LOCAL_IMAGE_LIMITS, ImageLimits, resolve_image

if TYPE_CHECKING:
    from PIL.Image import Image

__all__ = ["LOCAL_IMAGE_LIMITS", "ImageLimits", "load_image"]


def load_image(image: str | PathLike | bytes | Image, limits: ImageLimits | None = None) -> Image:
    """An RGB PIL image, every pixel loaded, from a path, an http(s) URL, a ``data:image/...;base64,``
    URL, an image file's bytes or a PIL image.

    ``limits``: the pixel, byte and download-time limits; the default, ``LOCAL_IMAGE_LIMITS``, is
    ``pipeline()``'s: local files allowed, up to Pillow's 89 MP, 1 GiB, 10 s per download.
    """
    return resolve_image(image, limits or LOCAL_IMAGE_LIMITS)
