"""LLaVA against transformers: tiny random-weight ``LlavaForConditionalGeneration`` models saved
with ``save_pretrained`` (``tiny_vlm``), loaded by the engine; float32 image features and prefill
logits within 1e-4, for the feature layer -2 (LLaVA 1.5's), a list of layers, the CLS row kept
(``full``), no projector bias; both checkpoint layouts; and the refusals.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_models import assert_close, load_ours
from tiny_vlm import IMAGE_SIZE, attach_cache, engine_greedy, prefill_logits, save_tiny_llava, write_renamed

from conveyor.engine.model_config import ModelConfig
from conveyor.protocol.errors import UnsupportedModelError

pytestmark = pytest.mark.usefixtures("torch_single_thread")

CONFIGS = {
    "llava_1_5": {},
    "feature_layers_list": {"feature_layer": [-3, -1]},
    "cls_kept": {"strategy": "full", "feature_layer": -1},
    "no_projector_bias": {"projector_bias": False},
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = save_tiny_llava(path, seed=3, **CONFIGS[request.param])
    return hf, load_ours(path), path


@pytest.fixture(scope="module")
def engine_tiny(tmp_path_factory):
    """LLaVA 1.5's config alone, for the engine paths (tp, quantized cache, preemption, refusals):
    they do not depend on which feature layers or strategy the tower uses."""
    path = tmp_path_factory.mktemp("llava_engine")
    hf = save_tiny_llava(path, seed=3)
    return hf, load_ours(path), path


def _pixels(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(seed))


def _hf_features(hf, pixels: torch.Tensor) -> list[torch.Tensor]:
    cfg = hf.config
    with torch.no_grad():
        out = hf.model.get_image_features(pixel_values=pixels, vision_feature_layer=cfg.vision_feature_layer,
                                          vision_feature_select_strategy=cfg.vision_feature_select_strategy)
    feats = getattr(out, "pooler_output", out)
    return list(feats)


@pytest.mark.parametrize("count", [1, 3])
def test_image_features_match(tiny, count) -> None:
    hf, ours, _ = tiny
    pixels = _pixels(count, seed=count)
    with torch.no_grad():
        got = ours.encode_images(pixels)
    expected = _hf_features(hf, pixels)
    assert len(got) == count
    for a, b in zip(got, expected):
        assert_close(a, b)


def _prefill_logits(ours, ids: list[int], pixels: torch.Tensor, grids: list[list[int]] | None = None) -> torch.Tensor:
    """Our logits of one prompt, in one chunk, with each image's rows over its placeholders."""
    with torch.no_grad():
        rows = torch.cat(ours.encode_images(pixels, grids))
    return prefill_logits(ours, ids, rows)


def test_prefill_logits_match(tiny) -> None:
    hf, ours, _ = tiny
    attach_cache(ours)
    rows = ours.encode_images(_pixels(1, 0))[0].shape[0]
    token = ours.image_token_id
    ids = [1, 5, 9] + [token] * rows + [17, 23] + [token] * rows + [30, 31, 40]
    pixels = _pixels(2, seed=7)
    got = _prefill_logits(ours, ids, pixels)
    with torch.no_grad():
        expected = hf(input_ids=torch.tensor([ids]), pixel_values=pixels).logits[0].float()
    assert_close(got, expected)
    # the image rows matter: other pixels, other logits
    other = _prefill_logits(ours, ids, _pixels(2, seed=8))
    assert (other - got).abs().max() > 1e-2


def test_transformers_5_layout_loads(tiny, tmp_path) -> None:
    hf, ours, path = tiny
    write_renamed(path, tmp_path, [("language_model.model.", "model.language_model."),
                                   ("language_model.lm_head.", "lm_head."),
                                   ("vision_tower.", "model.vision_tower.vision_model."),
                                   ("multi_modal_projector.", "model.multi_modal_projector.")])
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    again = load_ours(tmp_path)
    pixels = _pixels(2, seed=11)
    with torch.no_grad():
        for a, b in zip(again.encode_images(pixels), ours.encode_images(pixels)):
            assert torch.equal(a, b)
    assert torch.equal(again.language_model.lm_head.weight, ours.language_model.lm_head.weight)


def test_config_describes_the_language_model(tiny) -> None:
    _, _, path = tiny
    config = ModelConfig.from_pretrained(path)
    assert config.architecture == "LlavaForConditionalGeneration"
    assert config.text_architecture == "LlamaForCausalLM"
    assert (config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads) == (64, 2, 4, 2)
    assert config.vision["vision_config"]["image_size"] == IMAGE_SIZE


