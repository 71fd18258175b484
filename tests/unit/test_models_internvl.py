"""InternVL 2.5 / 3 against transformers: tiny random-weight ``InternVLForConditionalGeneration``
models saved with ``save_pretrained`` (``tiny_internvl``), loaded by the engine; float32 image
features and prefill logits within 1e-4 for one image of several tiles and for two images, on a
Qwen2 language model (InternVL3's) with a LayerNorm tower, and a Llama one with an RMSNorm tower
whose q/k are normed, read one layer before the last; the remote-code layout (``InternVLChatModel``,
InternLM2's names for a Llama, as InternVL2.5-8B ships) loading the same numbers; a published
remote config.json parsed; greedy tokens through the engine; the refusals.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_models import assert_close, load_ours
from tiny_internvl import ROWS_PER_TILE, TILE, save_remote_internvl, save_tiny_internvl
from tiny_vlm import attach_cache, engine_greedy, prefill_logits, write_renamed

from conveyor.engine.model_config import ModelConfig
from conveyor.protocol.errors import UnsupportedModelError

pytestmark = pytest.mark.usefixtures("torch_single_thread")

CONFIGS = {
    "internvl3_qwen2": {},
    "llama_rms_qk_norm_layer_-2": {"text": "llama", "feature_layer": -2, "norm_type": "rms_norm",
                                   "use_qk_norm": True, "attention_bias": False},
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory):
    """(transformers' model, ours from the -hf layout, ours from the remote layout)."""
    path = tmp_path_factory.mktemp(request.param)
    hf = save_tiny_internvl(path, seed=3, **CONFIGS[request.param])
    remote = tmp_path_factory.mktemp(f"{request.param}_remote")
    save_remote_internvl(path, remote)
    return hf, load_ours(path), load_ours(remote)


def _pixels(images: int, tiles: int, seed: int) -> torch.Tensor:
    return torch.randn(images, tiles, 3, TILE, TILE, generator=torch.Generator().manual_seed(seed))


def _hf_features(hf, pixels: torch.Tensor) -> torch.Tensor:
    """transformers' rows for [images, tiles, ...] pixels: [images, tiles * rows, hidden]."""
    b, tiles = pixels.shape[:2]
    with torch.no_grad():
        out = hf.model.get_image_features(pixel_values=pixels.flatten(0, 1),
                                          vision_feature_layer=hf.config.vision_feature_layer,
                                          vision_feature_select_strategy="default")
    feats = getattr(out, "pooler_output", out)
    return feats.reshape(b, tiles * feats.shape[1], -1)


@pytest.mark.parametrize("images, tiles", [(1, 1), (1, 3), (2, 5)])
@pytest.mark.parametrize("layout", ["hf", "remote"])
def test_image_features_match(tiny, layout, images, tiles) -> None:
    hf, ours_hf, ours_remote = tiny
    ours = ours_hf if layout == "hf" else ours_remote
    pixels = _pixels(images, tiles, seed=images * 10 + tiles)
    with torch.no_grad():
        got = ours.encode_images(pixels, [[]] * images)
    expected = _hf_features(hf, pixels)
    assert len(got) == images
    for a, b in zip(got, expected):
        assert a.shape[0] == tiles * ROWS_PER_TILE
        assert_close(a, b)


def _prefill_logits(ours, ids: list[int], images: list[torch.Tensor]) -> torch.Tensor:
    """Our logits of one prompt, in one chunk, each image's rows over its placeholders (images of
    different tile counts encoded apart, as the runner batches them)."""
    with torch.no_grad():
        rows = torch.cat([ours.encode_images(p[None], [[]])[0] for p in images])
    return prefill_logits(ours, ids, rows)


@pytest.mark.parametrize("tile_counts", [[3], [2, 5]], ids=["one image of 3 tiles", "two images"])
def test_prefill_logits_match(tiny, tile_counts) -> None:
    hf, ours_hf, ours_remote = tiny
    token = ours_hf.image_token_id
    start, end = 125, 126  # <img>, </img> (any ids: the model reads the spans only)
    images = [_pixels(1, t, seed=7 + t)[0] for t in tile_counts]
    ids = [1, 5, 9]
    for i, tiles in enumerate(images):
        ids += [start] + [token] * (len(tiles) * ROWS_PER_TILE) + [end, 17 + i]
    ids += [30, 31]
    with torch.no_grad():
        expected = hf(input_ids=torch.tensor([ids]), pixel_values=torch.cat(images)).logits[0].float()
    for ours in (ours_hf, ours_remote):
        attach_cache(ours)
        got = _prefill_logits(ours, ids, images)
        assert_close(got, expected)
    # the image rows matter: other pixels, other logits
    other = _prefill_logits(ours_hf, ids, [torch.flip(p, dims=[-1]) for p in images])
    assert (other - got).abs().max() > 1e-2


def test_the_hub_layout_loads(tmp_path) -> None:
    """The -hf repositories' names (``model.vision_tower.*``, ``model.language_model.*``,
    ``lm_head.*``), which transformers 5 saves as 4.x's: the same model."""
    hf_dir, hub = tmp_path / "hf", tmp_path / "hub"
    save_tiny_internvl(hf_dir, seed=8)
    renamed = write_renamed(hf_dir, hub, [("language_model.model.", "model.language_model."),
                                          ("language_model.lm_head.", "lm_head."),
                                          ("vision_tower.", "model.vision_tower."),
                                          ("multi_modal_projector.", "model.multi_modal_projector.")])
    assert any(n.startswith("model.vision_tower.") for n in renamed)
    (hub / "config.json").write_text((hf_dir / "config.json").read_text())
    a, b = load_ours(hf_dir), load_ours(hub)
    pixels = _pixels(1, 3, seed=9)
    with torch.no_grad():
        assert torch.equal(a.encode_images(pixels)[0], b.encode_images(pixels)[0])
    assert torch.equal(a.language_model.lm_head.weight, b.language_model.lm_head.weight)


def test_final_norm_when_not_mean_pooling(tmp_path) -> None:
    """use_mean_pooling false: transformers' last_hidden_state passes the tower's final LayerNorm."""
    hf = save_tiny_internvl(tmp_path, seed=5, use_mean_pooling=False)
    ours = load_ours(tmp_path)
    pixels = _pixels(1, 2, seed=1)
    with torch.no_grad():
        assert_close(ours.encode_images(pixels)[0], _hf_features(hf, pixels)[0])


def test_ps_version_v1_transposes_each_tiles_grid(tmp_path) -> None:
    """v1 checkpoints were trained without the pixel shuffle's last transpose: each tile's 2x2
    grid of rows comes column-major."""
    hf_dir, v1, v2 = tmp_path / "hf", tmp_path / "v1", tmp_path / "v2"
    save_tiny_internvl(hf_dir, seed=2)
    save_remote_internvl(hf_dir, v1, ps_version="v1")
    save_remote_internvl(hf_dir, v2, ps_version="v2")
    pixels = _pixels(1, 2, seed=4)
    with torch.no_grad():
        a, b = load_ours(v1).encode_images(pixels)[0], load_ours(v2).encode_images(pixels)[0]
    side = int(ROWS_PER_TILE ** 0.5)
    b = b.view(2, side, side, -1).transpose(1, 2).reshape(a.shape)
    assert torch.allclose(a, b, atol=1e-6) and not torch.allclose(a, load_ours(v2).encode_images(pixels)[0])


# InternVL2_5-8B's config.json as published (InternViT-300M, InternLM2.5-7B), trimmed of nothing
# the engine reads.
PUBLISHED_REMOTE = {
    "_commit_hash": None, "architectures": ["InternVLChatModel"],
    "auto_map": {"AutoConfig": "configuration_internvl_chat.InternVLChatConfig",
                 "AutoModel": "modeling_internvl_chat.InternVLChatModel",
                 "AutoModelForCausalLM": "modeling_internvl_chat.InternVLChatModel"},
    "downsample_ratio": 0.5, "dynamic_image_size": True, "force_image_size": 448,
    "llm_config": {
        "_name_or_path": "internlm/internlm2_5-7b-chat", "add_cross_attention": False,
        "architectures": ["InternLM2ForCausalLM"], "attn_implementation": "flash_attention_2",
        "auto_map": {"AutoConfig": "configuration_internlm2.InternLM2Config",
                     "AutoModel": "modeling_internlm2.InternLM2ForCausalLM",
                     "AutoModelForCausalLM": "modeling_internlm2.InternLM2ForCausalLM"},
        "bias": False, "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096,
        "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
        "model_type": "internlm2", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
        "pad_token_id": 2, "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 2.0, "type": "dynamic"},
        "rope_theta": 1000000, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_bfloat16": True,
        "use_cache": True, "vocab_size": 92553},
    "max_dynamic_patch": 12, "min_dynamic_patch": 1, "model_type": "internvl_chat", "pad2square": False,
    "ps_version": "v2", "select_layer": -1, "template": "internvl2_5", "torch_dtype": "bfloat16",
    "use_backbone_lora": 0, "use_llm_lora": 0, "use_thumbnail": True,
    "vision_config": {
        "architectures": ["InternVisionModel"], "attention_dropout": 0.0, "drop_path_rate": 0.0, "dropout": 0.0,
        "hidden_act": "gelu", "hidden_size": 1024, "image_size": 448, "initializer_factor": 1.0,
        "initializer_range": 0.02, "intermediate_size": 4096, "layer_norm_eps": 1e-06, "model_type": "intern_vit_6b",
        "norm_type": "layer_norm", "num_attention_heads": 16, "num_channels": 3, "num_hidden_layers": 24,
        "patch_size": 14, "qk_normalization": False, "qkv_bias": True, "torch_dtype": "bfloat16",
        "use_flash_attn": True}}


def test_a_published_remote_config_parses(tmp_path) -> None:
    from conveyor.engine.models import build_model

    (tmp_path / "config.json").write_text(json.dumps(PUBLISHED_REMOTE))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {
        "92544": {"content": "<img>"}, "92545": {"content": "</img>"}, "92546": {"content": "<IMG_CONTEXT>"}}}))
    config = ModelConfig.from_pretrained(tmp_path)
    assert (config.architecture, config.text_architecture) == ("InternVLChatModel", "InternLM2ForCausalLM")
    assert (config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads, config.vocab_size) == \
        (4096, 32, 32, 8, 92553)
    assert config.dtype == torch.bfloat16 and config.rope_theta == 1e6
    assert config.vision["image_token_id"] == 92546
    model = build_model(config, dtype=torch.bfloat16, device="meta")
    assert model.image_token_id == 92546
    assert len(model.vision_tower.encoder.layer) == 24 and model.shuffle == 2 and not model.ps_v1
    assert model.multi_modal_projector.linear_1.weight.shape == (4096, 4096)


