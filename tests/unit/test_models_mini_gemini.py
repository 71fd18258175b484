"""Mini-Gemini (dvlab-research/MGM's ``MGMLlamaForCausalLM``) against references on the same
weights (``tiny_mini_gemini``): transformers' CLIP tower (the tiny LLaVA's) on the aux image
resized as MGM's cli.py resizes it, transformers' ``ConvNextModel`` for the aux tower (timm's
names renamed), the mining written in plain torch after MGM's ``unified_resampler``, the LLaVA
projector and Llama for logits; float32 rows and logits within 1e-4; greedy tokens through
``LLMEngine``; the aux tower read from its open_clip directory; the tokenizer stage's 768-style
image; a published-style MGM-7B config built on ``meta``; the refusals.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from test_models import assert_close, load_ours
from tiny_mini_gemini import AUX_SIZE, save_mini_gemini
from tiny_vlm import IMAGE_SIZE, attach_cache, engine_greedy, prefill_logits

from conveyor.engine.model_config import ModelConfig
from conveyor.protocol.errors import UnsupportedModelError
from conveyor.protocol.multimodal import ImageInput

pytestmark = pytest.mark.usefixtures("torch_single_thread")

HF_IMAGE = 127


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("mgm") / "mgm"
    hf, convnext, uni = save_mini_gemini(path, seed=3)
    return hf, convnext, uni, load_ours(path), path


def _pixels(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 3, AUX_SIZE, AUX_SIZE, generator=torch.Generator().manual_seed(seed))


def _ln_linear(x: torch.Tensor, uni: dict, name: str) -> torch.Tensor:
    x = F.layer_norm(x, x.shape[-1:], uni[f"model.{name}.0.weight"], uni[f"model.{name}.0.bias"])
    return F.linear(x, uni[f"model.{name}.1.weight"], uni[f"model.{name}.1.bias"])


def _reference_features(hf, convnext, uni, pixels: torch.Tensor) -> torch.Tensor:
    """MGM's encode_images for image_grid 1, on transformers' towers and plain torch."""
    with torch.no_grad():
        small = F.interpolate(pixels, size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear", align_corners=False)
        tower = hf.model.vision_tower
        images = tower(small, output_hidden_states=True).hidden_states[-2][:, 1:]
        stages = convnext(pixels, output_hidden_states=True).hidden_states[1:]
        aux = torch.cat([stages[0]] + [F.interpolate(s, size=stages[0].shape[-2:], mode="bilinear",
                                                     align_corners=False) for s in stages[1:]], dim=1)
        # unified_resampler, as published
        patch_num = int(images.shape[1] ** 0.5)
        patch_size = aux.shape[-1] // patch_num
        aux = aux.permute(0, 2, 3, 1)
        aux = aux.reshape(len(aux), patch_num, patch_size, patch_num, patch_size, aux.shape[-1])
        aux = aux.permute(0, 1, 3, 2, 4, 5).reshape(len(aux), patch_num ** 2, patch_size ** 2, aux.shape[-1])
        query = _ln_linear(images, uni, "vlm_uni_query_projector")
        key = _ln_linear(aux, uni, "vlm_uni_aux_projector")
        value = _ln_linear(aux, uni, "vlm_uni_val_projector")
        att = (query[:, :, None] @ (key.transpose(-1, -2) / (key.shape[-1] ** 0.5))).nan_to_num()
        mined = (att.softmax(-1) @ value).mean(2)
        return hf.model.multi_modal_projector(images + mined)


def _hf_logits(hf, ids: list[int], rows: torch.Tensor) -> torch.Tensor:
    ids_t = torch.tensor([ids])
    with torch.no_grad():
        embeds = hf.get_input_embeddings()(ids_t)
        embeds[ids_t == HF_IMAGE] = rows
        return hf.lm_head(hf.model.language_model(inputs_embeds=embeds).last_hidden_state)[0].float()


def test_image_features_match(tiny) -> None:
    hf, convnext, uni, ours, _ = tiny
    pixels = _pixels(2, seed=1)
    with torch.no_grad():
        got = ours.encode_images(pixels)
    expected = _reference_features(hf, convnext, uni, pixels)
    assert len(got) == 2 and got[0].shape == (4, 64)
    for a, b in zip(got, expected, strict=True):
        assert_close(a, b)
    # the mining counts: without it the rows differ
    assert (expected - hf.model.multi_modal_projector(
        hf.model.vision_tower(F.interpolate(pixels, size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear"),
                              output_hidden_states=True).hidden_states[-2][:, 1:])).abs().max() > 1e-2


def test_prefill_logits_and_engine_greedy_match(tiny) -> None:
    hf, convnext, uni, ours, path = tiny
    attach_cache(ours)
    pixels = _pixels(1, seed=7)
    with torch.no_grad():
        rows = ours.encode_images(pixels)[0]
    text = [1, 5, 9, 17]
    got = prefill_logits(ours, text[:3] + [ours.image_token_id] * len(rows) + text[3:], rows)
    reference = _reference_features(hf, convnext, uni, pixels)[0]
    assert_close(got, _hf_logits(hf, text[:3] + [HF_IMAGE] * len(rows) + text[3:], reference))
    ids = [1, 5] + [0] * len(rows) + [9, 17, 23]
    image = pixels[0].numpy()
    images = [ImageInput(2, len(rows), "x", image.tobytes(), list(image.shape))]
    assert ours.image_rows_for(list(image.shape), []) == len(rows)
    tokens = engine_greedy(path, ids, images, 4, check_blocks=True)
    sequence, expected = [1, 5] + [HF_IMAGE] * len(rows) + [9, 17, 23], []
    for _ in range(4):
        expected.append(int(_hf_logits(hf, sequence, reference)[-1].argmax()))
        sequence.append(expected[-1])
    assert tokens == expected


def test_the_aux_tower_loads_from_its_open_clip_directory(tmp_path) -> None:
    """A checkpoint without ``model.vision_tower_aux.*`` reads open_clip's ``visual.trunk.*``."""
    path = tmp_path / "mgm"
    hf, convnext, uni = save_mini_gemini(path, seed=3, aux_in_checkpoint=False)
    ours = load_ours(path)
    pixels = _pixels(1, seed=2)
    with torch.no_grad():
        assert_close(ours.encode_images(pixels)[0], _reference_features(hf, convnext, uni, pixels)[0])
    assert not any(k.startswith("model.vision_tower_aux") for k in load_file(str(path / "model.safetensors")))
    with pytest.raises(ValueError, match="image_size_aux"):  # CLIP's side is not the image's
        ours.image_rows_for([3, IMAGE_SIZE, IMAGE_SIZE], [])


