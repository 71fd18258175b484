"""A vision-language model end to end against transformers: a tiny random-weight LLaVA (saved by
transformers with its processor, on the default model's tokenizer) through ``pipeline()`` and
through a real server with ``image_url`` parts gives transformers' greedy tokens, for one image,
several images, a text turn after an image turn, and a session; bad images are 400s that leave
the engine serving and no KV block held.
"""

from __future__ import annotations

import base64
import io
import re

import numpy as np
import pytest
import torch

PIL = pytest.importorskip("PIL.Image")

from tiny_vlm import save_tiny_llava  # noqa: E402

from conveyor.engine.config import EngineConfig  # noqa: E402
from conveyor.messages import GenerationConfig  # noqa: E402
from conveyor.protocol import InvalidRequestError  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_single_thread")

NEW = 8


@pytest.fixture(scope="module")
def llava_dir(smollm2_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llava")
    save_tiny_llava(path, smollm2_dir)
    return path


@pytest.fixture(scope="module")
def hf(llava_dir):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(llava_dir, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(llava_dir)


@pytest.fixture(scope="module")
def pipe(llava_dir):
    from conveyor import pipeline

    p = pipeline(llava_dir, backend_config=EngineConfig(device="cpu", dtype="float32", cache_max_entry_count=256,
                                                        block_size=4, max_batch_size=8, max_prefill_token_num=64,
                                                        enable_prefix_caching=True))
    yield p
    p.close()


def _image(seed: int, size=(37, 29)):
    rng = np.random.default_rng(seed)
    return PIL.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def _data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _hf_greedy(hf, messages, images) -> list[int]:
    model, processor = hf
    chat = [{**m, "content": [{"type": "image"} if p.get("type") == "image_url" else p for p in m["content"]]}
            if isinstance(m["content"], list) else m for m in messages]
    text = processor.apply_chat_template(chat, add_generation_prompt=True)
    inputs = processor(text=text, images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def _chat(images, text="Describe the picture.", history=()):
    parts = [{"type": "image_url", "image_url": {"url": _data_url(im)}} for im in images]
    return [*history, {"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def _until_eos(tokens: list[int], eos: list[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i]
    return tokens


CASES = {
    "one image": lambda: ([_image(1)], _chat([_image(1)])),
    "three images": lambda: ([_image(2), _image(3, (20, 50)), _image(4)],
                             _chat([_image(2), _image(3, (20, 50)), _image(4)], "Compare them.")),
    "a text turn after an image turn": lambda: ([_image(5)], [
        *_chat([_image(5)]), {"role": "assistant", "content": "A picture."},
        {"role": "user", "content": [{"type": "text", "text": "What colour is it?"}]}]),
}


@pytest.mark.parametrize("case", CASES, ids=CASES.keys())
def test_pipeline_greedy_equals_transformers(pipe, hf, case) -> None:
    images, messages = CASES[case]()
    got = pipe(messages, GenerationConfig(max_new_tokens=NEW, temperature=0.0, ignore_eos=True))
    assert got.token_ids == _hf_greedy(hf, messages, images)


def test_lmdeploy_tuple_prompts_and_a_batch(pipe, hf) -> None:
    a, b = _image(6), _image(7, (64, 20))
    gen = GenerationConfig(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
    single = pipe(("Describe the picture.", a), gen)
    batch = pipe([("Describe the picture.", a), ("Describe the picture.", [b])], gen)
    expected = _hf_greedy(hf, _chat([a]), [a])
    assert single.token_ids == expected == batch[0].token_ids
    assert batch[1].token_ids == _hf_greedy(hf, _chat([b]), [b])
    # the second time the same image and text come from the prefix cache, and agree
    again = pipe(("Describe the picture.", a), gen)
    assert again.token_ids == expected and again.num_cached_tokens > 0


def test_the_same_text_with_another_image_is_another_answer(pipe, hf) -> None:
    gen = GenerationConfig(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
    first, second = _image(8), _image(9)
    before = pipe(("Describe the picture.", first), gen)
    got = pipe(("Describe the picture.", second), gen)
    expected = _hf_greedy(hf, _chat([second]), [second])
    assert got.token_ids == expected
    assert expected != before.token_ids  # the images tell the answers apart: the cache must not mix them up


def test_a_session_keeps_the_image_turn(pipe, hf) -> None:
    gen = GenerationConfig(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
    image = _image(10)
    session = pipe.chat(("Describe the picture.", image), gen_config=gen)
    first = session.response.token_ids
    assert first == _hf_greedy(hf, _chat([image]), [image])
    session = pipe.chat("And its colour?", session=session, gen_config=gen)
    assert len(session.response.token_ids) == NEW
    session.close()


def test_bad_images_are_refused_and_nothing_is_held(pipe) -> None:
    gen = GenerationConfig(max_new_tokens=2)
    bad = [
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                                      {"type": "text", "text": "x"}]}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}},
                                      {"type": "text", "text": "x"}]}],
    ]
    for messages in bad:
        with pytest.raises(InvalidRequestError):
            pipe(messages, gen)
    assert pipe(("Describe the picture.", _image(11)), gen).finish_reason is not None
    bm = pipe.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@pytest.fixture(scope="module")
def server(llava_dir, tmp_path_factory):
    from conveyor.testing.server_process import ServerProcess

    srv = ServerProcess(llava_dir, "--device", "cpu", "--dtype", "float32", "--cache-max-entry-count", "256",
                        "--cache-block-seq-len", "4", "--session-len", "512", "--max-images-per-request", "3",
                        "--disable-image-fetch", log_dir=tmp_path_factory.mktemp("vlm-server"))
    yield srv
    assert srv.terminate() == 0, srv.log()


def test_server_image_url_parts_equal_transformers(server, llava_dir, hf) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    for images, messages in (CASES["one image"](), CASES["three images"]()):
        done = client.chat.completions.create(model=model, messages=messages, max_tokens=NEW, temperature=0,
                                              extra_body={"ignore_eos": True}, logprobs=False)
        expected = _hf_greedy(hf, messages, images)
        processor = hf[1]
        assert done.choices[0].message.content == processor.tokenizer.decode(expected, skip_special_tokens=True)
    # the server's limits, each a 400 naming it; the server serves on
    four = _chat([_image(i) for i in range(4)])
    remote = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
                                           {"type": "text", "text": "x"}]}]
    local = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}},
                                          {"type": "text", "text": "x"}]}]
    truncated = base64.b64encode(base64.b64decode(_data_url(_image(13)).split(",")[1])[:200]).decode()
    broken = [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "data:image/png;base64," + truncated}}, {"type": "text", "text": "x"}]}]
    for messages, words in ((four, "max-images-per-request|max_images"), (remote, "fetch"),
                            (local, "file"), (broken, "truncated|corrupt|image")):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=model, messages=messages, max_tokens=2)
        assert err.value.status_code == 400
        assert re.search(words, err.value.message, re.I), err.value.message
    done = client.chat.completions.create(model=model, messages=CASES["one image"]()[1], max_tokens=2)
    assert done.choices[0].finish_reason in ("length", "stop")


