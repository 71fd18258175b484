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

from conveyor.services.tokenizer.images import ImageLimits, resolve_image

if TYPE_CHECKING:
    from PIL.Image import Image

__all__ = ["ImageLimits", "load_image"]


def load_image(image: str | PathLike | bytes | Image, limits: ImageLimits | None = None) -> Image:
    """An RGB PIL image, every pixel loaded, from a path, an http(s) URL, a ``data:image/...;base64,``
    URL, an image file's bytes or a PIL image.

    ``limits``: the pixel, byte and download-time limits (default: the server's defaults, with local
    files allowed); pass ``ImageLimits(allow_local_files=True, max_pixels=...)`` to raise one.
    """
    return resolve_image(image, limits or ImageLimits(allow_local_files=True))