def test_a_published_config_with_only_its_differences_fills_the_defaults(tmp_path) -> None:
    # llava-hf/llava-1.5-7b-hf's config.json: text_config and vision_config name only what differs
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlavaForConditionalGeneration"], "image_token_index": 32000, "model_type": "llava",
        "projector_hidden_act": "gelu", "torch_dtype": "float16", "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
        "text_config": {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 4096,
                        "model_type": "llama", "rms_norm_eps": 1e-05, "torch_dtype": "float16", "vocab_size": 32064},
        "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                          "model_type": "clip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 24,
                          "patch_size": 14, "projection_dim": 768, "vocab_size": 32000}}))
    config = ModelConfig.from_pretrained(tmp_path)
    assert (config.hidden_size, config.num_layers, config.num_heads, config.vocab_size) == (4096, 32, 32, 32064)
    assert config.vision["vision_config"]["hidden_act"] == "quick_gelu"
    assert config.dtype == torch.float16


@pytest.mark.parametrize("change, words", [
    ({"vision_config": {"model_type": "siglip_vision_model"}}, "CLIP"),
    ({"text_config": {"model_type": "gpt2"}}, "language model"),
])
def test_refusals(tmp_path, change, words) -> None:
    from conveyor.engine.models import build_model

    save_tiny_llava(tmp_path, seed=1)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for key, value in change.items():
        cfg[key] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match=words):
        build_model(ModelConfig.from_pretrained(Path(tmp_path)), dtype=torch.float32, device="meta")


def test_tp2_matches_tp1(engine_tiny) -> None:
    """The tower replicated on each rank (its pixels travel in the step's plan), the language
    model split: tp=2 gives tp=1's greedy tokens for a prompt with two images."""

    from conveyor.protocol.multimodal import ImageInput

    _, ours, path = engine_tiny
    rows = ours.encode_images(_pixels(1, 0))[0].shape[0]
    token = ours.image_token_id
    ids = [1, 5] + [token] * rows + [9] + [token] * rows + [17, 23]
    pixels = _pixels(2, seed=21).numpy()
    images = [ImageInput(2, rows, "a", pixels[0].tobytes(), list(pixels[0].shape)),
              ImageInput(3 + rows, rows, "b", pixels[1].tobytes(), list(pixels[1].shape))]

    assert engine_greedy(path, ids, images, 6, tp=2) == engine_greedy(path, ids, images, 6, tp=1)


@pytest.mark.parametrize("quant_policy", [8, 4])
def test_a_quantized_kv_cache_serves_images(engine_tiny, quant_policy) -> None:
    """int8 / int4 KV with images in the prompt: the image rows' keys go through the quantized
    cache like any token's; the first greedy token matches the 16-bit cache's (the same argmax on
    these logits) and every block comes back."""

    from conveyor.protocol.multimodal import ImageInput

    _, ours, path = engine_tiny
    rows = ours.encode_images(_pixels(1, 0))[0].shape[0]
    ids = [1, 5] + [ours.image_token_id] * rows + [9, 17, 23]
    pixels = _pixels(1, seed=31).numpy()[0]
    image = ImageInput(2, rows, "q", pixels.tobytes(), list(pixels.shape))

    dense, quantized = (engine_greedy(path, ids, [image], 4, check_blocks=True, quant_policy=policy,
                                      enable_prefix_caching=True) for policy in (0, quant_policy))
    assert len(quantized) == 4 and quantized[0] == dense[0]


def test_a_quantized_checkpoint_is_refused(engine_tiny) -> None:
    from dataclasses import replace

    from conveyor.engine.models import build_model

    _, _, path = engine_tiny
    config = replace(ModelConfig.from_pretrained(path), quant=object())
    with pytest.raises(UnsupportedModelError, match="16-bit"):
        build_model(config, dtype=torch.float32, device="meta")


# ---- LLaVA-NeXT (1.6) ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_next(tmp_path_factory):
    from tiny_vlm import save_tiny_llava_next

    path = tmp_path_factory.mktemp("llava_next")
    hf = save_tiny_llava_next(path, seed=4)
    return hf, load_ours(path), path


def _next_inputs(height: int, width: int, seed: int):
    import numpy as np
    from PIL import Image
    from tiny_vlm import NEXT_PINPOINTS
    from transformers import LlavaNextImageProcessor

    processor = LlavaNextImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                                        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                                        image_grid_pinpoints=NEXT_PINPOINTS)
    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    out = processor(images=[image], return_tensors="pt")
    return out["pixel_values"], out["image_sizes"]


