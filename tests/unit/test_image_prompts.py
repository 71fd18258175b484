"""The tokenizer stage's images against transformers' processors: the same token ids (each image's
placeholder expanded to its encoder rows) and the same pixel values, for one image, several, and a
text turn after an image turn; the spans each image fills; the refusals.

The model directory is LLaVA's layout on the default model's tokenizer with an ``<image>`` token
added: config.json (no weights: this stage reads none) and a ``LlavaProcessor`` saved beside it.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest

PIL = pytest.importorskip("PIL.Image")

from conveyor.protocol import GenerateReq, InvalidRequestError, SamplingParams  # noqa: E402
from conveyor.services.tokenizer.images import ImageLimits  # noqa: E402
from conveyor.services.tokenizer.preprocess import Preprocessor  # noqa: E402

# A llava-hf style template: the parts in order, <image> for an image part.
TEMPLATE = ("{% for message in messages %}{% if message['role'] == 'user' %}USER: {% else %}ASSISTANT: {% endif %}"
            "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
            "{% for item in message['content'] %}{% if item['type'] == 'image' %}<image>\n"
            "{% else %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
            "{% if message['role'] == 'user' %} {% else %}{{ eos_token }}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}ASSISTANT:{% endif %}")
SIDE, PATCH = 28, 14


def _save_llava_dir(path: Path, tokenizer_dir: Path, strategy: str = "default") -> None:
    from transformers import AutoTokenizer, CLIPImageProcessor, LlavaProcessor

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_processor = CLIPImageProcessor(size={"shortest_edge": SIDE}, crop_size={"height": SIDE, "width": SIDE})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH,
                               vision_feature_select_strategy=strategy, chat_template=TEMPLATE,
                               num_additional_image_tokens=1)
    processor.save_pretrained(path)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    config = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
              "image_token_index": tokenizer.convert_tokens_to_ids("<image>"),
              "vision_feature_select_strategy": strategy, "vision_feature_layer": -2,
              "vision_config": {"model_type": "clip_vision_model", "image_size": SIDE, "patch_size": PATCH},
              "text_config": {"model_type": "llama", "vocab_size": len(tokenizer)}}
    (path / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module", params=["default", "full"])
def llava_dir(request, smollm2_dir, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp(f"llava-{request.param}")
    _save_llava_dir(path, smollm2_dir, request.param)
    return path


def _png(width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    PIL.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def _url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def _req(messages, **kw) -> GenerateReq:
    return GenerateReq("r", "", SamplingParams(max_new_tokens=4), messages=messages, **kw)


def _reference(path: Path, messages, pngs):
    """transformers' processor on the same chat: (token ids, pixel values)."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    text = processor.apply_chat_template(
        [{**m, "content": [{"type": "image"} if p["type"] == "image_url" else p for p in m["content"]]}
         if isinstance(m["content"], list) else m for m in messages], add_generation_prompt=True)
    images = [PIL.open(io.BytesIO(png)).convert("RGB") for png in pngs]
    out = processor(text=text, images=images or None, return_tensors="np")
    return out["input_ids"][0].tolist(), out.get("pixel_values")


def _chat(pngs: list[bytes], *, second_turn: bool = False):
    parts = [{"type": "image_url", "image_url": {"url": _url(png)}} for png in pngs]
    chat = [{"role": "user", "content": [*parts, {"type": "text", "text": "What is in the picture?"}]}]
    if second_turn:
        chat += [{"role": "assistant", "content": "A cat."}, {"role": "user", "content": "And its colour?"}]
    return chat


@pytest.mark.parametrize("count, second_turn", [(1, False), (3, False), (1, True)],
                         ids=["one image", "three images", "text turn after an image turn"])
