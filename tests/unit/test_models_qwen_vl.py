"""Qwen-VL / Qwen-VL-Chat against a plain-torch reference of its published forward.

transformers has no Qwen-VL class (the checkpoint is remote code), so ``VisualReference`` below
is Qwen-VL's ``visual.py`` written out op by op in its own structure (``[L, N, D]`` blocks, the
head-by-head ``in_proj`` of ``VisualAttention``, torch's ``nn.MultiheadAttention`` in the
Resampler, ``get_abs_pos`` resizing both position tables), and the language model is a
transformers ``Qwen2ForCausalLM`` with as many kv heads as heads, the function Qwen (v1)
computes (``tiny_qwen_vl``), fed embeddings spliced as ``modeling_qwen.QWenModel.forward``
splices them: each image's rows over positions ``<img> + 1 .. </img> - 1``. Checked: tower rows
and prefill logits within 1e-4 (float32), greedy tokens through the engine, a config.json with
Qwen/Qwen-VL-Chat's fields building on the meta device, the text Qwen (v1) path without
``visual`` unchanged, the refusals; then the tokenizer stage (``QwenVLImages``): Qwen-VL-Chat's
prompt format, the ``<img>`` spans, the pixels.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_models import assert_close, load_ours
from tiny_qwen_vl import END, PAD, START, TOKENS, VISUAL, qwen_vl_config, save_tiny_qwen_vl
from tiny_vlm import attach_cache, engine_greedy, prefill_logits

from conveyor.engine.model_config import ModelConfig
from conveyor.protocol.errors import InvalidRequestError, UnsupportedModelError
from conveyor.protocol.multimodal import ImageInput

pytestmark = pytest.mark.usefixtures("torch_single_thread")

SIDE = VISUAL["image_size"]


# ---- the reference: Qwen-VL's visual.py, op by op ---------------------------------------------

def get_abs_pos(abs_pos: torch.Tensor, tgt_size: int) -> torch.Tensor:
    """visual.py's get_abs_pos: an L-row table of a square grid resized (bicubic, float32) to a
    grid of ``tgt_size`` cells."""
    src_size, tgt_size = int(math.sqrt(abs_pos.size(0))), int(math.sqrt(tgt_size))
    if src_size == tgt_size:
        return abs_pos
    return F.interpolate(abs_pos.float().reshape(1, src_size, src_size, -1).permute(0, 3, 1, 2),
                         size=(tgt_size, tgt_size), mode="bicubic", align_corners=False,
                         ).permute(0, 2, 3, 1).flatten(0, 2).to(dtype=abs_pos.dtype)


class VisualReference:
    """Qwen-VL's VisionTransformer.forward on a dict of its tensors (names under ``transformer.visual.``)."""

    def __init__(self, tensors: dict[str, torch.Tensor], visual: dict) -> None:
        self.t, self.heads = tensors, visual["heads"]
        out = visual["output_dim"]
        self.pool = torch.nn.MultiheadAttention(out, out // 128)  # the Resampler's, as published
        self.pool.load_state_dict({"in_proj_weight": tensors["attn_pool.attn.in_proj_weight"],
                                   "in_proj_bias": tensors["attn_pool.attn.in_proj_bias"],
                                   "out_proj.weight": tensors["attn_pool.attn.out_proj.weight"],
                                   "out_proj.bias": tensors["attn_pool.attn.out_proj.bias"]})

    def ln(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.t[f"{name}.weight"], self.t[f"{name}.bias"], eps=1e-6)

    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.t[f"{name}.weight"], self.t.get(f"{name}.bias"))

    def visual_attention(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        """VisualAttention.forward (self-attention, no mask): x is [sq, b, h]."""
        sq, b, _ = x.size()
        hn = x.shape[-1] // self.heads
        mixed_x_layer = self.linear(x, f"{prefix}.in_proj").view(sq, b, self.heads, 3 * hn)
        query_layer, key_layer, value_layer = mixed_x_layer.split(hn, dim=-1)
        query_layer = query_layer.reshape(sq, b * self.heads, hn).transpose(0, 1)
        key_layer = key_layer.reshape(sq, b * self.heads, hn).transpose(0, 1)
        q_scaled = query_layer / math.sqrt(hn)
        attention_probs = torch.bmm(q_scaled, key_layer.transpose(-2, -1)).softmax(dim=-1)
        value_layer = value_layer.reshape(sq, b * self.heads, hn).transpose(0, 1)
        context_layer = torch.bmm(attention_probs, value_layer)
        context_layer = context_layer.view(b, self.heads, sq, hn).permute(2, 0, 1, 3).contiguous()
        return self.linear(context_layer.view(sq, b, -1), f"{prefix}.out_proj")

    def resampler(self, x: torch.Tensor) -> torch.Tensor:
        """Resampler.forward: x is [N, L, width]."""
        pos_embed = get_abs_pos(self.t["attn_pool.pos_embed"], x.size(1))
        x = F.linear(x, self.t["attn_pool.kv_proj.weight"])
        x = self.ln(x, "attn_pool.ln_kv").permute(1, 0, 2)
        n = x.shape[1]
        q = self.ln(self.t["attn_pool.query"], "attn_pool.ln_q")
        out = self.pool(q.unsqueeze(1).repeat(1, n, 1) + self.t["attn_pool.pos_embed"].unsqueeze(1),
                        x + pos_embed.unsqueeze(1), x, need_weights=False)[0]
        return out.permute(1, 0, 2)

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """[N, 3, side, side] -> [N, n_queries, output_dim]."""
        x = F.conv2d(x, self.t["conv1.weight"], stride=self.t["conv1.weight"].shape[-1])  # [*, width, grid, grid]
        x = x.reshape(x.shape[0], x.shape[1], -1).permute(0, 2, 1)  # [*, grid ** 2, width]
        x = x + get_abs_pos(self.t["positional_embedding"], x.size(1))
        x = self.ln(x, "ln_pre").permute(1, 0, 2)  # NLD -> LND
        i = 0
        while f"transformer.resblocks.{i}.ln_1.weight" in self.t:
            block = f"transformer.resblocks.{i}"
            x = x + self.visual_attention(self.ln(x, f"{block}.ln_1"), f"{block}.attn")
            h = F.gelu(self.linear(self.ln(x, f"{block}.ln_2"), f"{block}.mlp.c_fc"))
            x = x + self.linear(h, f"{block}.mlp.c_proj")
            i += 1
        x = self.resampler(x.permute(1, 0, 2))  # LND -> NLD
        return self.ln(x, "ln_post") @ self.t["proj"]


def reference_logits(hf, visual: VisualReference, ids: list[int], pixels: torch.Tensor,
                     start: int = START) -> torch.Tensor:
    """QWenModel.forward's splice: the embeddings, each image's rows over [<img> + 1, </img>)
    (``start``: image_start_id, the id of <img>; </img> the next)."""
    ids_t = torch.tensor(ids)
    with torch.no_grad():
        embeds = hf.model.embed_tokens(ids_t).clone()
        images = visual(pixels) if len(pixels) else []
        starts, ends = (ids_t == start).nonzero()[:, 0], (ids_t == start + 1).nonzero()[:, 0]
        for image, a, b in zip(images, starts.tolist(), ends.tolist()):
            embeds[a + 1:b] = image
        return hf(inputs_embeds=embeds[None]).logits[0].float()


def reference_greedy(hf, visual: VisualReference, ids: list[int], pixels: torch.Tensor, n: int,
                     start: int = START) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(int(reference_logits(hf, visual, ids + out, pixels, start)[-1].argmax()))
    return out


# ---- the engine's model against it --------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(the reference language model, the reference tower, the model directory, ours)."""
    path = tmp_path_factory.mktemp("qwen_vl")
    hf, tower = save_tiny_qwen_vl(path, seed=3)
    return hf, VisualReference(tower, VISUAL), path, load_ours(path)


def _pixels(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 3, SIDE, SIDE, generator=torch.Generator().manual_seed(seed))


def _prompt(images: int) -> list[int]:
    """Text, then ``Picture n: <img> pads </img>\\n`` per image, then text (any ids: only the spans matter)."""
    ids = [1, 5, 9]
    for i in range(images):
        ids += [40 + i, START] + [PAD] * TOKENS + [END, 13]
    return ids + [30, 31, 32]


def test_the_config_reads_as_qwen_vl(tiny) -> None:
    _, _, path, ours = tiny
    config = ModelConfig.from_pretrained(path)
    assert (config.architecture, config.text_architecture) == ("QWenVLLMHeadModel", "QWenLMHeadModel")
    assert "visual" not in config.language_model.raw and config.vision["visual"] == VISUAL
    assert type(ours.language_model).__name__ == "QWenLMHeadModel" and ours.image_token_id == PAD


@pytest.mark.parametrize("images", [1, 3])
def test_tower_rows_match_the_reference(tiny, images) -> None:
    _, visual, _, ours = tiny
    pixels = _pixels(images, seed=images)
    with torch.no_grad():
        got = ours.encode_images(pixels, [[]] * images)
    expected = visual(pixels)
    assert len(got) == images and expected.shape == (images, TOKENS, VISUAL["output_dim"])
    for a, b in zip(got, expected):
        assert_close(a, b)


@pytest.mark.parametrize("images", [1, 2])
def test_prefill_logits_match_the_reference(tiny, images) -> None:
    hf, visual, _, ours = tiny
    ids, pixels = _prompt(images), _pixels(images, seed=10 + images)
    attach_cache(ours)
    with torch.no_grad():
        rows = torch.cat(ours.encode_images(pixels))
    got = prefill_logits(ours, ids, rows)
    assert_close(got, reference_logits(hf, visual, ids, pixels))
    # the image rows matter: other pixels, other logits
    with torch.no_grad():
        other = prefill_logits(ours, ids, torch.cat(ours.encode_images(torch.flip(pixels, dims=[-1]))))
    assert (other - got).abs().max() > 1e-2


def _inputs(ids: list[int], pixels: torch.Tensor) -> list[ImageInput]:
    starts = [i for i, t in enumerate(ids) if t == START]
    return [ImageInput(offset=s + 1, length=TOKENS, digest=f"image{k}", pixels=p.numpy().tobytes(),
                       shape=list(p.shape)) for k, (s, p) in enumerate(zip(starts, pixels))]


def test_engine_greedy_tokens_equal_the_reference(tiny) -> None:
    hf, visual, path, _ = tiny
    ids, pixels = _prompt(2), _pixels(2, seed=21)
    got = engine_greedy(path, ids, _inputs(ids, pixels), 6, check_blocks=True)
    assert got == reference_greedy(hf, visual, ids, pixels, 6)


def test_tp2_equals_tp1(tiny) -> None:
    """The tower on each rank, the language model split: tp=2 gives tp=1's greedy tokens."""
    _, _, path, _ = tiny
    ids, pixels = _prompt(2), _pixels(2, seed=22)
    assert engine_greedy(path, ids, _inputs(ids, pixels), 4, tp=2) == engine_greedy(path, ids, _inputs(ids, pixels), 4)


def test_the_warm_up_batch_is_what_the_tower_takes(tiny) -> None:
    ours = tiny[3]
    shape, grids = ours.warmup_images(10)
    assert shape == [10 // TOKENS, 3, SIDE, SIDE] and len(grids) == shape[0]
    with torch.no_grad():
        assert [r.shape[0] for r in ours.encode_images(torch.zeros(shape), grids)] == [TOKENS] * shape[0]


@pytest.mark.parametrize("shape, length, words", [
    ([3, 28, 28], TOKENS, "takes \\[3, 56, 56\\]"),   # pixels of another size
    ([3, SIDE, SIDE], TOKENS - 1, "encoder rows"),       # a span shorter than the image's rows
])
def test_an_image_the_tower_cannot_take_is_a_400_at_admission(tiny, shape, length, words) -> None:
    from tiny_llama import engine

    from conveyor.protocol.sampling import SamplingParams

    path = tiny[2]
    ids = [1, START] + [PAD] * length + [END, 3]
    pixels = np.zeros(shape, dtype=np.float32)
    eng = engine(path)
    try:
        with pytest.raises(InvalidRequestError, match=words):
            eng.add_request(ids, SamplingParams(max_new_tokens=2), images=[
                ImageInput(2, length, "x", pixels.tobytes(), shape)])
        assert not eng.has_work and eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    finally:
        eng.close()


# Qwen/Qwen-VL-Chat's config.json as published.
PUBLISHED = {
    "architectures": ["QWenLMHeadModel"], "attn_dropout_prob": 0.0,
    "auto_map": {"AutoConfig": "configuration_qwen.QWenConfig",
                 "AutoModelForCausalLM": "modeling_qwen.QWenLMHeadModel"},
    "bf16": False, "emb_dropout_prob": 0.0, "fp16": False, "fp32": False, "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 22016, "kv_channels": 128, "layer_norm_epsilon": 1e-06,
    "max_position_embeddings": 8192, "model_type": "qwen", "no_bias": True, "num_attention_heads": 32,
    "num_hidden_layers": 32, "onnx_safe": None, "rotary_emb_base": 10000, "rotary_pct": 1.0,
    "scale_attn_weights": True, "seq_length": 2048, "tie_word_embeddings": False, "tokenizer_type": "QWenTokenizer",
    "torch_dtype": "bfloat16", "transformers_version": "4.31.0", "use_cache": True, "use_dynamic_ntk": True,
    "use_flash_attn": False, "use_logn_attn": True,
    "visual": {"heads": 16, "image_size": 448, "image_start_id": 151857, "layers": 48, "mlp_ratio": 4.9231,
               "output_dim": 4096, "patch_size": 14, "width": 1664},
    "vocab_size": 151936}


def test_the_published_config_builds() -> None:
    from conveyor.engine.models import build_model

    config = ModelConfig.from_dict(PUBLISHED)
    assert (config.architecture, config.text_architecture) == ("QWenVLLMHeadModel", "QWenLMHeadModel")
    assert (config.hidden_size, config.intermediate_size, config.num_layers, config.num_heads, config.vocab_size) == \
        (4096, 11008, 32, 32, 151936)
    assert config.dtype == torch.bfloat16
    model = build_model(config, dtype=torch.bfloat16, device="meta")
    tower = model.visual
    assert model.image_token_id == 151859 and tower.grid == 32
    assert len(tower.transformer.resblocks) == 48
    assert tower.transformer.resblocks[0].mlp.c_fc.weight.shape == (8192, 1664)
    assert tower.transformer.resblocks[0].attn.heads == 16
    assert tower.attn_pool.query.shape == (256, 4096) and tower.attn_pool.attn.heads == 32
    assert tower.attn_pool.kv_proj.weight.shape == (4096, 1664) and tower.positional_embedding.shape == (256, 1664)


def test_text_qwen_without_visual_is_the_text_model() -> None:
    from conveyor.engine.models import build_model

    text = {k: v for k, v in PUBLISHED.items() if k != "visual"}
    config = ModelConfig.from_dict(text)
    assert (config.architecture, config.text_architecture, config.vision) == ("QWenLMHeadModel", None, None)
    assert type(build_model(config, device="meta")).__name__ == "QWenLMHeadModel"


@pytest.mark.parametrize("change, words", [
    ({"output_dim": 128}, "hidden_size"),
    ({"width": None}, "width"),
    ({"image_size": 50}, "multiple"),
], ids=["output_dim", "missing field", "image_size"])
def test_refusals(change, words) -> None:
    from conveyor.engine.models import build_model

    visual = {k: v for k, v in {**VISUAL, **change}.items() if v is not None}
    config = ModelConfig.from_dict(qwen_vl_config(visual))
    with pytest.raises(UnsupportedModelError, match=words):
        build_model(config, dtype=torch.float32, device="meta")


def test_a_quantized_checkpoint_is_refused() -> None:
    from dataclasses import replace

    from conveyor.engine.models import build_model

    config = replace(ModelConfig.from_dict(qwen_vl_config()), quant=object())
    with pytest.raises(UnsupportedModelError, match="quantized"):
        build_model(config, dtype=torch.float32, device="meta")


def test_an_image_of_another_size_is_refused(tiny) -> None:
    with pytest.raises(ValueError, match=f"{SIDE}x{SIDE}"):
        tiny[3].encode_images(torch.zeros(1, 3, 28, 28))


# ---- the tokenizer stage ------------------------------------------------------------------------

IMAGE_TOKENS = ["<img>", "</img>", "<imgpad>"]


@pytest.fixture(scope="module")
def prompt_dir(smollm2_dir, tmp_path_factory) -> Path:
    """A Qwen-VL model directory for the tokenizer stage: config.json (its image ids the added
    tokens') and the default model's tokenizer with <img>, </img>, <imgpad> added and its Jinja
    template removed, so that the built-in template goes by the name (qwen_vl...: Qwen's ChatML)."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("qwen_vl_chat")
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    tokenizer.chat_template = None
    tokenizer.save_pretrained(path)
    for leftover in path.glob("chat_template.*"):
        leftover.unlink()
    start = tokenizer.convert_tokens_to_ids("<img>")
    assert tokenizer.convert_tokens_to_ids(IMAGE_TOKENS) == [start, start + 1, start + 2]
    # no auto_map: transformers would ask whether to run the (absent) remote code while loading the tokenizer
    config = qwen_vl_config({**VISUAL, "image_start_id": start}, vocab_size=len(tokenizer))
    (path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "auto_map"}))
    return path


def _png(width: int, height: int, seed: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def _part(png: bytes) -> dict:
    import base64

    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}}


def _prepare(path: Path, messages: list):
    from conveyor.protocol.messages import GenerateReq
    from conveyor.protocol.sampling import SamplingParams
    from conveyor.services.tokenizer.preprocess import Preprocessor

    pre = Preprocessor(path, 8192)
    return pre, pre.prepare(GenerateReq("r", "", SamplingParams(max_new_tokens=4), messages=messages))


def _transform(png: bytes) -> np.ndarray:
    """Qwen-VL's image_transform as torchvision computes it: Resize((448, 448), BICUBIC) on the PIL
    image, ToTensor (a float / 255), Normalize with CLIP's mean and std."""
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB").resize((SIDE, SIDE), Image.BICUBIC)
    x = torch.from_numpy(np.array(image)).permute(2, 0, 1).float().div(255)
    mean = torch.tensor([0.48145466, 0.4578275, 0.40821073])[:, None, None]
    std = torch.tensor([0.26862954, 0.26130258, 0.27577711])[:, None, None]
    return ((x - mean) / std).numpy()


def test_chat_ids_are_qwen_vl_chats(prompt_dir) -> None:
    """``from_list_format``'s text in Qwen-VL-Chat's ChatML (its default system prompt), each
    image's span ``n_queries`` <imgpad>; a text turn after an image turn; the pixels."""
    pngs = [_png(70, 40, seed=1), _png(30, 90, seed=2)]
    messages = [{"role": "user", "content": [_part(pngs[0]), {"type": "text", "text": "Compare it with"},
                                             _part(pngs[1])]},
                {"role": "assistant", "content": "A cat."}, {"role": "user", "content": "Which is larger?"}]
    pre, tokenized = _prepare(prompt_dir, messages)
    pads = "<imgpad>" * TOKENS
    text = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
            f"Picture 1: <img>{pads}</img>\nCompare it withPicture 2: <img>{pads}</img>\n<|im_end|>\n"
            "<|im_start|>assistant\nA cat.<|im_end|>\n<|im_start|>user\nWhich is larger?<|im_end|>\n"
            "<|im_start|>assistant\n")
    assert tokenized.token_ids == pre.tokenizer.encode(text, add_special_tokens=False)
    pad = pre.image_prompt.image_token_id
    assert pad == pre.tokenizer.convert_tokens_to_ids("<imgpad>")
    for image, png in zip(tokenized.images, pngs):
        assert image.length == TOKENS and tokenized.token_ids[image.offset - 1] == pad - 2
        assert tokenized.token_ids[image.offset:image.offset + TOKENS] == [pad] * TOKENS
        got = np.frombuffer(image.pixels, dtype=image.dtype).reshape(image.shape)
        np.testing.assert_allclose(got, _transform(png), atol=1e-6)


def test_spans_from_qwens_own_tokenizer_become_pads(prompt_dir) -> None:
    """Qwen's tokenizer writes an image's path as byte ids padded with <imgpad> to 256 tokens
    between the tags; the tags with nothing between (a plain tokenizer's) get the pads too."""
    pre, _ = _prepare(prompt_dir, [{"role": "user", "content": "hi"}])
    prompt = pre.image_prompt
    start, end, pad = prompt.start_id, prompt.end_id, prompt.image_token_id
    prepared = prompt.prepare([__import__("PIL.Image").Image.new("RGB", (20, 20))] * 2)
    ids = [7, start, 104, 116, pad, pad, end, 8, start, end, 9]
    out, images = prompt.expand(ids, prepared)
    assert out == [7, start, *[pad] * TOKENS, end, 8, start, *[pad] * TOKENS, end, 9]
    assert [im.offset for im in images] == [2, 5 + TOKENS]
    with pytest.raises(InvalidRequestError, match="<img> tags for 1 images"):
        prompt.expand(ids, prepared[:1])
    with pytest.raises(InvalidRequestError, match="no </img>"):
        prompt.expand([7, start, 5, start, end], prepared)


def test_a_text_qwen_has_no_image_prompt(tmp_path, prompt_dir) -> None:
    from conveyor.services.tokenizer.multimodal import image_prompt_for

    config = json.loads((prompt_dir / "config.json").read_text())
    del config["visual"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert image_prompt_for(tmp_path, None) is None


# ---- end to end: pipeline() with image_url parts ------------------------------------------------

@pytest.fixture(scope="module")
def e2e(tmp_path_factory):
    """pipeline() on a tiny Qwen-VL with a byte-level tokenizer of Qwen's special tokens (ids
    256..261: <img> 259), named so that the built-in Qwen template serves it; the reference
    language model and tower; the tokenizer."""
    from tiny_qwen_vl import save_byte_tokenizer

    from conveyor import pipeline
    from conveyor.engine.config import EngineConfig

    path = tmp_path_factory.mktemp("qwen_vl_chat_e2e")
    # no auto_map: transformers would ask whether to run the (absent) remote code for the tokenizer
    hf, tower = save_tiny_qwen_vl(path, seed=5, vocab_size=262, image_start_id=259, auto_map=None)
    tokenizer = save_byte_tokenizer(path)
    pipe = pipeline(path, backend_config=EngineConfig(device="cpu", dtype="float32", cache_max_entry_count=64,
                                                      block_size=4, max_batch_size=4, max_prefill_token_num=64,
                                                      enable_prefix_caching=True))
    yield pipe, hf, VisualReference(tower, VISUAL), tokenizer
    pipe.close()


def test_pipeline_greedy_equals_the_reference(e2e) -> None:
    """Two images between text, a text turn after an image turn, the same chat again (from the
    prefix cache): the reference's greedy tokens on Qwen-VL-Chat's prompt, written out by hand."""
    from conveyor.messages import GenerationConfig

    pipe, hf, visual, tokenizer = e2e
    gen = GenerationConfig(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    pngs = [_png(70, 40, seed=11), _png(30, 90, seed=12)]
    pixels = torch.from_numpy(np.stack([_transform(png) for png in pngs]))
    pads = "<imgpad>" * TOKENS
    system = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    two = [{"role": "user", "content": [_part(pngs[0]), {"type": "text", "text": "Compare it with"},
                                        _part(pngs[1])]}]
    text = (f"{system}<|im_start|>user\nPicture 1: <img>{pads}</img>\nCompare it withPicture 2: <img>{pads}</img>\n"
            "<|im_end|>\n<|im_start|>assistant\n")
    expected = reference_greedy(hf, visual, tokenizer.encode(text, add_special_tokens=False), pixels, 6, start=259)
    assert pipe(two, gen).token_ids == expected
    again = pipe(two, gen)
    assert again.num_cached_tokens > 0 and again.token_ids == expected
    after = [{"role": "user", "content": [_part(pngs[1]), {"type": "text", "text": "What is it?"}]},
             {"role": "assistant", "content": "A cat."}, {"role": "user", "content": "Its colour?"}]
    text = (f"{system}<|im_start|>user\nPicture 1: <img>{pads}</img>\nWhat is it?<|im_end|>\n<|im_start|>assistant\n"
            "A cat.<|im_end|>\n<|im_start|>user\nIts colour?<|im_end|>\n<|im_start|>assistant\n")
    expected = reference_greedy(hf, visual, tokenizer.encode(text, add_special_tokens=False), pixels[1:], 6,
                                start=259)
    assert pipe(after, gen).token_ids == expected
