"""InternLM-XComposer2 against an independent plain-torch reference of the published forward (no
transformers class exists): a tiny checkpoint in the published layout (``tiny_xcomposer2``), the
reference written op by op after the remote ``build_mlp.py`` (CLIPVisionTower, PLoRA,
``vision_proj``) and ``modeling_internlm2.py`` (packed ``wqkv`` rearranged per kv group, rotary,
``w2(silu(w1 x) * w3 x)``), with ``im_mask`` at the image rows. Float32 tower rows and prefill
logits within 1e-4 for one and two images; text rows are unaffected by the adapters and image
rows are; a chunked prefill split inside an image; greedy tokens through LLMEngine (with the
runner's ``image_mask``: this module's copy of the runner diff until the runner has it); a
published-style config.json parses and builds on ``meta``; the refusals; strict loading; the
tokenizer stage's pixels, expansion and placeholder text.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_models import assert_close, load_ours
from tiny_vlm import attach_cache, prefill_logits
from tiny_xcomposer2 import IMAGE_TOKEN, PATCH, ROWS, SIDE, TEXT, VISION, save_tiny_xcomposer2, xcomposer2_config

from conveyor.engine.attention_metadata import AttentionMetadata, set_attention_metadata
from conveyor.engine.model_config import ModelConfig
from conveyor.engine.model_registry import check_tp_support
from conveyor.protocol.errors import EngineConfigError, UnsupportedModelError

pytestmark = pytest.mark.usefixtures("torch_single_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(the published tensors, ours loaded from them)."""
    path = tmp_path_factory.mktemp("xcomposer2")
    tensors = save_tiny_xcomposer2(path, seed=5)
    model = load_ours(path)
    attach_cache(model)
    return tensors, model


# ---- the reference: the published forward, op by op ---------------------------------------------

def _plora(t: dict, name: str, x: torch.Tensor, im_mask: torch.Tensor) -> torch.Tensor:
    """build_mlp.PLoRA.forward (lora_alpha / lora_r = 1): the linear, plus B(A(x)) at im_mask."""
    res = x @ t[f"{name}.weight"].t()
    part_x = x[im_mask]
    res[im_mask] += (part_x @ t[f"{name}.Plora_A.weight"].t()) @ t[f"{name}.Plora_B.weight"].t() * 1.0
    return res


def _layer_norm(t: dict, name: str, x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], t[f"{name}.weight"], t[f"{name}.bias"], 1e-5)


def _linear(t: dict, name: str, x: torch.Tensor) -> torch.Tensor:
    return x @ t[f"{name}.weight"].t() + t[f"{name}.bias"]