def _remote_dir(tmp_path: Path, **change) -> Path:
    hf_dir, path = tmp_path / "hf", tmp_path / "remote"
    save_tiny_internvl(hf_dir, seed=1)
    save_remote_internvl(hf_dir, path)
    cfg = json.loads((path / "config.json").read_text())
    for key, value in change.items():
        if isinstance(value, dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("change, words", [
    ({"force_image_size": 56}, "force_image_size"),
    ({"ps_version": "v3"}, "ps_version"),
    ({"llm_config": {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}}, "language model"),
])
def test_remote_refusals(tmp_path, change, words) -> None:
    from conveyor.engine.models import build_model

    path = _remote_dir(tmp_path, **change)
    with pytest.raises(UnsupportedModelError, match=words):
        build_model(ModelConfig.from_pretrained(path), dtype=torch.float32, device="meta")


def test_a_remote_model_without_its_image_token_is_refused(tmp_path) -> None:
    from conveyor.engine.models import build_model

    path = _remote_dir(tmp_path)
    (path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(UnsupportedModelError, match="IMG_CONTEXT"):
        build_model(ModelConfig.from_pretrained(path), dtype=torch.float32, device="meta")


@pytest.mark.parametrize("change, words", [
    ({"vision_feature_select_strategy": "full"}, "CLS"),
    ({"vision_feature_layer": [-1, -2]}, "one layer"),
    ({"text_config": {"model_type": "gpt2"}}, "language model"),
])
def test_hf_refusals(tmp_path, change, words) -> None:
    from conveyor.engine.models import build_model

    save_tiny_internvl(tmp_path, seed=1)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(change)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match=words):
        build_model(ModelConfig.from_pretrained(tmp_path), dtype=torch.float32, device="meta")


def test_a_quantized_checkpoint_is_refused(tmp_path) -> None:
    from conveyor.engine.models import build_model

    save_tiny_internvl(tmp_path, seed=1)
    config = replace(ModelConfig.from_pretrained(tmp_path), quant=object())
    with pytest.raises(UnsupportedModelError, match="16-bit"):
        build_model(config, dtype=torch.float32, device="meta")


def test_strict_loading(tmp_path) -> None:
    """An unknown tensor and a missing one both raise, naming the tensor."""
    from safetensors.torch import load_file, save_file

    path = _remote_dir(tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    save_file({**tensors, "vision_model.encoder.layers.0.attn.extra": torch.zeros(1)},
              str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="attn.extra"):
        load_ours(path)
    del tensors["mlp1.3.bias"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="linear_2.bias"):
        load_ours(path)


def test_engine_greedy_tokens_match_transformers(tmp_path) -> None:
    """The remote layout (InternLM2 names) through LLMEngine at tp=1: two images of 3 and 1
    tiles, greedy tokens equal to transformers' generate on the -hf model."""

    from conveyor.protocol.multimodal import ImageInput

    hf_dir, path = tmp_path / "hf", tmp_path / "remote"
    hf = save_tiny_internvl(hf_dir, seed=6, text="llama")
    save_remote_internvl(hf_dir, path)
    token = hf.config.image_token_id
    a, b = _pixels(1, 3, seed=1)[0], _pixels(1, 1, seed=2)[0]
    ids = [1, 5, 125] + [token] * (3 * ROWS_PER_TILE) + [126, 9, 125] + [token] * ROWS_PER_TILE + [126, 17, 23]
    images = [ImageInput(3, 3 * ROWS_PER_TILE, "a", a.numpy().tobytes(), list(a.shape)),
              ImageInput(6 + 3 * ROWS_PER_TILE, ROWS_PER_TILE, "b", b.numpy().tobytes(), list(b.shape))]
    got = engine_greedy(path, ids, images, 5)
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor([ids]), pixel_values=torch.cat([a, b]), max_new_tokens=5,
                          do_sample=False, min_new_tokens=5)
    assert got == out[0, len(ids):].tolist()


def test_the_warm_up_batch_is_what_the_tower_takes(tiny) -> None:
    """The runner encodes ``warmup_images`` once at start-up (GPU): images of up to 13 tiles."""
    _, ours, _ = tiny
    for tokens in (1, 13 * ROWS_PER_TILE * 2 + 5):
        shape, grids = ours.warmup_images(tokens)
        with torch.no_grad():
            rows = ours.encode_images(torch.zeros(shape), grids)
        assert len(rows) == shape[0] >= 1 and shape[1] <= 13
        assert all(r.shape[0] == shape[1] * ROWS_PER_TILE for r in rows)
    assert shape[:2] == [2, 13]
