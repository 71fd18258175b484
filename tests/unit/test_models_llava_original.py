"""The original LLaVA repository's layout (liuhaotian/llava-v1.5 / v1.6: ``LlavaLlamaForCausalLM``)
and Yi-VL against transformers on the same weights (``tiny_llava_original``: tiny llava-hf models
renamed into that layout): float32 image features and prefill logits within 1e-4, greedy tokens
through ``LLMEngine``; Yi-VL's LayerNorm projector against plain torch (transformers has no Yi-VL
class); the tower from a separate directory (1.5), from the checkpoint (1.6), from a folder of the
model's (Yi-VL); the tokenizer stage's ``pad`` image against PIL + CLIPImageProcessor and its
placeholder spans; published configs built on ``meta``; the refusals.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_models import assert_close, load_ours
from tiny_llava_original import save_original_llava
from tiny_vlm import IMAGE_SIZE, NEXT_PINPOINTS, attach_cache, engine_greedy, prefill_logits

from conveyor.engine.model_config import ModelConfig
from conveyor.protocol.errors import UnsupportedModelError
from conveyor.protocol.multimodal import ImageInput

pytestmark = pytest.mark.usefixtures("torch_single_thread")

HF_IMAGE = 127  # the transformers models' image token (vocabulary 128); ours fill spans with 0


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    """kind -> (kind, transformers model, Yi-VL's projector tensors or None, ours, path)."""
    out = {}
    for kind in ("1.5", "1.6", "yi"):
        path = tmp_path_factory.mktemp("original") / kind.replace(".", "_")
        saved = save_original_llava(path, kind, seed=5)
        hf, projector = saved if kind == "yi" else (saved, None)
        out[kind] = (kind, hf, projector, load_ours(path), path)
    return out


@pytest.fixture(params=["1.5", "1.6", "yi"])
def tiny(request, built):
    return built[request.param]


def _pixels(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(seed))


def _next_inputs(height: int, width: int, seed: int):
    from PIL import Image
    from transformers import LlavaNextImageProcessor

    processor = LlavaNextImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                                        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                                        image_grid_pinpoints=NEXT_PINPOINTS)
    rng = np.random.default_rng(seed)
    out = processor(images=[Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))],
                    return_tensors="pt")
    return out["pixel_values"], out["image_sizes"]


def _yi_features(hf, projector: dict, pixels: torch.Tensor) -> torch.Tensor:
    """Yi-VL's features in plain torch: the transformers tower's layer -2 without its CLS row,
    then Linear, LayerNorm, GELU, Linear, LayerNorm (Yi's ``mlp2x_gelu_Norm``)."""
    p = {k.removeprefix("model.mm_projector."): v for k, v in projector.items()}
    with torch.no_grad():
        x = hf.model.vision_tower(pixel_values=pixels, output_hidden_states=True).hidden_states[-2][:, 1:]
        x = F.linear(x, p["0.weight"], p["0.bias"])
        x = F.layer_norm(x, (x.shape[-1],), p["1.weight"], p["1.bias"], eps=1e-5)
        x = F.linear(F.gelu(x), p["3.weight"], p["3.bias"])
        return F.layer_norm(x, (x.shape[-1],), p["4.weight"], p["4.bias"], eps=1e-5)


def _reference_features(kind, hf, projector, pixels, sizes=None) -> list[torch.Tensor]:
    with torch.no_grad():
        if kind == "yi":
            return list(_yi_features(hf, projector, pixels))
        kwargs = {"image_sizes": sizes} if kind == "1.6" else {}
        out = hf.model.get_image_features(pixel_values=pixels, vision_feature_layer=-2,
                                          vision_feature_select_strategy="default", **kwargs)
        return list(getattr(out, "pooler_output", out))


def _inputs(kind: str, seed: int):
    """(pixels, grids, transformers' image_sizes) of one image for ``kind``."""
    if kind == "1.6":
        pixels, sizes = _next_inputs(30, 70, seed)
        return pixels, [sizes[0].tolist()], sizes
    return _pixels(1, seed), None, None


def test_image_features_match(tiny) -> None:
    kind, hf, projector, ours, _ = tiny
    if kind == "1.6":
        for height, width in [(28, 28), (20, 50), (60, 61), (90, 31)]:
            pixels, sizes = _next_inputs(height, width, seed=height + width)
            got = ours.encode_images(pixels, [sizes[0].tolist()])
            assert_close(got[0], _reference_features(kind, hf, projector, pixels, sizes)[0])
        return
    pixels = _pixels(3, seed=2)
    with torch.no_grad():
        got = ours.encode_images(pixels)
    for a, b in zip(got, _reference_features(kind, hf, projector, pixels), strict=True):
        assert_close(a, b)