def ref_vit(t: dict, pixels: torch.Tensor) -> torch.Tensor:
    """CLIPVisionTower.forward: CLIPVisionModel's hidden_states[-1] (select_layer -1), CLS dropped."""
    v = "vit.vision_tower.vision_model."
    b = pixels.shape[0]
    patches = F.conv2d(pixels, t[v + "embeddings.patch_embedding.weight"], stride=PATCH).flatten(2).transpose(1, 2)
    cls = t[v + "embeddings.class_embedding"].expand(b, 1, -1)
    x = torch.cat([cls, patches], 1) + t[v + "embeddings.position_embedding.weight"]
    x = _layer_norm(t, v + "pre_layrnorm", x)
    heads = VISION["num_attention_heads"]
    for i in range(VISION["num_hidden_layers"]):
        p = f"{v}encoder.layers.{i}."
        h = _layer_norm(t, p + "layer_norm1", x)
        q, k, vv = (_linear(t, f"{p}self_attn.{n}", h).view(b, -1, heads, VISION["hidden_size"] // heads)
                    .transpose(1, 2) for n in ("q_proj", "k_proj", "v_proj"))
        w = (q @ k.transpose(-1, -2) / (q.shape[-1] ** 0.5)).softmax(-1)
        x = x + _linear(t, p + "self_attn.out_proj", (w @ vv).transpose(1, 2).reshape(b, -1, VISION["hidden_size"]))
        h = _linear(t, p + "mlp.fc1", _layer_norm(t, p + "layer_norm2", x))
        x = x + _linear(t, p + "mlp.fc2", h * torch.sigmoid(1.702 * h))
    return x[:, 1:]


def ref_img2emb(t: dict, pixels: torch.Tensor) -> torch.Tensor:
    """img2emb: vision_proj(vit(image)), vision_proj = Linear, GELU, Linear (mlp2x_gelu)."""
    return _linear(t, "vision_proj.2", F.gelu(_linear(t, "vision_proj.0", ref_vit(t, pixels))))


def _rms(t: dict, name: str, x: torch.Tensor) -> torch.Tensor:
    return t[f"{name}.weight"] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + TEXT["rms_norm_eps"]))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def ref_logits(t: dict, inputs_embeds: torch.Tensor, im_mask: torch.Tensor) -> torch.Tensor:
    """InternLM2Model + output for one sequence [T, hidden] of embeddings, im_mask [T] bool."""
    n_heads, n_kv = TEXT["num_attention_heads"], TEXT["num_key_value_heads"]
    hidden = TEXT["hidden_size"]
    d, groups = hidden // n_heads, n_heads // n_kv
    n = inputs_embeds.shape[0]
    inv_freq = 1.0 / (TEXT["rope_theta"] ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(n).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]
    causal = torch.full((n, n), float("-inf")).triu(1)
    x = inputs_embeds
    for i in range(TEXT["num_hidden_layers"]):
        p = f"model.layers.{i}."
        residual = x
        h = _rms(t, p + "attention_norm", x)
        qkv = _plora(t, p + "attention.wqkv", h, im_mask)
        # rearrange(qkv, 'b q (h gs d) -> b q h gs d', gs=2 + num_key_value_groups, d=head_dim)
        qkv = qkv.view(n, n_kv, groups + 2, d)
        q = qkv[:, :, :groups].reshape(n, n_heads, d)
        k, v = qkv[:, :, -2], qkv[:, :, -1]
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        w = ((q.transpose(0, 1) @ k.permute(1, 2, 0)) / d ** 0.5 + causal).softmax(-1)
        attn = (w @ v.transpose(0, 1)).transpose(0, 1).reshape(n, hidden)
        x = residual + _plora(t, p + "attention.wo", attn, im_mask)
        residual = x
        h = _rms(t, p + "ffn_norm", x)
        gate = F.silu(_plora(t, p + "feed_forward.w1", h, im_mask)) * _plora(t, p + "feed_forward.w3", h, im_mask)
        x = residual + _plora(t, p + "feed_forward.w2", gate, im_mask)
    return _rms(t, "model.norm", x) @ t["output.weight"].t()


def ref_prefill(t: dict, ids: list[int], pixels: torch.Tensor, im_mask: torch.Tensor | None = None) -> torch.Tensor:
    """interleav_wrap_chat's splice: each image's rows where its placeholder stands, im_mask there
    (default: at every placeholder id)."""
    ids_t = torch.tensor(ids)
    embeds = t["model.tok_embeddings.weight"][ids_t].clone()
    im_mask = ids_t == IMAGE_TOKEN if im_mask is None else im_mask
    if len(pixels):
        embeds[im_mask] = ref_img2emb(t, pixels).reshape(-1, embeds.shape[1])
    return ref_logits(t, embeds, im_mask)


# ---- ours ---------------------------------------------------------------------------------------

def _pixels(images: int, seed: int) -> torch.Tensor:
    return torch.randn(images, 3, SIDE, SIDE, generator=torch.Generator().manual_seed(seed))


def _ids(images: int, seed: int) -> list[int]:
    """Text, then each image's ROWS placeholder tokens and more text."""
    gen = torch.Generator().manual_seed(seed)
    ids = [1] + torch.randint(3, 120, (4,), generator=gen).tolist()
    for _ in range(images):
        ids += [IMAGE_TOKEN] * ROWS + torch.randint(3, 120, (3,), generator=gen).tolist()
    return ids


def our_prefill(model, ids: list[int], rows: torch.Tensor, image_mask: torch.Tensor | None) -> torch.Tensor:
    """Our logits of one prompt in one chunk, ``image_mask`` to forward (what the runner passes
    from the step's image rows)."""
    return prefill_logits(model, ids, rows, image_mask=image_mask)