@pytest.mark.parametrize("height, width", [(28, 28), (20, 50), (50, 20), (60, 61), (30, 90), (90, 31)])
def test_next_features_match_and_count_as_the_tokenizer_says(tiny_next, height, width) -> None:
    from tiny_vlm import NEXT_PINPOINTS

    from conveyor.protocol.multimodal import llava_next_rows

    hf, ours, _ = tiny_next
    pixels, sizes = _next_inputs(height, width, seed=height * width)
    with torch.no_grad():
        ref = hf.model.get_image_features(pixel_values=pixels, image_sizes=sizes, vision_feature_layer=-2,
                                          vision_feature_select_strategy="default")
        ref = getattr(ref, "pooler_output", ref)
        ref = ref[0] if isinstance(ref, (list, tuple)) else ref
        got = ours.encode_images(pixels, [sizes[0].tolist()])[0]
    assert_close(got, ref)
    assert got.shape[0] == llava_next_rows(height, width, NEXT_PINPOINTS, IMAGE_SIZE, 14, keep_cls=False)


def test_next_prefill_logits_match(tiny_next) -> None:
    hf, ours, _ = tiny_next
    attach_cache(ours)
    pixels, sizes = _next_inputs(30, 70, seed=5)
    with torch.no_grad():
        rows = ours.encode_images(pixels, [sizes[0].tolist()])[0]
    ids = [1, 5, 9] + [ours.image_token_id] * rows.shape[0] + [17, 23]
    got = _prefill_logits(ours, ids, pixels, [sizes[0].tolist()])
    with torch.no_grad():
        expected = hf(input_ids=torch.tensor([ids]), pixel_values=pixels, image_sizes=sizes).logits[0].float()
    assert_close(got, expected)


def test_preempted_requests_with_images_recompute_the_same_tokens(engine_tiny) -> None:
    """A cache of 12 blocks of 4 for four requests that each grow to 7 blocks: requests are preempted
    and recomputed (their images encoded again or taken from the runner's rows), and every greedy
    output equals the one the request gets alone in a roomy cache."""
    from conveyor.protocol.multimodal import ImageInput
    from conveyor.protocol.sampling import SamplingParams

    _, ours, path = engine_tiny
    rows = ours.encode_images(_pixels(1, 0))[0].shape[0]
    token = ours.image_token_id
    pixels = _pixels(4, seed=41).numpy()
    requests = []
    for i in range(4):
        ids = [1 + i, 5] + [token] * rows + [9, 17 + i]
        requests.append((ids, [ImageInput(2, rows, f"p{i}", pixels[i].tobytes(), list(pixels[i].shape))]))
    params = SamplingParams(max_new_tokens=28 - len(requests[0][0]), temperature=0.0, ignore_eos=True)

    def run(cache_blocks: int, reqs) -> tuple[list[list[int]], int]:
        from conveyor.engine.config import EngineConfig
        from conveyor.engine.llm_engine import LLMEngine

        eng = LLMEngine(path, EngineConfig(device="cpu", dtype="float32", cache_max_entry_count=cache_blocks,
                                           block_size=4, max_batch_size=4, max_prefill_token_num=64))
        preempted = 0
        schedule = eng.scheduler.schedule

        def counting():
            nonlocal preempted
            out = schedule()
            preempted += len(out.preempted)
            return out

        eng.scheduler.schedule = counting
        try:
            rids = [eng.add_request(ids, params, images=images).request_id for ids, images in reqs]
            out = {rid: [] for rid in rids}
            while eng.has_work:
                for o in eng.step():
                    if o.token is not None:
                        out[o.request_id].append(o.token)
            assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
            return [out[rid] for rid in rids], preempted
        finally:
            eng.close()

    alone = [run(64, [r])[0][0] for r in requests]
    together, preempted = run(12, requests)
    assert preempted > 0
    assert together == alone


def test_the_warm_up_batches_are_what_the_towers_take(engine_tiny, tiny_next) -> None:
    """The runner encodes ``warmup_images`` once at start-up (GPU): LLaVA's squares, NeXT's
    largest canvas."""
    for ours, tokens in ((engine_tiny[1], 10), (tiny_next[1], 1)):
        shape, grids = ours.warmup_images(tokens)
        with torch.no_grad():
            rows = ours.encode_images(torch.zeros(shape), grids)
        assert len(rows) == shape[0] >= 1
        assert shape[0] == 1 or sum(r.shape[0] for r in rows) <= tokens