def _hf_logits(kind, hf, projector, ids: list[int], pixels, sizes, image_token: int = HF_IMAGE) -> torch.Tensor:
    """transformers' logits of ``ids`` (placeholders as ``image_token``); for Yi-VL its language
    model on embeddings with ``_yi_features`` written over the placeholders."""
    ids_t = torch.tensor([ids])
    with torch.no_grad():
        if kind == "yi":
            embeds = hf.get_input_embeddings()(ids_t)
            embeds[ids_t == image_token] = _yi_features(hf, projector, pixels).flatten(0, 1)
            hidden = hf.model.language_model(inputs_embeds=embeds).last_hidden_state
            return hf.lm_head(hidden)[0].float()
        kwargs = {"image_sizes": sizes} if kind == "1.6" else {}
        return hf(input_ids=ids_t, pixel_values=pixels, **kwargs).logits[0].float()


def test_prefill_logits_match(tiny) -> None:
    kind, hf, projector, ours, _ = tiny
    attach_cache(ours)
    pixels, grids, sizes = _inputs(kind, seed=7)
    with torch.no_grad():
        rows = ours.encode_images(pixels, grids)[0]
    text = [1, 5, 9, 17]
    got = prefill_logits(ours, text[:3] + [ours.image_token_id] * len(rows) + text[3:], rows)
    rows = len(rows)
    expected = _hf_logits(kind, hf, projector, text[:3] + [HF_IMAGE] * rows + text[3:], pixels, sizes)
    assert_close(got, expected)


def test_greedy_tokens_through_the_engine_match(tiny) -> None:
    """The checkpoint served by ``LLMEngine`` (tokens in, the image's span of placeholder ids):
    transformers' greedy tokens, each by a full forward of the sequence so far."""
    kind, hf, projector, ours, path = tiny
    pixels, grids, sizes = _inputs(kind, seed=11)
    with torch.no_grad():
        rows = ours.encode_images(pixels, grids)[0].shape[0]
    ids = [1, 5] + [0] * rows + [9, 17, 23]
    image = pixels[0].numpy()
    images = [ImageInput(2, rows, "x", image.tobytes(), list(image.shape), grid=grids[0] if grids else [])]
    got = engine_greedy(path, ids, images, 5, check_blocks=True)
    sequence = [1, 5] + [HF_IMAGE] * rows + [9, 17, 23]
    expected = []
    for _ in range(5):
        expected.append(int(_hf_logits(kind, hf, projector, sequence, pixels, sizes)[-1].argmax()))
        sequence.append(expected[-1])
    assert got == expected


def test_the_tower_loads_from_where_the_layout_keeps_it(tiny) -> None:
    """1.5: from the separate CLIP directory (its post_layernorm and last layer left out); 1.6: from
    the checkpoint, the folder holding only its config; Yi-VL: from the model's ./vit folder."""
    kind, hf, _, ours, path = tiny
    config = json.loads((path / "config.json").read_text())
    tower = Path(config["mm_vision_tower"]) if kind == "1.5" else path / config["mm_vision_tower"]
    assert (tower / "model.safetensors").is_file() == (kind != "1.6")
    hf_tower = getattr(hf.model.vision_tower, "vision_model", hf.model.vision_tower)
    assert torch.equal(ours.vision_tower.vision_model.embeddings.patch_embedding.weight,
                       hf_tower.embeddings.patch_embedding.weight)
    assert len(ours.vision_tower.vision_model.encoder.layers) == 2  # layer -2 of 3


# ---- the tokenizer stage ------------------------------------------------------------------------

def _png(width: int, height: int, seed: int) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def _prepare(path: Path, png: bytes, text: str = "What is in the picture?"):
    from conveyor.protocol import GenerateReq, SamplingParams
    from conveyor.services.tokenizer.chat_template import ChatTemplateConfig
    from conveyor.services.tokenizer.preprocess import Preprocessor

    pre = Preprocessor(path, 4096, ChatTemplateConfig("vicuna"))
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": text}]}]
    return pre, messages, pre.prepare(GenerateReq("r", "", SamplingParams(max_new_tokens=4), messages=messages))


