"""Qwen2-VL and Qwen2.5-VL against transformers: tiny random-weight models saved by transformers
(``tiny_vlm.save_tiny_qwen2_vl``), loaded by the engine. The towers' rows (Qwen2.5's windows
with and without padding), the multimodal rotary positions of any chunk, prefill logits with two
images, both checkpoint layouts, a published (flat) config, tensor parallel, and the refusals.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_models import assert_close, load_ours
from tiny_vlm import attach_cache, engine_greedy, prefill_logits, save_tiny_qwen2_vl, write_renamed

from conveyor.engine.model_config import ModelConfig
from conveyor.engine.multimodal import mrope_delta, mrope_positions
from conveyor.protocol.errors import UnsupportedModelError
from conveyor.protocol.multimodal import ImageInput

pytestmark = pytest.mark.usefixtures("torch_single_thread")

PATCH_VALUES = 3 * 2 * 14 * 14


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = save_tiny_qwen2_vl(path, seed=5, windowed=request.param == "qwen2_5_vl")
    return hf, load_ours(path), path


def _patches(grid: list[int], seed: int) -> torch.Tensor:
    t, h, w = grid
    return torch.randn(t * h * w, PATCH_VALUES, generator=torch.Generator().manual_seed(seed))


def _hf_rows(hf, patches: list[torch.Tensor], grids: list[list[int]]) -> list[torch.Tensor]:
    with torch.no_grad():
        out = hf.model.get_image_features(pixel_values=torch.cat(patches), image_grid_thw=torch.tensor(grids))
    return list(getattr(out, "pooler_output", out))


# [1, 4, 4]: one window; [1, 6, 10]: Qwen2.5's 2 x 2 windows padded on both sides; [1, 8, 4]: tall
@pytest.mark.parametrize("grids", [[[1, 4, 4]], [[1, 6, 10]], [[1, 8, 4], [1, 6, 10]]], ids=str)
def test_image_rows_match(tiny, grids) -> None:
    hf, ours, _ = tiny
    patches = [_patches(g, seed=i) for i, g in enumerate(grids)]
    expected = _hf_rows(hf, patches, grids)
    with torch.no_grad():  # the runner sends images of one grid together, others apart
        got = [ours.encode_images(p[None], [g])[0] for p, g in zip(patches, grids)]
        same = ours.encode_images(torch.stack([patches[0], patches[0]]), [grids[0], grids[0]])
    for a, b in zip(got, expected):
        assert a.shape == b.shape
        assert_close(a, b)
    assert_close(same[1], expected[0])


def _layout(grids: list[list[int]], texts: list[int], token: int) -> tuple[list[int], list[ImageInput]]:
    """Text runs of ``texts[i]`` tokens around the images; ids and the images' spans."""
    ids, images = list(range(1, texts[0] + 1)), []
    for grid, text in zip(grids, texts[1:]):
        rows = grid[0] * grid[1] * grid[2] // 4
        images.append(ImageInput(len(ids), rows, f"d{len(images)}", b"", [1], grid=grid))
        ids += [token] * rows + list(range(10, 10 + text))
    return ids, images


@pytest.mark.parametrize("chunk", [7, 1000])
def test_positions_of_any_chunk_equal_transformers_rope_index(tiny, chunk) -> None:
    hf, ours, _ = tiny
    grids = [[1, 4, 8], [1, 6, 2], [1, 2, 2]]
    ids, images = _layout(grids, [3, 2, 1, 5], ours.image_token_id)
    ids_t = torch.tensor([ids])
    expected, deltas = hf.model.get_rope_index(ids_t, (ids_t == ours.image_token_id).int(),
                                               image_grid_thw=torch.tensor(grids))
    expected = expected[:, 0].numpy()
    got = []
    for start in range(0, len(ids), chunk):
        n = min(chunk, len(ids) - start)
        rows = mrope_positions(images, start, n, 2)
        if rows is None:  # no image token in the chunk: the shifted index
            rows = np.tile(np.arange(start, start + n) + mrope_delta(images, start, 2), (3, 1))
        got.append(rows)
    assert np.array_equal(np.concatenate(got, axis=1), expected)
    # decode: the next token's position
    assert len(ids) + mrope_delta(images, len(ids), 2) == expected.max() + 1 == len(ids) + int(deltas[0, 0])


def test_prefill_logits_match(tiny) -> None:
    hf, ours, _ = tiny
    attach_cache(ours)
    grids = [[1, 4, 6], [1, 2, 4]]
    ids, images = _layout(grids, [3, 2, 4], ours.image_token_id)
    patches = [_patches(g, seed=20 + i) for i, g in enumerate(grids)]
    with torch.no_grad():
        rows = torch.cat([ours.encode_images(p[None], [g])[0] for p, g in zip(patches, grids)])
    got = prefill_logits(ours, ids, rows, torch.from_numpy(mrope_positions(images, 0, len(ids), 2)))
    ids_t = torch.tensor(ids)
    with torch.no_grad():
        expected = hf(input_ids=ids_t[None], pixel_values=torch.cat(patches), image_grid_thw=torch.tensor(grids),
                      mm_token_type_ids=(ids_t[None] == ours.image_token_id).int()).logits[0].float()
    assert_close(got, expected)


