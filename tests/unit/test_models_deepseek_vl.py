"""DeepSeek-VL (``MultiModalityCausalLM``, the remote code's layout) against a reference built from
transformers' parts (``tiny_deepseek_vl``): tiny random-weight models of both towers (the 7B's
hybrid SAM-B + SigLIP with its ``sam_hd`` branch weighted in, the 1.3B's SigLIP alone read one
block before the last), float32 image rows and prefill logits within 1e-4, greedy tokens through
the engine; published-style config.json files (deepseek-vl-7b-chat's and 1.3b-chat's fields)
parsed and built on ``meta``; the refusals.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_models import assert_close, load_ours
from tiny_deepseek_vl import HIGH, IMAGE_TOKEN, LOW, ROWS, save_tiny_deepseek_vl
from tiny_vlm import attach_cache, engine_greedy, prefill_logits

from conveyor.engine.model_config import ModelConfig
from conveyor.protocol.errors import UnsupportedModelError

pytestmark = pytest.mark.usefixtures("torch_single_thread")


@pytest.fixture(scope="module", params=["hybrid", "siglip"])
def tiny(request, tmp_path_factory):
    """(the reference, ours loaded from the remote-layout files, the image side)."""
    hybrid = request.param == "hybrid"
    path = tmp_path_factory.mktemp(request.param)
    ref = save_tiny_deepseek_vl(path, hybrid=hybrid, seed=3)
    return ref, load_ours(path), HIGH if hybrid else LOW


def _pixels(n: int, side: int, seed: int) -> torch.Tensor:
    """Processor-like pixels (the towers normalize again)."""
    return torch.rand(n, 3, side, side, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("n", [1, 3])
def test_tower_rows_match(tiny, n) -> None:
    ref, ours, side = tiny
    pixels = _pixels(n, side, seed=n)
    with torch.no_grad():
        got = ours.encode_images(pixels)
    expected = ref.image_rows(pixels)
    assert len(got) == n
    for a, b in zip(got, expected):
        assert a.shape == (ROWS, 64)
        assert_close(a, b)


def test_prefill_logits_match(tiny) -> None:
    """Two images in one prompt, their rows over the placeholders: logits as Llama's with the
    same rows in ``inputs_embeds``."""
    ref, ours, side = tiny
    pixels = _pixels(2, side, seed=7)
    ids = [1, 5, 9] + [IMAGE_TOKEN] * ROWS + [12, 40] + [IMAGE_TOKEN] * ROWS + [3, 77, 21]
    attach_cache(ours)
    with torch.no_grad():
        rows = torch.cat(ours.encode_images(pixels))
    assert_close(prefill_logits(ours, ids, rows), ref.logits(ids, pixels))


def test_the_sam_hd_branch_counts(tmp_path) -> None:
    """``hd_alpha_downsamples`` (0.7 here) weighs the first global block's features in: zeroed,
    the rows move (the reference match above would fail without that branch)."""
    ref = save_tiny_deepseek_vl(tmp_path, hybrid=True, seed=4)
    ours = load_ours(tmp_path)
    pixels = _pixels(1, HIGH, seed=1)
    with torch.no_grad():
        assert_close(ours.encode_images(pixels)[0], ref.image_rows(pixels)[0])
        ours.vision_model.vision_tower_high.vision_tower.hd_alpha_downsamples.zero_()
        moved = (ours.encode_images(pixels)[0] - ref.image_rows(pixels)[0]).abs().max().item()
    assert moved > 1e-3


def test_engine_greedy_tokens_match_the_reference(tmp_path) -> None:
    """The hybrid model through LLMEngine at tp=1: two images, greedy tokens equal to the reference's."""
    from conveyor.protocol.multimodal import ImageInput

    ref = save_tiny_deepseek_vl(tmp_path, hybrid=True, seed=6)
    pixels = _pixels(2, HIGH, seed=2)
    ids = [1, 5, 9] + [IMAGE_TOKEN] * ROWS + [12, 40] + [IMAGE_TOKEN] * ROWS + [3, 77, 21]
    images = [ImageInput(3, ROWS, "a", pixels[0].numpy().tobytes(), [3, HIGH, HIGH]),
              ImageInput(5 + ROWS, ROWS, "b", pixels[1].numpy().tobytes(), [3, HIGH, HIGH])]
    assert engine_greedy(tmp_path, ids, images, 5) == ref.greedy(ids, pixels, 5)