@pytest.fixture(scope="module")
def tokenized_dirs(smollm2_dir, tmp_path_factory):
    """1.5, 1.6 and Yi-VL checkpoints on the default model's tokenizer (no image token in it);
    ``.root`` holds them, ``.models``: kind -> (transformers model, Yi-VL's projector or None)."""
    root = tmp_path_factory.mktemp("original_tok")
    models = {}
    for kind, name in (("1.5", "v15"), ("1.6", "v16"), ("yi", "yi")):
        saved = save_original_llava(root / name, kind, seed=1, tokenizer_dir=smollm2_dir)
        models[kind] = saved if kind == "yi" else (saved, None)
    return SimpleNamespace(root=root, models=models)


@pytest.mark.parametrize("width, height", [(40, 30), (30, 52), (28, 28)])
def test_pad_images_match_pil_expand_and_clip(tokenized_dirs, width, height) -> None:
    from PIL import Image
    from transformers import AutoTokenizer, CLIPImageProcessor

    path = tokenized_dirs.root / "v15"
    png = _png(width, height, seed=width)
    pre, messages, tokenized = _prepare(path, png)
    # the reference: the image centred on a square of the mean colour, then CLIP's processor
    clip = CLIPImageProcessor.from_pretrained(json.loads((path / "config.json").read_text())["mm_vision_tower"])
    image = Image.open(io.BytesIO(png)).convert("RGB")
    side = max(width, height)
    square = Image.new("RGB", (side, side), tuple(int(c * 255) for c in clip.image_mean))
    square.paste(image, ((side - width) // 2, (side - height) // 2))
    expected = clip(images=[square], return_tensors="np")["pixel_values"][0]
    (im,) = tokenized.images
    got = np.frombuffer(im.pixels, dtype=im.dtype).reshape(im.shape)
    np.testing.assert_allclose(got, expected, atol=1e-6)
    if width != height:  # the padding shows: not CLIP's crop of the bare image
        assert np.abs(got - clip(images=[image], return_tensors="np")["pixel_values"][0]).max() > 0.1
    # the span: (28 / 14)² rows of id 0 where the template wrote <image>; the text around as encoded
    assert im.length == 4 and tokenized.token_ids[im.offset:im.offset + im.length] == [0] * 4
    text = pre.render(messages)
    before, after = text.split("<image>")
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenized.token_ids[:im.offset] == tokenizer.encode(before)
    assert tokenized.token_ids[im.offset + im.length:] == tokenizer.encode(after, add_special_tokens=False)


def test_yi_vl_writes_its_placeholder(tokenized_dirs) -> None:
    pre, messages, tokenized = _prepare(tokenized_dirs.root / "yi", _png(40, 30, seed=3))
    assert pre.image_prompt.placeholder == "<image_placeholder>"
    assert "<image_placeholder>\n" in pre.render(messages)
    (im,) = tokenized.images
    assert tokenized.token_ids[im.offset:im.offset + im.length] == [0] * 4


@pytest.mark.parametrize("width, height", [(30, 70), (70, 30), (50, 50)])
def test_anyres_rows_are_the_models(tokenized_dirs, width, height) -> None:
    """1.6: the tokenizer stage's tiles and span length are what the model's features take."""
    path = tokenized_dirs.root / "v16"
    _, _, tokenized = _prepare(path, _png(width, height, seed=height))
    (im,) = tokenized.images
    model = _tokenized_model(path)
    got = torch.from_numpy(np.frombuffer(im.pixels, dtype=im.dtype).reshape(im.shape).copy()).float()
    assert im.grid == [height, width]
    with torch.no_grad():
        assert model.encode_images(got[None], [im.grid])[0].shape[0] == im.length


_MODELS: dict = {}


def _tokenized_model(path: Path):
    if path not in _MODELS:
        _MODELS[path] = load_ours(path)
    return _MODELS[path]


# ---- published configs and refusals -------------------------------------------------------------

_VICUNA_7B = {"bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096,
              "initializer_range": 0.02, "intermediate_size": 11008, "max_position_embeddings": 4096,
              "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32, "pad_token_id": 0,
              "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None, "tie_word_embeddings": False,
              "use_cache": True, "vocab_size": 32000}
_MM = {"mm_hidden_size": 1024, "mm_projector_type": "mlp2x_gelu", "mm_use_im_patch_token": False,
       "mm_use_im_start_end": False, "mm_vision_select_feature": "patch", "mm_vision_select_layer": -2,
       "mm_vision_tower": "openai/clip-vit-large-patch14-336", "use_mm_proj": True, "freeze_mm_mlp_adapter": False,
       "tune_mm_mlp_adapter": False}
# liuhaotian/llava-v1.5-7b, llava-v1.6-vicuna-7b, llava-v1.6-mistral-7b and 01-ai/Yi-VL-6B's config.json
PUBLISHED = {
    "llava-v1.5-7b": {**_VICUNA_7B, **_MM, "_name_or_path": "./checkpoints/vicuna-7b-v1.5",
                      "architectures": ["LlavaLlamaForCausalLM"], "image_aspect_ratio": "pad", "model_type": "llava",
                      "torch_dtype": "float16", "transformers_version": "4.31.0"},
    "llava-v1.6-vicuna-7b": {**_VICUNA_7B, **_MM, "architectures": ["LlavaLlamaForCausalLM"],
                             "image_aspect_ratio": "anyres", "image_crop_resolution": 224,
                             "image_grid_pinpoints": [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]],
                             "image_split_resolution": 224, "mm_patch_merge_type": "spatial_unpad",
                             "mm_vision_tower_lr": 2e-06, "model_type": "llava", "rope_theta": 10000.0,
                             "torch_dtype": "bfloat16", "unfreeze_mm_vision_tower": True},
    "llava-v1.6-mistral-7b": {**_MM, "architectures": ["LlavaMistralForCausalLM"], "bos_token_id": 1,
                              "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
                              "image_aspect_ratio": "anyres",
                              "image_grid_pinpoints": [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]],
                              "max_position_embeddings": 32768, "mm_patch_merge_type": "spatial_unpad",
                              "model_type": "llava_mistral", "num_attention_heads": 32, "num_hidden_layers": 32,
                              "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
                              "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                              "vocab_size": 32000},
    "Yi-VL-6B": {**_VICUNA_7B, **_MM, "architectures": ["LlavaLlamaForCausalLM"], "attention_bias": False,
                 "image_aspect_ratio": "pad", "image_grid_pinpoints": None, "mm_hidden_size": 1280,
                 "mm_projector_type": "mlp2x_gelu_Norm",
                 "mm_vision_tower": "./vit/clip-vit-H-14-laion2B-s32B-b79K-yi-vl-6B-448", "model_type": "llava",
                 "num_key_value_heads": 4, "rope_theta": 5000000.0, "torch_dtype": "bfloat16", "vocab_size": 64000},
}
# Yi-VL-6B's vit/clip-vit-H-14-laion2B-s32B-b79K-yi-vl-6B-448/config.json
_YI_VIT = {"architectures": ["CLIPVisionModel"], "hidden_act": "gelu", "hidden_size": 1280, "image_size": 448,
           "intermediate_size": 5120, "layer_norm_eps": 1e-05, "model_type": "clip_vision_model",
           "num_attention_heads": 16, "num_channels": 3, "num_hidden_layers": 32, "patch_size": 14,
           "projection_dim": 1024}


def _write(path: Path, name: str, **change) -> Path:
    cfg = {**PUBLISHED[name], **change}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    if name == "Yi-VL-6B":
        vit = path / "vit" / "clip-vit-H-14-laion2B-s32B-b79K-yi-vl-6B-448"
        vit.mkdir(parents=True, exist_ok=True)
        (vit / "config.json").write_text(json.dumps(_YI_VIT))
    return path


def _build(path: Path):
    from conveyor.engine.models import build_model

    return build_model(ModelConfig.from_pretrained(path), dtype=torch.float16, device="meta")


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_configs_parse_and_build(tmp_path, name) -> None:
    config = ModelConfig.from_pretrained(_write(tmp_path, name))
    published = PUBLISHED[name]
    assert config.architecture == published["architectures"][0]
    assert config.text_architecture == published["architectures"][0].removeprefix("Llava")
    assert (config.hidden_size, config.num_layers, config.num_kv_heads, config.vocab_size) == (
        4096, 32, published["num_key_value_heads"], published["vocab_size"])
    assert config.rope_theta == published.get("rope_theta", 10000.0)
    model = _build(tmp_path)
    assert model.image_token_id == 0
    tower = model.vision_tower.vision_model
    assert len(tower.encoder.layers) == 31 if name == "Yi-VL-6B" else 23
    assert tower.embeddings.num_positions == (32 * 32 + 1 if name == "Yi-VL-6B" else 24 * 24 + 1)
    shapes = {k: tuple(v.shape) for k, v in model.multi_modal_projector.state_dict().items()}
    if name == "Yi-VL-6B":
        assert shapes == {"0.weight": (4096, 1280), "0.bias": (4096,), "1.weight": (4096,), "1.bias": (4096,),
                          "3.weight": (4096, 4096), "3.bias": (4096,), "4.weight": (4096,), "4.bias": (4096,)}
    else:
        assert shapes == {"0.weight": (4096, 1024), "0.bias": (4096,), "2.weight": (4096, 4096), "2.bias": (4096,)}
    assert hasattr(model, "image_newline") == ("v1.6" in name)
    if "v1.6" in name:  # the original's [width, height] canvases, as [height, width]
        assert model.pinpoints == [[672, 336], [336, 672], [672, 672], [336, 1008], [1008, 336]]


@pytest.mark.parametrize("change, words", [
    ({"mm_projector_type": "identity"}, "mm_projector_type"),
    ({"mm_projector_type": "spatial_pool"}, "mm_projector_type"),
    ({"mm_vision_select_feature": "cls"}, "mm_vision_select_feature"),
    ({"image_aspect_ratio": "anyres_max_9"}, "image_aspect_ratio"),
    ({"image_aspect_ratio": "anyres", "mm_patch_merge_type": "spatial"}, "spatial_unpad"),
    ({"mm_use_im_start_end": True}, "mm_use_im_start_end"),
    ({"mm_hidden_size": 1152}, "mm_hidden_size"),
    ({"mm_vision_tower": "TOWER"}, "CLIP"),
])
def test_refusals(tmp_path, change, words) -> None:
    if change.get("mm_vision_tower") == "TOWER":  # a SigLIP tower in a folder
        (tmp_path / "siglip").mkdir()
        (tmp_path / "siglip" / "config.json").write_text(json.dumps({"model_type": "siglip_vision_model"}))
        change = {"mm_vision_tower": "./siglip"}
    with pytest.raises(UnsupportedModelError, match=words):
        _build(_write(tmp_path, "llava-v1.5-7b", **change))


def test_a_hub_tower_is_known_at_build_and_fetched_at_load(built, tmp_path, monkeypatch) -> None:
    """``mm_vision_tower`` as a hub id (1.5 repos name openai/clip-vit-large-patch14-336): the
    tower's shape from ``KNOWN_TOWERS`` with nothing fetched, its weights from
    ``resolve_model_path`` of the id when the model is loaded."""
    from conveyor.engine import weight_loader
    from conveyor.engine.models import llava_original

    _, _, _, ours, path = built["1.5"]  # the layout with the tower outside the checkpoint
    config = json.loads((path / "config.json").read_text())
    local = Path(config["mm_vision_tower"])
    monkeypatch.setitem(llava_original.KNOWN_TOWERS, "org/tiny-clip",
                        json.loads((local / "config.json").read_text()))
    fetched = []
    monkeypatch.setattr(weight_loader, "resolve_model_path", lambda name, *a, **k: fetched.append(name) or local)
    (tmp_path / "config.json").write_text(json.dumps({**config, "mm_vision_tower": "org/tiny-clip"}))
    (tmp_path / "model.safetensors").symlink_to(path / "model.safetensors")
    _build(tmp_path)  # on meta: nothing fetched
    assert fetched == []
    again = load_ours(tmp_path)
    assert fetched == ["org/tiny-clip"]
    pixels = _pixels(2, seed=4)
    with torch.no_grad():
        assert torch.equal(torch.cat(again.encode_images(pixels)), torch.cat(ours.encode_images(pixels)))


def test_no_tower_anywhere_is_named(built, tmp_path) -> None:
    """1.6's checkpoint without its tower, whose folder holds only its config: refused, named."""
    from safetensors.torch import load_file, save_file

    path = built["1.6"][-1]
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    (tmp_path / "clip").mkdir()
    (tmp_path / "clip" / "config.json").write_text((path / "clip" / "config.json").read_text())
    weights = load_file(str(path / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if "vision_tower" not in k}, str(tmp_path / "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match="no CLIP tower"):
        load_ours(tmp_path)


@pytest.mark.parametrize("kind", ["1.5", "yi"])
def test_an_lmdeploy_script_runs_on_the_original_layout(tokenized_dirs, kind) -> None:
    """LMDeploy's ``pipeline(path, chat_template_config=ChatTemplateConfig('vicuna'))`` with a
    (prompt, image) tuple: transformers' greedy tokens on the same weights, the prompt the template
    writes with the placeholder's rows and the ``pad`` image (the reference built here by hand)."""
    from PIL import Image
    from transformers import AutoTokenizer, CLIPImageProcessor

    from conveyor import ChatTemplateConfig, pipeline
    from conveyor.engine.config import EngineConfig
    from conveyor.messages import GenerationConfig

    path = tokenized_dirs.root / ("v15" if kind == "1.5" else "yi")
    hf, projector = tokenized_dirs.models[kind]
    rng = np.random.default_rng(12)
    image = Image.fromarray(rng.integers(0, 256, (30, 50, 3), dtype=np.uint8))
    pipe = pipeline(str(path), chat_template_config=ChatTemplateConfig("vicuna"),
                    backend_config=EngineConfig(device="cpu", dtype="float32", cache_max_entry_count=64,
                                                block_size=4, max_batch_size=4, max_prefill_token_num=64))
    try:
        got = pipe(("Describe the picture.", image),
                   GenerationConfig(max_new_tokens=5, temperature=0.0, ignore_eos=True)).token_ids
    finally:
        pipe.close()
    placeholder = "<image_placeholder>" if kind == "yi" else "<image>"
    text = ChatTemplateConfig("vicuna").to_template().messages2prompt(
        [{"role": "user", "content": f"{placeholder}\nDescribe the picture."}])
    before, after = text.split(placeholder)
    tokenizer = AutoTokenizer.from_pretrained(path)
    hf_token = hf.config.image_token_id
    ids = tokenizer.encode(before) + [hf_token] * 4 + tokenizer.encode(after, add_special_tokens=False)
    tower = path / json.loads((path / "config.json").read_text())["mm_vision_tower"]
    clip = CLIPImageProcessor.from_pretrained(tower)
    square = Image.new("RGB", (50, 50), tuple(int(c * 255) for c in clip.image_mean))
    square.paste(image, (0, 10))
    pixels = clip(images=[square], return_tensors="pt")["pixel_values"]
    expected = []
    for _ in range(5):
        expected.append(int(_hf_logits(kind, hf, projector, ids, pixels, None, hf_token)[-1].argmax()))
        ids.append(expected[-1])
    assert got == expected


def _original_canvas(width: int, height: int, pinpoints: list) -> tuple[int, int]:
    """The original repository's choice of canvas, its pairs read as (width, height) in list
    order: the most of the image's pixels kept, then the least area wasted; returns (w, h)."""
    best, kept_best, waste_best = None, 0, float("inf")
    for w, h in pinpoints:
        scale = min(w / width, h / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        if kept > kept_best or (kept == kept_best and w * h - kept < waste_best):
            best, kept_best, waste_best = (w, h), kept, w * h - kept
    return best


@pytest.mark.parametrize("width, height", [(100, 100), (336, 336), (500, 300), (300, 500), (1000, 200), (20, 900)])
def test_the_canvas_is_the_originals_ties_included(width, height) -> None:
    """A small square keeps all its pixels on both 2-tile canvases (a tie): the original takes the
    first pair as [width, height] (a tall canvas), transformers' reading of the same list a wide one."""
    from conveyor.engine.models.llava_original import hf_pinpoints
    from conveyor.protocol.multimodal import best_resolution

    pinpoints = PUBLISHED["llava-v1.6-vicuna-7b"]["image_grid_pinpoints"]
    w, h = _original_canvas(width, height, pinpoints)
    assert best_resolution(height, width, hf_pinpoints({"image_grid_pinpoints": pinpoints})) == (h, w)
    if (width, height) == (100, 100):
        assert (w, h) == (336, 672) and best_resolution(height, width, pinpoints) == (336, 672)  # wide, not tall


@pytest.mark.parametrize("projector, shapes", [
    ("linear", {"weight": (4096, 1024), "bias": (4096,)}),
    ("mlp3x_gelu", {"0.weight": (4096, 1024), "0.bias": (4096,), "2.weight": (4096, 4096), "2.bias": (4096,),
                    "4.weight": (4096, 4096), "4.bias": (4096,)}),
])
def test_other_projector_depths_take_the_originals_names(tmp_path, projector, shapes) -> None:
    """``linear`` is a bare Linear (``model.mm_projector.weight``); ``mlp<N>x_gelu`` a Sequential
    with a GELU between Linears (``model.mm_projector.{0,2,4}``)."""
    model = _build(_write(tmp_path, "llava-v1.5-7b", mm_projector_type=projector))
    assert {k: tuple(v.shape) for k, v in model.multi_modal_projector.state_dict().items()} == shapes
