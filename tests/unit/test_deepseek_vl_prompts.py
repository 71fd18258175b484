"""DeepSeek-VL's images in the tokenizer stage: the ids ``VLChatProcessor`` builds (each
``<image_placeholder>`` right before the text, several as the README's figure lines, then
repeated to the image's rows: 9 in the tiny model, 576 at the published sizes) and the pixels of
its ``VLMImageProcessor`` (longer side resized bicubic, centred on a square of the mean colour,
/255, normalized), against a reference written here; the settings of a
``preprocessor_config.json``; the published configs' sizes.

The model directory is ``tiny_deepseek_vl``'s hybrid model (96-pixel images) on the default
model's tokenizer with ``<image_placeholder>`` added.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

PIL = pytest.importorskip("PIL.Image")

from test_image_prompts import _chat, _png, _req  # noqa: E402
from test_models_deepseek_vl import PUBLISHED_1_3B, PUBLISHED_7B  # noqa: E402
from tiny_deepseek_vl import HIGH, ROWS, save_tiny_deepseek_vl  # noqa: E402

from conveyor.engine.model_config import ModelConfig  # noqa: E402
from conveyor.services.tokenizer.deepseek_vl_images import tower_sizes  # noqa: E402
from conveyor.services.tokenizer.preprocess import Preprocessor  # noqa: E402

PLACEHOLDER = "<image_placeholder>"
CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
# (width, height): wide, tall, square, and one whose short side falls under min_size (14)
SIZES = [(60, 30), (40, 90), (50, 50), (200, 9)]


def _model_dir(root: Path, smollm2_dir: Path, preprocessor: dict | None = None):
    """(the directory, the model's reference): the model's vocabulary the tokenizer's, its image
    token named by the tokenizer alone, as published."""
    from transformers import AutoTokenizer

    path = root / "model"
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": [PLACEHOLDER]})
    ref = save_tiny_deepseek_vl(path, hybrid=True, seed=0, vocab_size=len(tokenizer),
                                image_token=tokenizer.convert_tokens_to_ids(PLACEHOLDER))
    cfg = json.loads((path / "config.json").read_text())
    del cfg["image_token_id"]  # as published: the tokenizer names it
    (path / "config.json").write_text(json.dumps(cfg))
    tokenizer.save_pretrained(path)
    if preprocessor is not None:
        (path / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    return path, ref


@pytest.fixture(scope="module")
def tiny(smollm2_dir, tmp_path_factory):
    return _model_dir(tmp_path_factory.mktemp("deepseek-vl"), smollm2_dir)


@pytest.fixture(scope="module")
def model_dir(tiny) -> Path:
    return tiny[0]


def _reference_ids(path: Path, messages) -> list[int]:
    """VLChatProcessor's: the placeholders before each message's text (several images as the README's
    "<image_placeholder> is Figure 1." lines), the chat template over
    strings, each placeholder token then repeated to the image's rows."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    chat = []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            n = sum(p["type"] == "image_url" for p in content)
            figures = "".join(f"{PLACEHOLDER} is Figure {i + 1}.\n" for i in range(n)) if n > 1 else PLACEHOLDER
            content = figures + "".join(p.get("text", "") for p in content if p["type"] == "text")
        chat.append({"role": m["role"], "content": content})
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    token = tokenizer.convert_tokens_to_ids(PLACEHOLDER)
    out = []
    for t in tokenizer(text, add_special_tokens=False)["input_ids"]:
        out += [t] * ROWS if t == token else [t]
    return out


def _reference_pixels(png: bytes, side: int, mean=CLIP_MEAN, std=CLIP_STD, normalize: bool = True) -> np.ndarray:
    """VLMImageProcessor.resize + preprocess, step by step."""
    from transformers.image_transforms import normalize as hf_normalize
    from transformers.image_transforms import rescale

    image = PIL.open(io.BytesIO(png)).convert("RGB")
    w, h = image.size
    size = [max(int(h / max(w, h) * side), 14), max(int(w / max(w, h) * side), 14)]
    image = image.resize((size[1], size[0]), PIL.BICUBIC)
    background = (127, 127, 127) if mean is None else tuple(int(x * 255) for x in mean)
    w, h = image.size
    if w != h:
        canvas = PIL.new("RGB", (max(w, h), max(w, h)), background)
        canvas.paste(image, (0, (w - h) // 2) if w > h else ((h - w) // 2, 0))
        image = canvas
    x = rescale(np.asarray(image).transpose(2, 0, 1), 1 / 255, data_format="channels_first",
                input_data_format="channels_first")
    if normalize:
        x = hf_normalize(x, mean, std, data_format="channels_first", input_data_format="channels_first")
    return x


def _got(image) -> np.ndarray:
    return np.frombuffer(image.pixels, dtype=image.dtype).reshape(image.shape)


@pytest.mark.parametrize("count", [1, 3])
def test_ids_and_pixels_match_the_processor(model_dir, count) -> None:
    pngs = [_png(*SIZES[i], seed=i) for i in range(count)]
    messages = _chat(pngs, second_turn=True)
    pre = Preprocessor(model_dir, 8192)
    tokenized = pre.prepare(_req(messages))
    assert tokenized.token_ids == _reference_ids(model_dir, messages)
    token = pre.image_prompt.image_token_id
    # the engine reads the same id from the tokenizer's files (config.json names none)
    assert ModelConfig.from_pretrained(model_dir).vision["image_token_id"] == token
    assert [im.length for im in tokenized.images] == [ROWS] * count
    for image in tokenized.images:
        assert tokenized.token_ids[image.offset:image.offset + image.length] == [token] * ROWS
    for image, png in zip(tokenized.images, pngs):
        assert image.shape == [3, HIGH, HIGH]
        np.testing.assert_allclose(_got(image), _reference_pixels(png, HIGH), atol=1e-5)


def test_pixels_of_every_shape(model_dir) -> None:
    """Wide, tall, square and a sliver (its short side held at min_size) images."""
    pre = Preprocessor(model_dir, 8192)
    pngs = [_png(w, h, seed=20 + i) for i, (w, h) in enumerate(SIZES)]
    tokenized = pre.prepare(_req(_chat(pngs)))
    for image, png in zip(tokenized.images, pngs):
        np.testing.assert_allclose(_got(image), _reference_pixels(png, HIGH), atol=1e-5)


def test_preprocessor_config_settings(smollm2_dir, tmp_path) -> None:
    """No normalization and no mean: the pixels in [0, 1], padded with grey 127."""
    path, _ = _model_dir(tmp_path, smollm2_dir, {"image_processor_type": "VLMImageProcessor", "image_size": HIGH,
                                              "do_normalize": False, "image_mean": None, "min_size": 14})
    png = _png(80, 20, seed=3)
    tokenized = Preprocessor(path, 8192).prepare(_req(_chat([png])))
    got = _got(tokenized.images[0])
    np.testing.assert_allclose(got, _reference_pixels(png, HIGH, mean=None, normalize=False), atol=1e-6)
    np.testing.assert_allclose(got[:, 0, 0], [127 / 255] * 3, atol=1e-6)


def test_published_sizes() -> None:
    """576 rows an image at the published sizes, the hybrid taking 1024-pixel images, SigLIP 384."""
    assert tower_sizes(PUBLISHED_7B) == (1024, 576)
    assert tower_sizes(PUBLISHED_1_3B) == (384, 576)


def test_pipeline_greedy_equals_the_reference(tiny) -> None:
    """One image, then three, through ``pipeline()`` (this stage, then the engine): the reference's
    greedy tokens on VLChatProcessor's ids and VLMImageProcessor's pixels."""
    import torch

    from conveyor import pipeline
    from conveyor.engine.config import EngineConfig
    from conveyor.messages import GenerationConfig

    path, ref = tiny
    gen = GenerationConfig(max_new_tokens=5, temperature=0.0, ignore_eos=True)
    pipe = pipeline(path, backend_config=EngineConfig(device="cpu", dtype="float32", cache_max_entry_count=256,
                                                      block_size=4, max_batch_size=4, max_prefill_token_num=128))
    try:
        for count in (1, 3):
            pngs = [_png(*SIZES[i], seed=30 + i) for i in range(count)]
            messages = _chat(pngs)
            got = pipe(messages, gen).token_ids
            pixels = torch.from_numpy(np.stack([_reference_pixels(png, HIGH) for png in pngs])).float()
            assert got == ref.greedy(_reference_ids(path, messages), pixels, 5)
    finally:
        pipe.close()