@pytest.mark.parametrize("images", [1, 3])
def test_tower_rows_match(tiny, images) -> None:
    tensors, ours = tiny
    pixels = _pixels(images, seed=images)
    with torch.no_grad():
        rows = ours.encode_images(pixels)
    assert len(rows) == images and rows[0].shape == (ROWS, TEXT["hidden_size"])
    assert_close(torch.stack(rows), ref_img2emb(tensors, pixels))


@pytest.mark.parametrize("images", [1, 2])
def test_prefill_logits_match(tiny, images) -> None:
    tensors, ours = tiny
    pixels, ids = _pixels(images, seed=10 + images), _ids(images, seed=images)
    with torch.no_grad():
        rows = torch.cat(ours.encode_images(pixels))
    mask = torch.tensor(ids) == IMAGE_TOKEN
    assert_close(our_prefill(ours, ids, rows, mask), ref_prefill(tensors, ids, pixels))


def test_partial_lora_acts_on_image_rows_only(tiny) -> None:
    """Without the mask the image rows' logits move (the adapters matter), the text rows before
    the first image do not; a text-only prompt equals the plain InternLM2 (no adapters)."""
    tensors, ours = tiny
    pixels, ids = _pixels(1, seed=7), _ids(1, seed=7)
    with torch.no_grad():
        rows = torch.cat(ours.encode_images(pixels))
    mask = torch.tensor(ids) == IMAGE_TOKEN
    on, off = our_prefill(ours, ids, rows, mask), our_prefill(ours, ids, rows, None)
    first = int(mask.nonzero()[0])
    assert_close(on[:first], off[:first])
    assert (on[mask] - off[mask]).abs().max() > 1e-2
    assert (on[first + ROWS:] - off[first + ROWS:]).abs().max() > 1e-3  # later text attends to changed keys
    text = _ids(0, seed=3)
    assert_close(our_prefill(ours, text, torch.empty(0, TEXT["hidden_size"]), torch.zeros(len(text), dtype=torch.bool)),
                 ref_prefill(tensors, text, torch.empty(0)))
    assert ours.image_rows.index is None  # forward leaves no mask behind for the next step


def test_image_rows_for_and_warm_up(tiny) -> None:
    _, ours = tiny
    assert ours.image_rows_for([3, SIDE, SIDE], []) == ROWS
    with pytest.raises(ValueError, match="img_size"):
        ours.image_rows_for([3, SIDE + 14, SIDE], [])
    shape, grids = ours.warmup_images(3 * ROWS)
    assert shape == [3, 3, SIDE, SIDE] and len(grids) == 3


PUBLISHED = {  # internlm/internlm-xcomposer2-vl-7b's config.json, as published (written by hand)
    "architectures": ["InternLMXComposer2ForCausalLM"],
    "attn_implementation": "flash_attention_2",
    "auto_map": {"AutoConfig": "configuration_internlm_xcomposer2.InternLMXcomposer2Config",
                 "AutoModel": "modeling_internlm_xcomposer2.InternLMXComposer2ForCausalLM",
                 "AutoModelForCausalLM": "modeling_internlm_xcomposer2.InternLMXComposer2ForCausalLM"},
    "bias": False, "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096,
    "img_size": 490, "initializer_range": 0.02, "intermediate_size": 14336, "max_length": 4096,
    "max_position_embeddings": 32768, "model_type": "internlmxcomposer2", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "pad_token_id": 2, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 1000000, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": False, "vocab_size": 92544,
}


def test_a_published_config_parses_and_builds_on_meta(tmp_path) -> None:
    from conveyor.engine.models.xcomposer2 import InternLMXComposer2ForCausalLM

    (tmp_path / "config.json").write_text(json.dumps(PUBLISHED))
    cfg = ModelConfig.from_pretrained(tmp_path)
    assert (cfg.architecture, cfg.text_architecture) == ("InternLMXComposer2ForCausalLM", "InternLM2ForCausalLM")
    assert (cfg.num_layers, cfg.num_kv_heads, cfg.dtype) == (32, 8, torch.bfloat16)
    with torch.device("meta"):
        model = InternLMXComposer2ForCausalLM(cfg)
    assert model.image_rows_for([3, 490, 490], []) == 35 * 35
    assert tuple(model.vision_tower.vision_model.embeddings.position_embedding.weight.shape) == (35 * 35 + 1, 1024)
    assert len(model.vision_tower.vision_model.encoder.layers) == 24
    assert tuple(model.plora[0].gate_up.lora_a.shape) == (2 * 256, 4096)
    assert tuple(model.plora[0].qkv.lora_b.shape) == ((32 + 16) * 128, 256)
    with pytest.raises(EngineConfigError, match="Partial LoRA"):
        check_tp_support(cfg.architecture, 2)