def test_the_tokenizer_stage_sends_the_aux_sized_padded_image(tiny, smollm2_dir, tmp_path) -> None:
    from PIL import Image
    from transformers import AutoTokenizer, CLIPImageProcessor

    from conveyor.services.tokenizer.mini_gemini_images import MiniGeminiImages

    _, _, _, _, path = tiny
    config = json.loads((path / "config.json").read_text())
    prompt = MiniGeminiImages(path, config, AutoTokenizer.from_pretrained(smollm2_dir))
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (30, 50, 3), dtype=np.uint8))
    prepared = prompt._prepare(image)
    assert prepared.num_tokens == (IMAGE_SIZE // 14) ** 2 and prepared.pixels.shape == (3, AUX_SIZE, AUX_SIZE)
    clip = CLIPImageProcessor.from_pretrained(config["mm_vision_tower"])
    square = Image.new("RGB", (50, 50), tuple(int(c * 255) for c in clip.image_mean))
    square.paste(image, (0, 10))
    sized = CLIPImageProcessor(image_mean=clip.image_mean, image_std=clip.image_std,
                               size={"shortest_edge": AUX_SIZE}, crop_size={"height": AUX_SIZE, "width": AUX_SIZE})
    np.testing.assert_allclose(prepared.pixels, sized(images=[square], return_tensors="np")["pixel_values"][0],
                               atol=1e-6)


# ---- a published-style config and refusals -----------------------------------------------------

# YanweiLi/MGM-7B's config.json fields (the MGM repository's training writes them; Vicuna-7B's Llama)
MGM_7B = {"architectures": ["MGMLlamaForCausalLM"], "model_type": "mgm", "bos_token_id": 1, "eos_token_id": 2,
          "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 11008, "max_position_embeddings": 4096,
          "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32, "pad_token_id": 0,
          "rms_norm_eps": 1e-05, "rope_scaling": None, "tie_word_embeddings": False, "vocab_size": 32000,
          "torch_dtype": "bfloat16", "image_aspect_ratio": "pad", "image_global": False, "image_grid": 1,
          "image_grid_pinpoints": None, "image_size_aux": 768, "mm_hidden_size": 1024, "mm_hidden_size_aux": 2880,
          "mm_projector_type": "mlp2x_gelu", "mm_use_im_patch_token": False, "mm_use_im_start_end": False,
          "mm_vision_select_feature": "patch", "mm_vision_select_layer": -2,
          "mm_vision_tower": "model_zoo/OpenAI/clip-vit-large-patch14-336",
          "mm_vision_tower_aux": "model_zoo/OpenAI/openclip-convnext-large-d-320-laion2B-s29B-b131K-ft-soup",
          "optimize_vision_tower": False, "optimize_vision_tower_aux": False, "use_mm_proj": True}


def _build(tmp_path: Path, **change):
    from conveyor.engine.models import build_model

    (tmp_path / "config.json").write_text(json.dumps({**MGM_7B, **change}))
    return build_model(ModelConfig.from_pretrained(tmp_path), dtype=torch.float16, device="meta")


@pytest.mark.parametrize("arch", ["MGMLlamaForCausalLM", "MiniGeminiLlamaForCausalLM"])
def test_a_published_config_parses_and_builds(tmp_path, arch) -> None:
    model = _build(tmp_path, architectures=[arch])
    assert model.config.text_architecture == "LlamaForCausalLM"
    # model_zoo/OpenAI/clip-vit-large-patch14-336 (absent) read as the OpenAI tower: layer -2 of 24
    assert model.original["mm_vision_tower"] == "openai/clip-vit-large-patch14-336"
    assert len(model.vision_tower.vision_model.encoder.layers) == 23
    assert model.image_rows_for([3, 768, 768], []) == 576
    assert model.warmup_images(1200) == ([2, 3, 768, 768], [[], []])
    assert [s.blocks.__len__() for s in model.vision_tower_aux.stages] == [3, 3, 27, 3]
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items() if "vlm_uni" in k}
    assert shapes["vlm_uni_aux_projector.1.weight"] == (1024, 2880)
    assert shapes["vlm_uni_query_projector.1.weight"] == (1024, 1024)
    assert math.prod(model.vision_tower_aux.stem[0].weight.shape) == 192 * 3 * 4 * 4


@pytest.mark.parametrize("change, words", [
    ({"image_grid": 2}, "HD"),
    ({"image_global": True}, "HD"),
    ({"mm_vision_tower_aux": None}, "mm_vision_tower_aux"),
    ({"mm_vision_tower_aux": "model_zoo/eva-clip"}, "aux tower"),
    ({"mm_hidden_size_aux": 1536}, "mm_hidden_size_aux"),
    ({"mm_vision_select_feature": "cls_patch"}, "mm_vision_select_feature"),
    ({"image_size_aux": 770}, "image_size_aux"),
    ({"mm_projector_type": "identity"}, "mm_projector_type"),
])
def test_refusals(tmp_path, change, words) -> None:
    with pytest.raises(UnsupportedModelError, match=words):
        _build(tmp_path, **change)
