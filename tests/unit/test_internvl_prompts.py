"""InternVL's images in the tokenizer stage: for the -hf layout the same token ids and pixels as
transformers' ``InternVLProcessor`` (GotOcr2's tiles, each ``<IMG_CONTEXT>`` expanded between
``<img>`` and ``</img>``) for one image and several; for the remote-code layout the ids its
``chat()`` builds (``<img>`` + ``<IMG_CONTEXT>`` x 4 rows a tile + ``</img>`` per image, ahead of
the text) and tiles equal to GotOcr2's (the same canvas rule, PIL's bicubic resizes); and both
layouts through ``pipeline()`` (this stage, then the engine) giving transformers' greedy tokens.

The model directories are ``tiny_internvl``'s on the default model's tokenizer with InternVL's
tokens added.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

PIL = pytest.importorskip("PIL.Image")

from test_image_prompts import _chat, _png, _req  # noqa: E402
from tiny_internvl import MAX_TILES, ROWS_PER_TILE, TILE, image_processor, save_remote_internvl  # noqa: E402

from conveyor.services.tokenizer.internvl_images import best_canvas  # noqa: E402
from conveyor.services.tokenizer.preprocess import Preprocessor  # noqa: E402

# (width, height): 1 tile; 2x1 + thumbnail; 1x2 + thumbnail; 5x1 + thumbnail; 2x3 + thumbnail (6 + 1)
SIZES = [(30, 30), (60, 30), (40, 90), (100, 20), (61, 95)]


@pytest.fixture(scope="module")
def hf_dir(smollm2_dir, tmp_path_factory) -> Path:
    from tiny_internvl import save_tiny_internvl

    path = tmp_path_factory.mktemp("internvl-hf")
    save_tiny_internvl(path, tokenizer_dir=smollm2_dir, seed=0)
    return path


@pytest.fixture(scope="module")
def remote_dir(hf_dir, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("internvl-remote")
    save_remote_internvl(hf_dir, path)
    return path


def _images(pngs):
    return [PIL.open(io.BytesIO(png)).convert("RGB") for png in pngs]


def _check_spans(tokenized, token: int, tiles: list[int]) -> None:
    assert [im.length for im in tokenized.images] == [t * ROWS_PER_TILE for t in tiles]
    for image in tokenized.images:
        assert tokenized.token_ids[image.offset:image.offset + image.length] == [token] * image.length
    assert sum(im.length for im in tokenized.images) == tokenized.token_ids.count(token)


@pytest.mark.parametrize("sizes", [SIZES[1:2], SIZES], ids=["one image", "five images"])
def test_hf_ids_and_pixels_match_the_processor(hf_dir, sizes) -> None:
    from tiny_internvl import internvl_processor

    pngs = [_png(w, h, seed=i) for i, (w, h) in enumerate(sizes)]
    messages = _chat(pngs, second_turn=True)
    pre = Preprocessor(hf_dir, 8192)
    tokenized = pre.prepare(_req(messages))
    processor = internvl_processor(hf_dir)
    text = processor.apply_chat_template(
        [{**m, "content": [{"type": "image"} if p["type"] == "image_url" else p for p in m["content"]]}
         if isinstance(m["content"], list) else m for m in messages], add_generation_prompt=True)
    out = processor(text=text, images=_images(pngs), return_tensors="np")
    assert tokenized.token_ids == out["input_ids"][0].tolist()
    token = pre.image_prompt.image_token_id
    tiles = [im.shape[0] for im in tokenized.images]
    _check_spans(tokenized, token, tiles)
    assert len(set(tiles)) > 1 or len(sizes) == 1
    expected = np.split(out["pixel_values"], np.cumsum(tiles)[:-1])
    for image, want in zip(tokenized.images, expected):
        got = np.frombuffer(image.pixels, dtype=image.dtype).reshape(image.shape)
        np.testing.assert_allclose(got, want, atol=1e-6)


def _remote_reference(path: Path, messages, tiles: list[int]) -> list[int]:
    """The remote ``chat()``'s ids: ``<image>\\n`` per image ahead of the question, each replaced
    by ``<img>`` + ``<IMG_CONTEXT>`` x (rows a tile · tiles) + ``</img>``, the chat template over
    strings."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    chat = []
    count = iter(tiles)
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            n = sum(p["type"] == "image_url" for p in content)
            question = "".join(p.get("text", "") for p in content if p["type"] == "text")
            content = "".join(f"<img>{'<IMG_CONTEXT>' * ROWS_PER_TILE * next(count)}</img>\n" for _ in range(n))
            content += question
        chat.append({"role": m["role"], "content": content})
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("sizes", [SIZES[2:3], SIZES], ids=["one image", "five images"])
def test_remote_ids_are_chats_and_tiles_are_gotocr2s(remote_dir, sizes) -> None:
    pngs = [_png(w, h, seed=10 + i) for i, (w, h) in enumerate(sizes)]
    messages = _chat(pngs, second_turn=True)
    pre = Preprocessor(remote_dir, 8192)
    tokenized = pre.prepare(_req(messages))
    tiles = [im.shape[0] for im in tokenized.images]
    assert tokenized.token_ids == _remote_reference(remote_dir, messages, tiles)
    _check_spans(tokenized, pre.image_prompt.image_token_id, tiles)
    reference = image_processor()
    for image, picture in zip(tokenized.images, _images(pngs)):
        want = reference(images=[picture], return_tensors="np")["pixel_values"]
        got = np.frombuffer(image.pixels, dtype=image.dtype).reshape(image.shape)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_the_canvas_rule() -> None:
    """The canvas closest in aspect; on a tie, the larger one while the image covers over half of it."""
    assert best_canvas(448, 448, 448, 1, 12) == (1, 1)
    assert best_canvas(896, 448, 448, 1, 12) == (2, 1)
    assert best_canvas(100, 20, TILE, 1, MAX_TILES) == (5, 1)
    assert best_canvas(600, 400, 448, 1, 12) == (3, 2)
    # up to 2 tiles, 3:2 is as far from 1:1 as from 2:1: the image takes 2 tiles when its area
    # is over half of theirs
    assert best_canvas(600, 400, 448, 1, 2) == (2, 1)
    assert best_canvas(60, 40, 448, 1, 2) == (1, 1)
    assert best_canvas(4000, 100, 448, 1, 6) == (6, 1)  # no canvas wider than max tiles