def test_a_repeated_image_is_not_encoded_again(pipe, hf) -> None:
    """The encoder's rows are kept by digest: the same image after other text (no prefix-cache hit)
    and the same image twice in one step go through the tower once."""
    model = pipe.engine.runner.model
    encoded = []
    original = model.encode_images

    def counting(pixels, grids=None):
        encoded.append(pixels.shape[0])
        return original(pixels, grids)

    def after(text: str, image) -> list[dict]:
        return [{"role": "user", "content": [{"type": "text", "text": text},
                                             {"type": "image_url", "image_url": {"url": _data_url(image)}},
                                             {"type": "text", "text": "Describe it."}]}]

    model.encode_images = counting
    try:
        gen = GenerationConfig(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
        image, other = _image(14), _image(15)
        first = pipe(after("Look:", image), gen)
        assert first.token_ids == _hf_greedy(hf, after("Look:", image), [image]) and encoded == [1]
        prompts = [after("See this one:", image), after("And here:", image), after("Look:", other)]
        got = pipe(prompts, gen)
        for prompt, out, im in zip(prompts, got, (image, image, other)):
            assert out.token_ids == _hf_greedy(hf, prompt, [im])
        assert sum(encoded) == 2  # only the other image was new
    finally:
        model.encode_images = original


# ---- LLaVA-NeXT (1.6): tiles of the canvas that fits each image --------------------------------

@pytest.fixture(scope="module")
def next_model(smollm2_dir, tmp_path_factory):
    from transformers import AutoProcessor, LlavaNextForConditionalGeneration
    from tiny_vlm import save_tiny_llava_next

    from conveyor import pipeline

    path = tmp_path_factory.mktemp("tiny-llava-next")
    save_tiny_llava_next(path, smollm2_dir)
    hf = LlavaNextForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    p = pipeline(path, backend_config=EngineConfig(device="cpu", dtype="float32", cache_max_entry_count=256,
                                                   block_size=4, max_batch_size=8, max_prefill_token_num=64,
                                                   enable_prefix_caching=True))
    yield p, (hf, AutoProcessor.from_pretrained(path))
    p.close()


def test_next_pipeline_greedy_equals_transformers(next_model) -> None:
    pipe, hf = next_model
    gen = GenerationConfig(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
    wide, tall, square = _image(20, (90, 30)), _image(21, (31, 88)), _image(22, (61, 60))
    for images in ([wide], [tall, square]):
        messages = _chat(images)
        assert pipe(messages, gen).token_ids == _hf_greedy(hf, messages, images)


# ---- Qwen2-VL / Qwen2.5-VL: native resolution, multimodal rotary positions ------------------------

@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def qwen_model(request, smollm2_dir, tmp_path_factory):
    from tiny_vlm import save_tiny_qwen2_vl

    from conveyor import pipeline

    path = tmp_path_factory.mktemp(request.param)
    hf = save_tiny_qwen2_vl(path, smollm2_dir, windowed=request.param == "qwen2_5_vl")
    # prefill chunks of 16: the prompts' text is split off from their images
    p = pipeline(path, backend_config=EngineConfig(device="cpu", dtype="float32", cache_max_entry_count=256,
                                                   block_size=4, max_batch_size=8, max_prefill_token_num=16,
                                                   enable_prefix_caching=True))
    yield p, hf, path
    p.close()


def _qwen_greedy(hf, path, messages, images) -> list[int]:
    from tiny_vlm import qwen2_vl_reference

    chat = [{**m, "content": [{"type": "image"} if p.get("type") == "image_url" else p for p in m["content"]]}
            if isinstance(m["content"], list) else m for m in messages]
    inputs = qwen2_vl_reference(path, chat, images)
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=NEW, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_qwen2_vl_pipeline_greedy_equals_transformers(qwen_model) -> None:
    pipe, hf, path = qwen_model
    gen = GenerationConfig(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
    wide, tall = _image(30, (90, 37)), _image(31, (50, 110))
    cases = [[wide, tall], [tall]]
    for images in cases:
        messages = _chat(images, "Compare them.")
        assert pipe(messages, gen).token_ids == _qwen_greedy(hf, path, messages, images)
    # a text turn after an image turn: its positions follow the image's saving
    messages = [*_chat([wide]), {"role": "assistant", "content": "A picture."},
                {"role": "user", "content": [{"type": "text", "text": "What colour is it?"}]}]
    assert pipe(messages, gen).token_ids == _qwen_greedy(hf, path, messages, [wide])
    # the same image again comes from the prefix cache and agrees
    again = pipe(_chat([tall], "Compare them."), gen)
    assert again.num_cached_tokens > 0
    assert again.token_ids == _qwen_greedy(hf, path, _chat([tall], "Compare them."), [tall])


def test_qwen2_vl_server_image_url_parts_equal_transformers(smollm2_dir, tmp_path_factory) -> None:
    """A real server on Qwen2-VL (M-RoPE positions through the ingress, tokenizer and engine
    processes): image_url parts of two sizes, and a text turn after an image turn, answer with
    transformers' greedy tokens."""
    openai = pytest.importorskip("openai")
    from tiny_vlm import save_tiny_qwen2_vl
    from transformers import AutoTokenizer

    from conveyor.testing.server_process import ServerProcess

    path = tmp_path_factory.mktemp("qwen2-vl-server")
    hf = save_tiny_qwen2_vl(path, smollm2_dir)
    tokenizer = AutoTokenizer.from_pretrained(path)
    srv = ServerProcess(path, "--device", "cpu", "--dtype", "float32", "--cache-max-entry-count", "256",
                        "--cache-block-seq-len", "4", "--session-len", "512", "--disable-image-fetch",
                        log_dir=tmp_path_factory.mktemp("qwen2-vl-server-log"))
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        wide, tall = _image(40, (90, 37)), _image(41, (50, 110))
        cases = [([wide, tall], _chat([wide, tall], "Compare them.")),
                 ([tall], [*_chat([tall]), {"role": "assistant", "content": "A picture."},
                           {"role": "user", "content": [{"type": "text", "text": "What colour is it?"}]}])]
        for images, messages in cases:
            done = client.chat.completions.create(model=model, messages=messages, max_tokens=NEW, temperature=0,
                                                  extra_body={"ignore_eos": True})
            expected = _qwen_greedy(hf, path, messages, images)
            assert done.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=True)
    finally:
        assert srv.terminate() == 0, srv.log()
