"""InternVL 2.5 / 3 images in a prompt: dynamic tiles, each image ``<img>`` + its rows + ``</img>``.

An image becomes the tiles of the canvas (``cols x rows`` tiles of ``side`` pixels, at most
``max_dynamic_patch`` of them) whose aspect ratio is closest to the image's, plus a thumbnail of the
whole when there is more than one tile: pixels ``[tiles, 3, side, side]``, ImageNet-normalized.
Each tile gives ``(side / patch)² · downsample_ratio²`` encoder rows (256 at 448 pixels).

Both layouts' chats put ``<IMG_CONTEXT>`` where an image goes (the ``-hf`` chat templates write
``<IMG_CONTEXT>\\n`` for an image part; a remote-code repository's template reads strings only, so
the placeholders go ahead of the text, as its ``chat()`` puts ``<image>\\n``), and each expands to
``<img>`` + ``<IMG_CONTEXT>`` x rows + ``</img>``: ``InternVLProcessor``'s ids for the ``-hf``
layout, the remote ``chat()``'s for the other.

Pixels: the ``-hf`` layout runs the model directory's image processor (GotOcr2's, with
``crop_to_patches`` on, as ``InternVLProcessor`` calls it); the remote layout has no processor
config, so its tiling is done here as the remote code's ``load_image`` does it (PIL bicubic
resizes, the canvas rule of its ``dynamic_preprocess``), from config.json's ``force_image_size``,
``min_dynamic_patch`` / ``max_dynamic_patch``, ``use_thumbnail`` and ``dynamic_image_size``.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import msgspec
import numpy as np

from ...protocol.multimodal import ImageInput
from .image_prompt import ImagePrompt, PreparedImage

IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


@lru_cache(maxsize=16)
def _canvases(min_tiles: int, max_tiles: int) -> tuple[tuple[int, int], ...]:
    """Every (cols, rows) with min..max tiles, fewest tiles first, in the order the remote code
    tries them (its set, sorted by area: ties keep the set's order, which a tie-break reads)."""
    grids = {(i, j) for n in range(min_tiles, max_tiles + 1) for i in range(1, n + 1) for j in range(1, n + 1)
             if min_tiles <= i * j <= max_tiles}
    return tuple(sorted(grids, key=lambda g: g[0] * g[1]))


def best_canvas(width: int, height: int, side: int, min_tiles: int, max_tiles: int) -> tuple[int, int]:
    """The (cols, rows) whose aspect ratio is closest to the image's; on a tie the later (larger)
    canvas while the image's area exceeds half of it."""
    aspect, area = width / height, width * height
    best, best_diff = (1, 1), float("inf")
    for cols, rows in _canvases(min_tiles, max_tiles):
        diff = abs(aspect - cols / rows)
        if diff < best_diff:
            best, best_diff = (cols, rows), diff
        elif diff == best_diff and area > 0.5 * side * side * cols * rows:
            best = (cols, rows)
    return best


def dynamic_tiles(image: Any, side: int, min_tiles: int, max_tiles: int, thumbnail: bool) -> list[Any]:
    """The (RGB PIL) image as its canvas's tiles, left to right then top to bottom, and the whole
    resized to one tile after them when there are several."""
    from PIL import Image

    cols, rows = best_canvas(image.width, image.height, side, min_tiles, max_tiles)
    canvas = image.resize((cols * side, rows * side), Image.BICUBIC)
    tiles = [canvas.crop((c * side, r * side, (c + 1) * side, (r + 1) * side))
             for r in range(rows) for c in range(cols)]
    if thumbnail and len(tiles) > 1:
        tiles.append(image.resize((side, side), Image.BICUBIC))
    return tiles


def normalized(tiles: list[Any]) -> np.ndarray:
    """PIL tiles -> float32 ``[tiles, 3, side, side]``: /255, then ImageNet mean and std."""
    pixels = np.stack([np.asarray(t.convert("RGB"), dtype=np.float32) for t in tiles]) / np.float32(255)
    return np.ascontiguousarray(((pixels - IMAGENET_MEAN) / IMAGENET_STD).transpose(0, 3, 1, 2))


class InternVLImages(ImagePrompt):
    placeholder = "<IMG_CONTEXT>"

    def __init__(self, model_path, config: dict[str, Any], tokenizer: Any) -> None:
        super().__init__(model_path, config, tokenizer)
        self.start_id = tokenizer.convert_tokens_to_ids("<img>")
        self.end_id = tokenizer.convert_tokens_to_ids("</img>")
        self.remote = "llm_config" in config
        vision = config.get("vision_config") or {}

        def one(value: Any) -> int:
            return int(value[0] if isinstance(value, (list, tuple)) else value)

        self.side = one(config.get("force_image_size") or vision.get("image_size", 448))
        patch = one(vision.get("patch_size", 14))
        ratio = float(config.get("downsample_ratio", 0.5))
        self.rows_per_tile = int(round((self.side // patch) ** 2 * ratio * ratio))

    def _prepare(self, image: Any) -> PreparedImage:
        if self.remote:
            cfg = self.config
            dynamic = cfg.get("dynamic_image_size", True)  # off: one tile, the whole image resized
            tiles = dynamic_tiles(image, self.side, int(cfg.get("min_dynamic_patch", 1)) if dynamic else 1,
                                  int(cfg.get("max_dynamic_patch", 12)) if dynamic else 1,
                                  bool(cfg.get("use_thumbnail", True)))
            pixels = normalized(tiles)
        else:
            pixels = self.processor(images=[image], crop_to_patches=True, return_tensors="np")["pixel_values"]
            pixels = np.ascontiguousarray(pixels, dtype=np.float32)
        return PreparedImage(pixels=pixels, grid=(), num_tokens=len(pixels) * self.rows_per_tile)

    def expand(self, ids: list[int], prepared: list[PreparedImage]) -> tuple[list[int], list[ImageInput]]:
        """Each ``<IMG_CONTEXT>`` repeated to its image's rows, between ``<img>`` and ``</img>`` (kept
        as they are where the template already wrote them)."""
        ids, images = super().expand(ids, prepared)
        out: list[int] = []
        shifted: list[ImageInput] = []
        prev = 0
        for image in images:
            start, end = image.offset, image.offset + image.length
            out.extend(ids[prev:start])
            if not out or out[-1] != self.start_id:
                out.append(self.start_id)
            shifted.append(msgspec.structs.replace(image, offset=len(out)))
            out.extend(ids[start:end])
            if end >= len(ids) or ids[end] != self.end_id:
                out.append(self.end_id)
            prev = end
        out.extend(ids[prev:])
        return out, shifted