def test_remote_config_fields_steer_the_tiles(remote_dir) -> None:
    """dynamic_image_size off: one tile, the image resized; use_thumbnail off: no thumbnail;
    max_dynamic_patch: the most canvas tiles."""
    import json

    from transformers import AutoTokenizer

    from conveyor.services.tokenizer.internvl_images import InternVLImages

    config = json.loads((remote_dir / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(remote_dir)
    wide = _images([_png(100, 20, seed=3)])[0]

    def tiles(**change) -> int:
        prompt = InternVLImages(remote_dir, {**config, **change}, tokenizer)
        prepared = prompt.prepare([wide])[0]
        assert prepared.num_tokens == len(prepared.pixels) * ROWS_PER_TILE
        return len(prepared.pixels)

    assert tiles() == 6  # 5 x 1 + thumbnail
    assert tiles(dynamic_image_size=False) == 1
    assert tiles(use_thumbnail=False) == 5
    assert tiles(max_dynamic_patch=2) == 3


def test_a_template_that_writes_the_image_tags_gets_no_second_pair(remote_dir) -> None:
    from conveyor.services.tokenizer.image_prompt import PreparedImage

    pre = Preprocessor(remote_dir, 4096)
    prompt = pre.image_prompt
    start, token, end = prompt.start_id, prompt.image_token_id, prompt.end_id
    image = PreparedImage(pixels=np.zeros((1, 3, TILE, TILE), np.float32), grid=(), num_tokens=ROWS_PER_TILE)
    ids, images = prompt.expand([7, start, token, end, 8, token, 9], [image, image])
    assert ids == [7, start] + [token] * 4 + [end, 8, start] + [token] * 4 + [end, 9]
    assert [im.offset for im in images] == [2, 9]


# ---- end to end: the tokenizer stage and the engine through pipeline() -------------------------

@pytest.mark.parametrize("layout", ["hf", "remote"])
def test_pipeline_greedy_equals_transformers(hf_dir, remote_dir, layout) -> None:
    """Two images of 3 and 1 tiles, then one of 6, through ``pipeline()`` on either layout: the
    greedy tokens of transformers' model on the processor's ids and pixels (the remote layout's
    ids as its ``chat()`` builds them)."""
    import torch
    from tiny_internvl import internvl_processor
    from transformers import InternVLForConditionalGeneration

    from conveyor import pipeline
    from conveyor.engine.config import EngineConfig
    from conveyor.messages import GenerationConfig

    hf = InternVLForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32).eval()
    processor = internvl_processor(hf_dir)
    gen = GenerationConfig(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    pipe = pipeline(hf_dir if layout == "hf" else remote_dir, backend_config=EngineConfig(
        device="cpu", dtype="float32", cache_max_entry_count=256, block_size=4, max_batch_size=4,
        max_prefill_token_num=64))
    try:
        for sizes in ([SIZES[1], SIZES[0]], [SIZES[4]]):
            pngs = [_png(w, h, seed=20 + i) for i, (w, h) in enumerate(sizes)]
            messages = _chat(pngs)
            got = pipe(messages, gen).token_ids
            pixels = processor.image_processor(images=_images(pngs), crop_to_patches=True,
                                               return_tensors="pt")["pixel_values"]
            if layout == "hf":
                chat = [{**m, "content": [{"type": "image"} if p["type"] == "image_url" else p
                                          for p in m["content"]]} for m in messages]
                ids = processor(text=processor.apply_chat_template(chat, add_generation_prompt=True),
                                images=_images(pngs), return_tensors="pt")["input_ids"][0].tolist()
            else:
                tiles = [3 if (w, h) == SIZES[1] else 1 if (w, h) == SIZES[0] else 7 for w, h in sizes]
                ids = _remote_reference(remote_dir, messages, tiles)
            with torch.no_grad():
                out = hf.generate(input_ids=torch.tensor([ids]), pixel_values=pixels, max_new_tokens=6,
                                  do_sample=False, min_new_tokens=6)
            assert got == out[0, len(ids):].tolist()
    finally:
        pipe.close()