def test_the_published_layout_loads(tiny, tmp_path) -> None:
    """Qwen's own files: ``visual.*``, the language model under ``model.*``, a flat config."""
    _, ours, path = tiny
    write_renamed(path, tmp_path, [("model.visual.", "visual."), ("model.language_model.", "model.")])
    cfg = json.loads((path / "config.json").read_text())
    text = cfg.pop("text_config")
    rope = text.pop("rope_parameters")
    flat = {**text, **cfg, "rope_theta": rope["rope_theta"],
            "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]}}
    (tmp_path / "config.json").write_text(json.dumps(flat))
    again = load_ours(tmp_path)
    patches = _patches([1, 4, 4], seed=3)
    with torch.no_grad():
        assert torch.equal(again.encode_images(patches[None], [[1, 4, 4]])[0],
                           ours.encode_images(patches[None], [[1, 4, 4]])[0])
    assert torch.equal(again.language_model.lm_head.weight, ours.language_model.lm_head.weight)
    assert again.language_model.model.layers[0].self_attn.rotary_emb.mrope_section == rope["mrope_section"]


def test_a_published_flat_config(tmp_path) -> None:
    # Qwen/Qwen2-VL-2B-Instruct's config.json (language model fields at top level, tied embeddings)
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2VLForConditionalGeneration"], "attention_dropout": 0.0, "bos_token_id": 151643,
        "eos_token_id": 151645, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
        "vision_token_id": 151654, "image_token_id": 151655, "video_token_id": 151656, "hidden_act": "silu",
        "hidden_size": 1536, "initializer_range": 0.02, "intermediate_size": 8960, "max_position_embeddings": 32768,
        "max_window_layers": 28, "model_type": "qwen2_vl", "num_attention_heads": 12, "num_hidden_layers": 28,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
        "vision_config": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "in_chans": 3,
                          "hidden_size": 1536, "patch_size": 14, "spatial_merge_size": 2, "spatial_patch_size": 14,
                          "temporal_patch_size": 2},
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "vocab_size": 151936}))
    config = ModelConfig.from_pretrained(tmp_path)
    assert config.text_architecture == "Qwen2ForCausalLM"
    assert (config.hidden_size, config.num_layers, config.num_kv_heads, config.rope_theta) == (1536, 28, 2, 1e6)
    assert config.tie_word_embeddings and config.dtype == torch.bfloat16 and config.rope_scaling is None

    from conveyor.engine.models import build_model

    model = build_model(config, dtype=torch.bfloat16, device="meta")
    assert model.visual.merger.mlp[2].out_features == 1536 and len(model.visual.blocks) == 32
    assert model.language_model.model.layers[0].self_attn.rotary_emb.mrope_section == [16, 24, 24]


def test_tp2_matches_tp1(tiny) -> None:
    """The tower on each rank, the [3, T] positions in the plan: tp=2 gives tp=1's greedy tokens
    for a prompt with two images (decoded after both: shifted positions)."""


    _, ours, path = tiny
    grids = [[1, 4, 6], [1, 2, 2]]
    ids, spans = _layout(grids, [2, 1, 2], ours.image_token_id)
    images = []
    for i, (span, grid) in enumerate(zip(spans, grids)):
        pixels = _patches(grid, seed=40 + i).numpy()
        images.append(ImageInput(span.offset, span.length, f"p{i}", pixels.tobytes(), list(pixels.shape),
                                 grid=grid))

    assert engine_greedy(path, ids, images, 5, tp=2) == engine_greedy(path, ids, images, 5, tp=1)


@pytest.mark.parametrize("change, words", [
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [1, 2, 2]}}, "mrope_section"),
    ({"vision_config": {"model_type": "qwen2_vl_vision", "depth": 1, "embed_dim": 32, "hidden_size": 64,
                        "num_heads": 2, "patch_size": 16}}, "patch"),
])
def test_refusals(tmp_path, change, words) -> None:
    from conveyor.engine.models import build_model

    save_tiny_qwen2_vl(tmp_path, seed=1)
    cfg = json.loads((tmp_path / "config.json").read_text())
    if "rope_parameters" in change:
        cfg["text_config"].update(change)
    else:
        cfg.update(change)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    if "vision_config" in change:  # a tower built for other patches refuses the processor's rows
        model = build_model(ModelConfig.from_pretrained(Path(tmp_path)), dtype=torch.float32, device="cpu")
        with pytest.raises(ValueError, match=words):
            model.encode_images(_patches([1, 2, 2], seed=0)[None], [[1, 2, 2]])
        return
    with pytest.raises(UnsupportedModelError, match=words):
        build_model(ModelConfig.from_pretrained(Path(tmp_path)), dtype=torch.float32, device="meta")


