"""Images on the wire: what the tokenizer stage hands the engine for each image of a request.

The tokenizer stage fetches, decodes and preprocesses an image (CPU work, scaled out) and expands
its placeholder in the prompt to as many tokens as the vision encoder will give it; the engine
runs the vision tower on ``pixels`` at prefill and writes the encoder's rows over the embeddings
of those tokens. Pixels travel as raw bytes with their shape and dtype (no pickle). The geometry
both sides must agree on (how many rows a family's encoder gives an image) is here too.
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


def best_resolution(height: int, width: int, candidates: list) -> tuple[int, int]:
    """LLaVA-NeXT's canvas for an image of ``height`` x ``width``: of the ``image_grid_pinpoints``
    (``[h, w]`` pairs), the one that keeps the most of the image's pixels, then wastes the fewest."""
    best, kept_best, waste_best = None, 0, float("inf")
    for h, w in candidates:
        scale = min(w / width, h / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        waste = w * h - kept
        if kept > kept_best or (kept == kept_best and waste < waste_best):
            best, kept_best, waste_best = (h, w), kept, waste
    return best


def llava_next_layout(height: int, width: int, pinpoints: list, tile: int, patch: int) -> tuple[int, int, int, int]:
    """How LLaVA-NeXT lays out an image of ``height`` x ``width``: (tiles down, tiles across) of
    its canvas, and the patch rows cut from the top and from the bottom of the tiles' grid, or the
    patch columns cut from each side: the canvas padding around the resized image."""
    side = tile // patch
    canvas_h, canvas_w = best_resolution(height, width, pinpoints)
    rows, cols = side * (canvas_h // tile), side * (canvas_w // tile)
    pad_rows = pad_cols = 0
    if width / height > cols / rows:  # wider than the grid: rows of padding above and below
        pad_rows = (rows - int(round(height * (cols / width), 7))) // 2
    else:
        pad_cols = (cols - int(round(width * (rows / height), 7))) // 2
    return canvas_h // tile, canvas_w // tile, pad_rows, pad_cols


def llava_next_rows(height: int, width: int, pinpoints: list, tile: int, patch: int, keep_cls: bool) -> int:
    """Encoder rows LLaVA-NeXT gives an image of ``height`` x ``width``: the whole image resized
    to one ``tile`` (its patches, +1 with the CLS row kept), then the tiles of its canvas as one
    grid of patches with the padding rows or columns cut off, plus one newline row per grid row."""
    side = tile // patch
    down, across, pad_rows, pad_cols = llava_next_layout(height, width, pinpoints, tile, patch)
    rows, cols = side * down - 2 * pad_rows, side * across - 2 * pad_cols
    return side * side + (1 if keep_cls else 0) + rows * cols + rows
