"""Images inside the engine: the spans of a sequence's tokens that a vision encoder's rows fill.

The tokenizer stage sends each image preprocessed, with the span of placeholder tokens it
fills (``protocol/multimodal.ImageInput``). Here: the engine's checks of those spans, the
prefix cache's extra key of a block (the digests of the images it covers: the same placeholder
ids with another image are another prompt), the scheduler's rule that a chunk never ends inside
an image's span (the image is encoded once, in the step whose chunk covers its end), and the
step's map from input rows to encoder rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from collections.abc import Sequence as Seq

import numpy as np

from ..protocol.errors import InvalidRequestError
from ..protocol.multimodal import PIXEL_DTYPES, ImageInput


def check_images(images: Seq[ImageInput], num_tokens: int, image_token_id: int | None, token_ids: list[int],
                 max_span: int, rows_for: Callable[[list[int], list[int]], int | None] | None = None) -> None:
    """InvalidRequestError unless each image's span lies within the ``num_tokens`` prompt tokens,
    holds only the model's image token, overlaps no other, takes at most ``max_span`` tokens (one
    step's budget: a span is computed in one step), its pixels are the bytes their shape and dtype
    say, and (with ``rows_for``, the model's ``image_rows_for``) its shape and grid are an image
    the tower takes, giving as many rows as the span has tokens. A peer stage may send any value
    the wire types allow; what passes here cannot fail inside a step."""
    if not images:
        return
    if image_token_id is None:
        raise InvalidRequestError("this model takes no images: serve a vision-language model", param="messages")
    end = 0
    for image in sorted(images, key=lambda im: im.offset):
        if image.offset < end or image.length <= 0 or image.offset + image.length > num_tokens:
            raise InvalidRequestError(f"an image's span [{image.offset}, {image.offset + image.length}) is outside "
                                      f"the {num_tokens}-token prompt or overlaps another", param="messages")
        if image.length > max_span:
            raise InvalidRequestError(
                f"an image takes {image.length} tokens, more than one step computes (max_prefill_token_num="
                f"{max_span}): raise max_prefill_token_num or send a smaller image", param="messages")
        if any(t != image_token_id for t in token_ids[image.offset:image.offset + image.length]):
            raise InvalidRequestError("an image's span holds tokens other than the image token", param="messages")
        if image.dtype not in PIXEL_DTYPES or not image.shape or any(d <= 0 for d in image.shape) \
                or len(image.pixels) != math.prod(image.shape) * np.dtype(image.dtype).itemsize:
            raise InvalidRequestError(f"an image's pixels ({len(image.pixels)} bytes) are not a {image.dtype} array "
                                      f"of shape {image.shape}", param="messages")
        if rows_for is not None:
            try:
                rows = rows_for(list(image.shape), list(image.grid))
            except ValueError as exc:
                raise InvalidRequestError(f"an image of shape {image.shape} and grid {image.grid} does not fit this "
                                          f"model's vision tower: {exc}", param="messages") from None
            if rows is not None and rows != image.length:
                raise InvalidRequestError(f"an image of shape {image.shape} and grid {image.grid} gives {rows} "
                                          f"encoder rows but its span is {image.length} tokens", param="messages")
        end = image.offset + image.length


def shifted(images: Seq[ImageInput], by: int) -> list[ImageInput]:
    """The images with their spans moved ``by`` tokens (a session's history before the turn)."""
    if not by:
        return list(images)
    return [ImageInput(im.offset + by, im.length, im.digest, im.pixels, im.shape, im.dtype, im.grid) for im in images]


def block_images(images: Seq[ImageInput], start: int, end: int) -> tuple[str, ...]:
    """The digests of the images whose spans overlap tokens [start, end): a block's extra key."""
    if not images:  # a text prompt's blocks, every time one fills: nothing to scan
        return ()
    return tuple(im.digest for im in images if im.offset < end and start < im.offset + im.length)


def whole_image_chunk(images: Seq[ImageInput], start: int, n: int) -> int:
    """``n`` new tokens from ``start`` adjusted so that the chunk does not end inside an image's
    span: cut before a span that starts inside the chunk, or carried to the end of a span the
    chunk starts in (a prefix-cache hit may end inside one)."""
    end = start + n
    for im in images:
        lo, hi = im.offset, im.offset + im.length
        if lo < end < hi:
            return lo - start if lo > start else hi - start
    return n


def image_rows(images: Seq[ImageInput], start: int, n: int, first_row: int) -> list[tuple[int, int, int, int]]:
    """For a chunk of ``n`` tokens from ``start`` laid at input row ``first_row``: (input row,
    image index, encoder row, rows) of each image span it covers."""
    rows = []
    for index, im in enumerate(images):
        lo, hi = max(im.offset, start), min(im.offset + im.length, start + n)
        if lo < hi:
            rows.append((first_row + lo - start, index, lo - im.offset, hi - lo))
    return rows


# ---- Qwen2-VL's multimodal rotary positions (M-RoPE) ----------------------------------------
# A text token has one position for all three sections; an image's tokens have (temporal, row,
# column) positions starting at the position the image's first token would have had, and the text
# after the image resumes at that start + max(rows, columns): an image of h x w merged rows takes
# h * w tokens but advances the positions by max(h, w). Positions are a function of the token
# index and the images before it, so a recompute, a prefix-cache hit or a session's next turn
# gets the same ones.

def _merged_grid(image: ImageInput, merge: int) -> tuple[int, int, int]:
    t, h, w = image.grid
    return t, h // merge, w // merge


def mrope_delta(images: Seq[ImageInput], upto: int, merge: int) -> int:
    """How far the rotary position of a text token at index ``upto`` (or later, with no image in
    between) lies from its index: what the images ending at or before it saved."""
    delta = 0
    for im in images:
        if im.offset + im.length <= upto:
            t, h, w = _merged_grid(im, merge)
            delta += max(h, w) - t * h * w
    return delta


def mrope_positions(images: Seq[ImageInput], start: int, n: int, merge: int) -> np.ndarray | None:
    """The ``[3, n]`` positions of tokens [start, start + n) when an image token is among them;
    None when none is (each then rotates at its index + ``mrope_delta(images, start, merge)``)."""
    end = start + n
    if not any(im.offset < end and start < im.offset + im.length for im in images):
        return None
    rows = np.tile(np.arange(start, end, dtype=np.int64), (3, 1))
    delta = 0
    for im in sorted(images, key=lambda im: im.offset):
        if im.offset >= end:
            break
        t, h, w = _merged_grid(im, merge)
        first = im.offset + delta
        lo, hi = max(im.offset, start), min(im.offset + im.length, end)
        if lo < hi:
            j = np.arange(lo - im.offset, hi - im.offset)
            rows[:, lo - start:hi - start] = first + np.stack([j // (h * w), j // w % h, j % w])
        shift = max(h, w) - t * h * w
        delta += shift
        rows[:, max(im.offset + im.length, start) - start:] += shift
    return rows
