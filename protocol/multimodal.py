"""Images on the wire: what the tokenizer stage hands the engine for each image of a request.

The tokenizer stage fetches, decodes and preprocesses an image (CPU work, scaled out) and expands
its placeholder in the prompt to as many tokens as the vision encoder will give it; the engine
runs the vision tower on ``pixels`` at prefill and writes the encoder's rows over the embeddings
of those tokens. Pixels travel as raw bytes with their shape and dtype (no pickle).
"""

from __future__ import annotations

import msgspec

# numpy dtype names the engine accepts for pixel data (numpy has no bfloat16).
PIXEL_DTYPES = ("float32", "float16")


class ImageInput(msgspec.Struct, array_like=True, omit_defaults=True):
    """One preprocessed image of a request.

    ``offset``: the index in the request's ``token_ids`` of the first of the ``length`` tokens the
    image's encoder rows replace (its placeholder, expanded); ``digest``: a hash of ``pixels``,
    which keys the prefix cache (the same placeholder ids with another image are another prompt);
    ``pixels``: the preprocessed pixel values, C order, of ``shape`` and ``dtype`` (a family's
    layout: LLaVA ``[3, H, W]``, tiled families ``[tiles, 3, H, W]``, Qwen2-VL its flattened
    patches); ``grid``: what else the family's encoder needs (Qwen2-VL's ``[t, h, w]`` patch grid,
    LLaVA-NeXT's original ``[height, width]``), empty when nothing.
    """

    offset: int
    length: int
    digest: str
    pixels: bytes
    shape: list[int]
    dtype: str = "float32"
    grid: list[int] = []