def test_ids_and_pixels_match_the_processor(llava_dir, count, second_turn) -> None:
    pngs = [_png(40 + 13 * i, 30 + 7 * i, seed=i) for i in range(count)]
    messages = _chat(pngs, second_turn=second_turn)
    pre = Preprocessor(llava_dir, 4096)
    tokenized = pre.prepare(_req(messages))
    ids, pixels = _reference(llava_dir, messages, pngs)
    assert tokenized.token_ids == ids
    token = pre.image_prompt.image_token_id
    rows = (SIDE // PATCH) ** 2 + (1 if pre.image_prompt.config["vision_feature_select_strategy"] == "full" else 0)
    assert [im.length for im in tokenized.images] == [rows] * count
    for image, expected in zip(tokenized.images, pixels):
        assert tokenized.token_ids[image.offset:image.offset + image.length] == [token] * image.length
        got = np.frombuffer(image.pixels, dtype=image.dtype).reshape(image.shape)
        np.testing.assert_allclose(got, expected, atol=1e-6)
    assert len({im.digest for im in tokenized.images}) == count  # different images, different keys
    # the spans are all the image tokens there are
    assert sum(im.length for im in tokenized.images) == tokenized.token_ids.count(token)


def test_same_image_same_digest(llava_dir) -> None:
    png = _png(50, 50, seed=7)
    pre = Preprocessor(llava_dir, 4096)
    a, b = (pre.prepare(_req(_chat([png]))).images[0] for _ in range(2))
    assert a.digest == b.digest and a.pixels == b.pixels


def test_a_session_turn_with_an_image_shifts_by_the_first_turn(llava_dir) -> None:
    pre = Preprocessor(llava_dir, 4096)
    tokenized = pre.prepare(_req(_chat([_png(30, 30, 1)]), sequence_start=None))
    if tokenized.first_turn_ids is not None:
        shift = len(tokenized.first_turn_ids) - len(tokenized.token_ids)
        image = tokenized.images[0]
        token = pre.image_prompt.image_token_id
        assert tokenized.first_turn_ids[image.offset + shift:image.offset + shift + image.length] == \
            [token] * image.length


def test_refusals(llava_dir, smollm2_dir) -> None:
    pre = Preprocessor(llava_dir, 4096)
    with pytest.raises(InvalidRequestError, match="placeholder"):  # the text writes its own <image>
        pre.prepare(_req([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": _url(_png(30, 30, 0))}},
            {"type": "text", "text": "look: <image>"}]}]))
    with pytest.raises(InvalidRequestError, match="max_images|images"):
        Preprocessor(llava_dir, 4096, image_limits=ImageLimits(max_images=1)).prepare(
            _req(_chat([_png(30, 30, 0), _png(30, 30, 1)])))
    with pytest.raises(InvalidRequestError, match="takes no images"):  # a text model
        Preprocessor(smollm2_dir, 4096).prepare(_req(_chat([_png(30, 30, 0)])))
    with pytest.raises(InvalidRequestError, match="takes no images"):  # render, as the pipeline checks first
        Preprocessor(smollm2_dir, 4096).render(_chat([_png(30, 30, 0)]))
    too_long = Preprocessor(llava_dir, 20)
    with pytest.raises(InvalidRequestError):
        too_long.prepare(_req(_chat([_png(30, 30, 0)] * 2)))


# ---- Qwen2-VL: native resolution, the grid travels with the pixels --------------------------------

@pytest.fixture(scope="module")
def qwen2_vl_dir(smollm2_dir, tmp_path_factory) -> Path:
    from tiny_vlm import save_tiny_qwen2_vl

    path = tmp_path_factory.mktemp("qwen2-vl-prompts")
    save_tiny_qwen2_vl(path, smollm2_dir)
    return path


@pytest.mark.parametrize("sizes, second_turn", [([(90, 37)], False), ([(61, 120), (200, 30)], False),
                                                ([(70, 70)], True)],
                         ids=["one image", "two images", "text turn after an image turn"])
def test_qwen2_vl_ids_pixels_and_grids_match_the_processor(qwen2_vl_dir, sizes, second_turn) -> None:
    from tiny_vlm import qwen2_vl_reference

    pngs = [_png(w, h, seed=i) for i, (w, h) in enumerate(sizes)]
    messages = _chat(pngs, second_turn=second_turn)
    pre = Preprocessor(qwen2_vl_dir, 4096)
    tokenized = pre.prepare(_req(messages))
    template_chat = [{**m, "content": [{"type": "image"} if p["type"] == "image_url" else p for p in m["content"]]}
                     if isinstance(m["content"], list) else m for m in messages]
    ref = qwen2_vl_reference(qwen2_vl_dir, template_chat,
                             [PIL.open(io.BytesIO(png)).convert("RGB") for png in pngs])
    assert tokenized.token_ids == ref["input_ids"][0].tolist()
    assert [im.grid for im in tokenized.images] == ref["image_grid_thw"].tolist()
    got = np.concatenate([np.frombuffer(im.pixels, dtype=im.dtype).reshape(im.shape) for im in tokenized.images])
    np.testing.assert_allclose(got, ref["pixel_values"].numpy(), atol=1e-6)
    token = pre.image_prompt.image_token_id
    for image in tokenized.images:
        assert tokenized.token_ids[image.offset:image.offset + image.length] == [token] * image.length
        assert image.length == np.prod(image.grid) // 4


def test_every_vision_family_names_an_image_prompt_class() -> None:
    """VISION_FAMILIES names modules as strings (a text model's stage never imports them, nor the
    torch some of them reach); each name is a real ImagePrompt class."""
    from conveyor.services.tokenizer.image_prompt import ImagePrompt
    from conveyor.services.tokenizer.multimodal import VISION_FAMILIES, image_prompt_class

    for arch in VISION_FAMILIES:
        assert issubclass(image_prompt_class(arch), ImagePrompt), arch