def test_4khd_is_refused(tmp_path) -> None:
    from conveyor.engine.models.xcomposer2 import InternLMXComposer2ForCausalLM

    cfg = ModelConfig.from_dict({**PUBLISHED, "hd_num": 25})
    with pytest.raises(UnsupportedModelError, match="4KHD"), torch.device("meta"):
        InternLMXComposer2ForCausalLM(cfg)
    save_tiny_xcomposer2(tmp_path, extra={"plora_glb_GN": torch.zeros(1, 1, VISION["hidden_size"])})
    with pytest.raises(UnsupportedModelError, match="4KHD"):
        load_ours(tmp_path)


def test_a_quantized_checkpoint_is_refused() -> None:
    from dataclasses import replace

    from conveyor.engine.models.xcomposer2 import InternLMXComposer2ForCausalLM

    cfg = replace(ModelConfig.from_dict(xcomposer2_config()), quant=object())
    with pytest.raises(UnsupportedModelError, match="quantized"):
        InternLMXComposer2ForCausalLM(cfg)


@pytest.mark.parametrize("drop, words", [
    ("model.layers.1.feed_forward.w3.Plora_B.weight", "not both"),
    ("model.layers.0.attention.wo.Plora_A.weight", "lacks"),
    ("vision_proj.2.bias", "lacks"),
])
def test_strict_loading(tmp_path, drop, words) -> None:
    save_tiny_xcomposer2(tmp_path, drop=(drop,))
    with pytest.raises(ValueError, match=words):
        load_ours(tmp_path)


def test_a_wrong_image_size_fails_loading(tmp_path) -> None:
    """img_size must be what the checkpoint's (interpolated) position table was saved for."""
    save_tiny_xcomposer2(tmp_path, img_size=2 * SIDE)
    with pytest.raises(ValueError, match="position_embedding"):
        load_ours(tmp_path)


# ---- the tokenizer stage ------------------------------------------------------------------------

class _Tokenizer:
    """Enough of a tokenizer for XComposer2Images: one id per word, added tokens after 100."""

    def __init__(self) -> None:
        self.added: dict[str, int] = {}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [self.convert_tokens_to_ids(w) for w in text.split()]

    def add_tokens(self, tokens: list[str], special_tokens: bool = False) -> None:
        self.added.update({t: 100 + len(self.added) for t in tokens})

    def convert_tokens_to_ids(self, token: str) -> int:
        return self.added.get(token, 7)


def test_images_in_a_prompt(tmp_path) -> None:
    from PIL import Image

    from conveyor.services.tokenizer.xcomposer2_images import CLIP_MEAN, CLIP_STD, XComposer2Images

    prompt = XComposer2Images(tmp_path, xcomposer2_config(), _Tokenizer())
    image = Image.fromarray(np.arange(40 * 30 * 3, dtype=np.uint8).reshape(30, 40, 3))
    (prepared,) = prompt.prepare([image])
    want = np.asarray(image.resize((SIDE, SIDE), Image.BICUBIC), dtype=np.float32) / 255
    assert prepared.pixels.shape == (3, SIDE, SIDE) and prepared.num_tokens == ROWS
    np.testing.assert_allclose(prepared.pixels, ((want - CLIP_MEAN) / CLIP_STD).transpose(2, 0, 1), atol=1e-6)
    token = prompt.image_token_id
    ids, images = prompt.expand([1, 5, token, 6], [prepared])
    assert ids == [1, 5, *[IMAGE_TOKEN] * ROWS, 6] and (images[0].offset, images[0].length) == (2, ROWS)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}},
                                             {"type": "text", "text": "what is it?"}]}]
    assert prompt.messages_for_template(messages, reads_parts=False)[0]["content"] == "<ImageHere>what is it?"


def test_the_tokenizer_stage_picks_it(tmp_path) -> None:
    from conveyor.services.tokenizer.multimodal import image_prompt_for
    from conveyor.services.tokenizer.xcomposer2_images import XComposer2Images

    (tmp_path / "config.json").write_text(json.dumps(PUBLISHED))
    prompt = image_prompt_for(tmp_path, _Tokenizer())
    assert isinstance(prompt, XComposer2Images) and prompt.side == 490 and prompt.fill_id == 0