@pytest.mark.parametrize("device, eager", [("cpu", True), pytest.param("cuda", False, marks=pytest.mark.gpu),
                                           pytest.param("cuda", True, marks=pytest.mark.gpu)],
                         ids=["cpu", "cuda-graphs", "cuda-eager"])
def test_a_chunked_session_equals_transformers_on_the_whole_conversation(tiny, device, eager) -> None:
    """Turn 1 with one image, turn 2 with another, prefilled in chunks of 8 (the text around the
    images split off from them): turn 2's greedy tokens equal transformers' on the whole
    conversation, whose positions after each image are shifted by what it saved. On a GPU the
    Triton kernels rotate with the step's M-RoPE table, and decode graphs take the shifts."""
    from conveyor.engine.config import EngineConfig
    from conveyor.engine.llm_engine import LLMEngine
    from conveyor.protocol.sampling import SamplingParams

    hf, ours, path = tiny
    start, token, end = ours.image_token_id - 1, ours.image_token_id, ours.image_token_id + 1
    grids = [[1, 4, 6], [1, 4, 2]]
    patches = [_patches(g, seed=50 + i) for i, g in enumerate(grids)]

    def turn(ids_before: list[int], grid: list[int], after: list[int], i: int):
        rows = grid[0] * grid[1] * grid[2] // 4
        ids = ids_before + [start] + [token] * rows + [end] + after
        pixels = patches[i].numpy()
        return ids, ImageInput(len(ids_before) + 1, rows, f"s{i}", pixels.tobytes(), list(pixels.shape), grid=grid)

    first, image_a = turn([1, 2, 3, 4, 5], grids[0], [6, 7, 8, 9, 10, 11], 0)
    second, image_b = turn([12, 13], grids[1], [14, 15, 16, 17, 18, 19, 20, 21, 22], 1)
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    eng = LLMEngine(path, EngineConfig(device=device, dtype="float32", cache_max_entry_count=64, block_size=4,
                                       max_batch_size=4, max_prefill_token_num=8, eager_mode=eager))
    try:
        outputs = []
        for ids, image in ((first, image_a), (second, image_b)):
            eng.add_request(ids, params, session_id=7, images=[image])
            out = []
            while eng.has_work:
                out += [o.token for o in eng.step() if o.token is not None]
            outputs.append(out)
    finally:
        eng.close()
    whole = torch.tensor([first + outputs[0] + second])
    with torch.no_grad():
        expected = hf.generate(input_ids=whole, attention_mask=torch.ones_like(whole),
                               pixel_values=torch.cat(patches), image_grid_thw=torch.tensor(grids),
                               mm_token_type_ids=(whole == token).int(), max_new_tokens=4, do_sample=False)
    assert outputs[1] == expected[0, whole.shape[1]:].tolist()


def test_the_warm_up_batch_is_what_the_tower_takes(tiny) -> None:
    """The runner encodes ``warmup_images`` once at start-up (GPU): a batch of 448-pixel squares."""
    _, ours, _ = tiny
    shape, grids = ours.warmup_images(600)
    assert shape[0] == len(grids) == 600 // 256 and grids[0] == [1, 32, 32]
    with torch.no_grad():
        rows = ours.encode_images(torch.zeros(shape), grids)
    assert [r.shape[0] for r in rows] == [256] * shape[0]


@pytest.mark.parametrize("shape, grid, words", [
    ([24, PATCH_VALUES], [1, 4, 5], "multiples of 2"),        # an odd grid the merger cannot take
    ([24, PATCH_VALUES], [1, 4, 4], "does not fit"),          # a grid that is not the patches'
    ([24, 100], [1, 4, 6], "patch rows"),                     # rows of another patch size
    ([32, PATCH_VALUES], [1, 4, 8], "gives 8 encoder rows"),  # the span shorter than the image
])
def test_an_image_the_tower_cannot_take_is_a_400_at_admission(tiny, shape, grid, words) -> None:
    from tiny_llama import engine

    from conveyor.protocol import InvalidRequestError
    from conveyor.protocol.sampling import SamplingParams

    _, ours, path = tiny
    ids = [1, 2] + [ours.image_token_id] * 6 + [3]
    pixels = np.zeros(shape, dtype=np.float32)
    eng = engine(path)
    try:
        with pytest.raises(InvalidRequestError, match=words):
            eng.add_request(ids, SamplingParams(max_new_tokens=2), images=[
                ImageInput(2, 6, "x", pixels.tobytes(), shape, grid=grid)])
        assert not eng.has_work and eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    finally:
        eng.close()