def test_rows_shapes_and_warm_up(tiny) -> None:
    _, ours, side = tiny
    assert ours.image_rows_for([3, side, side], []) == ROWS
    with pytest.raises(ValueError, match=f"\\[3, {side}, {side}\\]"):
        ours.image_rows_for([3, side // 2, side // 2], [])
    shape, grids = ours.warmup_images(4 * ROWS + 1)
    assert shape == [4, 3, side, side] and len(grids) == 4


# deepseek-ai/deepseek-vl-7b-chat's config.json (the fields as published, written by hand)
SAM_HIGH = {"ckpt_path": "", "image_size": 1024, "model_name": "sam_b_downsample", "output_dim": 1024,
            "pixel_mean": [0.48145466, 0.4578275, 0.40821073], "pixel_std": [0.26862954, 0.26130258, 0.27577711],
            "select_feature": "same", "select_layer": -1}
SIGLIP_LOW = {"ckpt_path": "", "image_size": 384, "model_name": "siglip_large_patch16_384", "output_dim": 1024,
              "pixel_mean": [0.5, 0.5, 0.5], "pixel_std": [0.5, 0.5, 0.5], "select_feature": "same",
              "select_layer": -1}
PUBLISHED_7B = {
    "aligner_config": {"cls": "MlpProjector", "model_type": "aligner",
                       "params": {"depth": 2, "input_dim": 1024, "n_embed": 4096,
                                  "projector_type": "low_high_hybrid_split_mlp_gelu"}},
    "architectures": ["MultiModalityCausalLM"],
    "language_config": {"max_position_embeddings": 16384, "model_type": "llama", "num_hidden_layers": 30,
                        "torch_dtype": "bfloat16", "vocab_size": 102400},
    "model_type": "multi_modality",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.38.2",
    "vision_config": {"cls": "HybridVisionTower", "model_type": "vision",
                      "params": {"concat_type": "tuple", "freeze_high": True, "freeze_low": True,
                                 "high_res_cfg": SAM_HIGH, "low_res_cfg": SIGLIP_LOW}},
}
# deepseek-ai/deepseek-vl-1.3b-chat's: SigLIP alone before a 24-layer Llama of width 2048
PUBLISHED_1_3B = {
    **PUBLISHED_7B,
    "aligner_config": {"cls": "MlpProjector", "model_type": "aligner",
                       "params": {"depth": 2, "input_dim": 1024, "n_embed": 2048, "projector_type": "mlp_gelu"}},
    "language_config": {"hidden_size": 2048, "intermediate_size": 5632, "max_position_embeddings": 16384,
                        "model_type": "llama", "num_attention_heads": 16, "num_hidden_layers": 24,
                        "num_key_value_heads": 16, "torch_dtype": "bfloat16", "vocab_size": 102400},
    "vision_config": {"cls": "CLIPVisionTower", "model_type": "vision", "params": SIGLIP_LOW},
}


def _published_dir(tmp_path: Path, cfg: dict) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"added_tokens_decoder": {"100015": {"content": "<image_placeholder>", "special": True}}}))
    return tmp_path


def test_published_7b_config_parses_and_builds(tmp_path) -> None:
    from conveyor.engine.models import build_model

    config = ModelConfig.from_pretrained(_published_dir(tmp_path, PUBLISHED_7B))
    assert config.text_architecture == "LlamaForCausalLM"
    # LlamaConfig's defaults fill what language_config leaves out (DeepSeek LLM 7B's shape)
    assert (config.hidden_size, config.intermediate_size, config.num_layers, config.num_heads,
            config.num_kv_heads, config.vocab_size) == (4096, 11008, 30, 32, 32, 102400)
    assert config.dtype == torch.bfloat16 and config.rope_theta == 10000.0 and config.rms_norm_eps == 1e-6
    assert config.eos_token_ids == [] and config.bos_token_id is None  # not LlamaConfig's 1 and 2
    model = build_model(config, dtype=torch.bfloat16, device="meta")
    assert model.image_token_id == 100015 and model.image_size == 1024 and model.rows == 576
    sam = model.vision_model.vision_tower_high.vision_tower
    siglip = model.vision_model.vision_tower_low.vision_tower
    assert len(sam.blocks) == 12 and sam.grid == 64 and sam.resize == 96 and sam.channels == 1024
    assert [b.window for b in sam.blocks[:4]] == [14, 14, 0, 14]
    assert len(siglip.blocks) == 24 and siglip.grid == 24 and siglip.width == 1024
    assert model.aligner.high_up_proj.weight.shape == (2048, 1024)
    assert model.aligner.layers[1].weight.shape == (4096, 4096)


def test_published_1_3b_config_parses_and_builds(tmp_path) -> None:
    from conveyor.engine.models import build_model

    config = ModelConfig.from_pretrained(_published_dir(tmp_path, PUBLISHED_1_3B))
    assert (config.hidden_size, config.num_layers, config.num_heads) == (2048, 24, 16)
    model = build_model(config, dtype=torch.bfloat16, device="meta")
    assert model.image_size == 384 and model.rows == 576
    assert len(model.vision_model.vision_tower.blocks) == 24
    assert [type(m).__name__ for m in model.aligner.layers] == ["Linear", "GELU", "Linear"]


@pytest.mark.parametrize("change, words", [
    ({"aligner_config": {"cls": "MlpProjector", "params": {"projector_type": "identity"}}}, "projector_type"),
    ({"aligner_config": {"cls": "SomeOtherProjector", "params": {}}}, "MlpProjector"),
    ({"vision_config": {"cls": "HybridVisionTower", "params": {"concat_type": "feature", "high_res_cfg": SAM_HIGH,
                                                               "low_res_cfg": SIGLIP_LOW}}}, "concat_type"),
    ({"vision_config": {"cls": "CLIPVisionTower", "params": {**SIGLIP_LOW, "model_name": "openai/clip-vit-large"}}},
     "siglip"),
    ({"vision_config": {"cls": "CLIPVisionTower", "params": SIGLIP_LOW}}, "does not fit"),
    ({"vision_config": {"cls": "HybridVisionTower", "params": {"high_res_cfg": {**SAM_HIGH, "model_name": "sam_vit_h"},
                                                               "low_res_cfg": SIGLIP_LOW}}}, "sam_vit_h"),
    ({"vision_config": {"cls": "SigLIPVisionTower", "params": {}}}, "SigLIPVisionTower"),
])
def test_refusals(tmp_path, change, words) -> None:
    from conveyor.engine.models import build_model

    config = ModelConfig.from_pretrained(_published_dir(tmp_path, {**PUBLISHED_7B, **change}))
    with pytest.raises(UnsupportedModelError, match=words):
        build_model(config, dtype=torch.bfloat16, device="meta")


def test_a_stray_tensor_is_refused(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    save_tiny_deepseek_vl(tmp_path, hybrid=False, seed=1)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["vision_model.vision_tower.extra.weight"] = torch.zeros(2)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="extra"):
        load_ours(tmp_path)