def runner_image_mask(n: int, image_rows: list[tuple[int, int, int, int]]) -> torch.Tensor:
    """What the runner passes as ``image_mask`` for a step of ``n`` input rows (the diff in the
    helper's report: True on each (row, image, encoder row, count) span of ``plan.image_rows``)."""
    mask = torch.zeros(n, dtype=torch.bool)
    for row, _, _, count in image_rows:
        mask[row:row + count] = True
    return mask


def test_a_chunked_prefill_split_inside_an_image(tiny) -> None:
    """Two chunks, the split in the image's span: each chunk's rows and mask from engine/multimodal's
    image_rows (as the runner builds them), the second chunk's logits equal the reference's."""
    from conveyor.engine.multimodal import image_rows
    from conveyor.protocol.multimodal import ImageInput

    tensors, ours = tiny
    pixels, ids = _pixels(1, seed=21), _ids(1, seed=21)
    first = ids.index(IMAGE_TOKEN)
    images = [ImageInput(offset=first, length=ROWS, digest="x", pixels=b"", shape=[3, SIDE, SIDE], dtype="float32")]
    with torch.no_grad():
        rows = ours.encode_images(pixels)[0]
    n, split = len(ids), first + ROWS // 2
    for start, end in ((0, split), (split, n)):
        spans = image_rows(images, start, end - start, 0)
        meta = AttentionMetadata(slot_mapping=torch.arange(start, end),
                                 block_tables=torch.arange((n + 3) // 4)[None].int(),
                                 cu_seqlens_q=torch.tensor([0, end - start], dtype=torch.int32),
                                 seqlens_k=torch.tensor([end], dtype=torch.int32),
                                 max_seqlen_q=end - start, max_seqlen_k=end)
        ids_t = torch.tensor(ids[start:end])
        with torch.no_grad():
            embeds = ours.embed_input_ids(ids_t)
            for row, _, src, count in spans:
                embeds[row:row + count] = rows[src:src + count]
            set_attention_metadata(meta)
            try:
                logits = ours.compute_logits(ours(ids_t, torch.arange(start, end), inputs_embeds=embeds,
                                                  image_mask=runner_image_mask(end - start, spans)))
            finally:
                set_attention_metadata(None)
    assert_close(logits, ref_prefill(tensors, ids, pixels)[split:])


@pytest.mark.parametrize("chunk", [64, 6])
def test_engine_greedy_tokens_match_the_reference(tmp_path, chunk) -> None:
    """Two images through LLMEngine (prefill in one chunk, and in chunks of 6 that split both
    images' spans): greedy tokens equal the reference's argmax, decode rows without adapters."""
    from conveyor.engine.config import EngineConfig
    from conveyor.engine.llm_engine import LLMEngine
    from conveyor.protocol.sampling import SamplingParams
    from conveyor.protocol.multimodal import ImageInput

    tensors = save_tiny_xcomposer2(tmp_path, seed=9)
    pixels, ids = _pixels(2, seed=31), _ids(2, seed=31)
    spans = [i for i in range(len(ids)) if ids[i] == IMAGE_TOKEN and (i == 0 or ids[i - 1] != IMAGE_TOKEN)]
    images = [ImageInput(at, ROWS, f"im{k}", pixels[k].numpy().tobytes(), [3, SIDE, SIDE])
              for k, at in enumerate(spans)]
    eng = LLMEngine(tmp_path, EngineConfig(device="cpu", dtype="float32", cache_max_entry_count=32, block_size=4,
                                           max_batch_size=4, max_prefill_token_num=chunk))
    try:
        eng.add_request(ids, SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True), images=images)
        got = []
        while eng.has_work:
            got += [o.token for o in eng.step() if o.token is not None]
    finally:
        eng.close()
    prompt_mask = torch.tensor(ids) == IMAGE_TOKEN
    want: list[int] = []
    for _ in range(5):
        mask = torch.cat([prompt_mask, torch.zeros(len(want), dtype=torch.bool)])
        want.append(int(ref_prefill(tensors, ids + want, pixels, mask)[-1].argmax()))
    assert got == want
