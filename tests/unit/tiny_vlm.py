"""Tiny random-weight vision-language models saved by transformers, for tests against it.

``save_tiny_llava`` writes a ``LlavaForConditionalGeneration`` (a 2-layer Llama of width 64 after
a 3-layer CLIP tower on 28x28 images, 14-pixel patches: 4 image rows a picture) in float32 with
``save_pretrained``; given a tokenizer directory (the default model's), it adds an ``<image>``
token, sizes the vocabulary to it, and saves a ``LlavaProcessor`` (CLIP's image processor and a
llava-hf style chat template) beside the weights, so ``AutoProcessor`` and conveyor's stages both
read the one directory.
"""

from __future__ import annotations

from pathlib import Path

import torch

# llava-hf/llava-1.5-7b-hf's template, shortened: the parts in order, <image> for an image part.
LLAVA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}USER: {% else %}ASSISTANT: {% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}<image>\n"
    "{% else %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if message['role'] == 'user' %} {% else %}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}")
IMAGE_SIZE, PATCH = 28, 14


def llava_config(vocab_size: int, image_token: int, strategy: str = "default", feature_layer=-2,
                 projector_bias: bool = True):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    text = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=vocab_size, max_position_embeddings=512,
                       rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                              image_size=IMAGE_SIZE, patch_size=PATCH, projection_dim=32)
    return LlavaConfig(text_config=text, vision_config=vision, image_token_id=image_token,
                       vision_feature_select_strategy=strategy, vision_feature_layer=feature_layer,
                       multimodal_projector_bias=projector_bias)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Norm scales near 1, everything else 0.1 * N(0, 1): logits that tell models apart."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            is_norm = "norm" in name or "layrnorm" in name
            param.copy_(1 + 0.1 * noise if is_norm and name.endswith("weight") else 0.1 * noise)


def _tokenizer(tokenizer_dir: Path | None):
    """(the tokenizer of ``tokenizer_dir`` with an ``<image>`` token added, its size, the token's id);
    without a directory (None, 128, 127): a model whose prompts are token ids."""
    if tokenizer_dir is None:
        return None, 128, 127
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    return tokenizer, len(tokenizer), tokenizer.convert_tokens_to_ids("<image>")


def save_tiny_llava(path: Path, tokenizer_dir: Path | None = None, seed: int = 0, **config_kwargs) -> torch.nn.Module:
    """Write a tiny LLaVA (and, with ``tokenizer_dir``, its tokenizer and processor) to ``path``;
    returns the transformers model."""
    from transformers import CLIPImageProcessor, LlavaForConditionalGeneration, LlavaProcessor

    path = Path(path)
    tokenizer, vocab, image_token = _tokenizer(tokenizer_dir)
    config = llava_config(vocab, image_token, **config_kwargs)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).to(torch.float32).eval()
    _randomize(model, seed)
    model.save_pretrained(path)
    if tokenizer is not None:
        processor = LlavaProcessor(
            image_processor=CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                                               crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}),
            tokenizer=tokenizer, patch_size=PATCH, vision_feature_select_strategy=config.vision_feature_select_strategy,
            chat_template=LLAVA_TEMPLATE, num_additional_image_tokens=1)
        processor.save_pretrained(path)
        tokenizer.chat_template = LLAVA_TEMPLATE
        tokenizer.save_pretrained(path)
    return model


# A canvas list for 28-pixel tiles: one tile, two side by side, two stacked, a 2x2 square.
NEXT_PINPOINTS = [[28, 28], [28, 56], [56, 28], [56, 56]]


def save_tiny_llava_next(path: Path, tokenizer_dir: Path | None = None, seed: int = 0) -> torch.nn.Module:
    """``save_tiny_llava``'s model as LLaVA-NeXT (anyres tiles of 28 pixels, ``NEXT_PINPOINTS``),
    with a ``LlavaNextProcessor`` when given a tokenizer directory."""
    from transformers import (LlavaNextConfig, LlavaNextForConditionalGeneration, LlavaNextImageProcessor,
                              LlavaNextProcessor)

    path = Path(path)
    tokenizer, vocab, image_token = _tokenizer(tokenizer_dir)
    base = llava_config(vocab, image_token)
    config = LlavaNextConfig(text_config=base.text_config, vision_config=base.vision_config,
                             image_token_id=image_token, image_grid_pinpoints=NEXT_PINPOINTS,
                             vision_feature_select_strategy="default", vision_feature_layer=-2)
    torch.manual_seed(seed)
    model = LlavaNextForConditionalGeneration(config).to(torch.float32).eval()
    _randomize(model, seed)
    model.save_pretrained(path)
    if tokenizer is not None:
        image_processor = LlavaNextImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                                                  crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                                                  image_grid_pinpoints=NEXT_PINPOINTS)
        processor = LlavaNextProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH,
                                       vision_feature_select_strategy="default", chat_template=LLAVA_TEMPLATE,
                                       num_additional_image_tokens=1)
        processor.save_pretrained(path)
        tokenizer.chat_template = LLAVA_TEMPLATE
        tokenizer.save_pretrained(path)
    return model


# Qwen2-VL's template, shortened: ChatML, the vision tokens for an image part.
QWEN2_VL_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'text' %}{{ content['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
QWEN2_VL_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
# 56 x 56 .. 112 x 112 pixels: 4 to 16 patches of 14 a side, 1 to 4 image tokens (2 x 2 merged)
QWEN2_VL_PIXELS = {"min_pixels": 56 * 56, "max_pixels": 112 * 112}


def qwen2_vl_config(vocab_size: int, token_ids: list[int], windowed: bool = False):
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig

    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=vocab_size, max_position_embeddings=512, rms_norm_eps=1e-6,
                bos_token_id=1, eos_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                 "mrope_section": [2, 3, 3]})
    start, pad, end, video = token_ids
    ids = dict(vision_start_token_id=start, image_token_id=pad, vision_end_token_id=end, video_token_id=video)
    if windowed:  # 56-pixel windows: 2 x 2 merged rows each; blocks 1 and 3 attend the whole image
        vision = dict(depth=4, hidden_size=32, intermediate_size=48, out_hidden_size=64, num_heads=2,
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                      fullatt_block_indexes=[1, 3])
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)
    vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, mlp_ratio=2)
    return Qwen2VLConfig(text_config=text, vision_config=vision, **ids)


def save_tiny_qwen2_vl(path: Path, tokenizer_dir: Path | None = None, seed: int = 0,
                       windowed: bool = False) -> torch.nn.Module:
    """A tiny Qwen2-VL (``windowed``: Qwen2.5-VL) and, with ``tokenizer_dir``, its tokenizer (the
    vision tokens added, ``QWEN2_VL_TEMPLATE``) and image processor (``QWEN2_VL_PIXELS``); returns
    the transformers model. (No ``Qwen2VLProcessor``: transformers builds it only with torchvision,
    for its video processor; ``qwen2_vl_reference`` does what its ``__call__`` does for images.)"""
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessor

    path = Path(path)
    if tokenizer_dir is None:
        tokenizer, vocab, token_ids = None, 128, [124, 125, 126, 127]
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        tokenizer.add_special_tokens({"additional_special_tokens": QWEN2_VL_TOKENS})
        vocab, token_ids = len(tokenizer), tokenizer.convert_tokens_to_ids(QWEN2_VL_TOKENS)
    config = qwen2_vl_config(vocab, token_ids, windowed)
    torch.manual_seed(seed)
    cls = Qwen2_5_VLForConditionalGeneration if windowed else Qwen2VLForConditionalGeneration
    model = cls(config).to(torch.float32).eval()
    _randomize(model, seed)
    model.save_pretrained(path)
    if tokenizer is not None:
        Qwen2VLImageProcessor(patch_size=14, merge_size=2, temporal_patch_size=2,
                              size={"shortest_edge": QWEN2_VL_PIXELS["min_pixels"],
                                    "longest_edge": QWEN2_VL_PIXELS["max_pixels"]}).save_pretrained(path)
        tokenizer.chat_template = QWEN2_VL_TEMPLATE
        tokenizer.save_pretrained(path)
    return model


def qwen2_vl_reference(path: Path, messages: list, images: list) -> dict:
    """Qwen2VLProcessor's inputs for a chat, as its ``__call__`` builds them for images: the
    template's text with each ``<|image_pad|>`` repeated (patches / merge²) times, tokenized; the
    image processor's pixels and grids; ``mm_token_type_ids`` (1 at image tokens)."""
    from transformers import AutoImageProcessor, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    out: dict = {}
    if images:
        processed = AutoImageProcessor.from_pretrained(path)(images=images, return_tensors="pt")
        pieces = text.split("<|image_pad|>")
        assert len(pieces) == len(images) + 1
        counts = [int(g.prod()) // 4 for g in processed["image_grid_thw"]]
        text = pieces[0] + "".join("<|image_pad|>" * n + rest for n, rest in zip(counts, pieces[1:]))
        out.update(pixel_values=processed["pixel_values"], image_grid_thw=processed["image_grid_thw"])
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    image_token = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    out.update(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=(ids == image_token).int())
    return out


# ---- driving a vision-language model in tests ---------------------------------------------------

def attach_cache(model: torch.nn.Module, blocks: int = 64, block_size: int = 4) -> None:
    """A float32 paged KV cache on every attention layer (for ``prefill_logits``)."""
    for attn in model.attention_layers():
        attn.k_cache = torch.zeros(blocks, block_size, attn.num_kv_heads, attn.head_dim)
        attn.v_cache = torch.zeros(blocks, block_size, attn.num_kv_heads, attn.head_dim)


def prefill_logits(model: torch.nn.Module, ids: list[int], rows: torch.Tensor,
                   positions: torch.Tensor | None = None, **forward_kwargs) -> torch.Tensor:
    """The model's logits of one prompt in one chunk (blocks of 4, ``attach_cache``), the encoder
    ``rows`` (all images', in order) written over the image tokens' embeddings; ``positions``
    the rotary positions (default: the indices); ``forward_kwargs`` more of forward's inputs
    (XComposer2's ``image_mask``)."""
    from conveyor.engine.attention_metadata import AttentionMetadata, set_attention_metadata

    n = len(ids)
    meta = AttentionMetadata(slot_mapping=torch.arange(n), block_tables=torch.arange((n + 3) // 4)[None].int(),
                             cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
                             seqlens_k=torch.tensor([n], dtype=torch.int32), max_seqlen_q=n, max_seqlen_k=n)
    ids_t = torch.tensor(ids)
    with torch.no_grad():
        embeds = model.embed_input_ids(ids_t)
        embeds[ids_t == model.image_token_id] = rows
        set_attention_metadata(meta)
        try:
            return model.compute_logits(model(ids_t, torch.arange(n) if positions is None else positions,
                                              inputs_embeds=embeds, **forward_kwargs))
        finally:
            set_attention_metadata(None)


def engine_greedy(path: Path, ids: list[int], images: list, n: int, check_blocks: bool = False,
                  **engine_kw) -> list[int]:
    """``n`` greedy tokens (eos ignored) of one prompt with ``images`` through a tiny CPU engine
    (``tiny_llama.engine``); ``check_blocks``: every KV block back at the end."""
    from tiny_llama import engine

    from conveyor.protocol.sampling import SamplingParams

    eng = engine(path, **engine_kw)
    try:
        eng.add_request(ids, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True), images=images)
        out = []
        while eng.has_work:
            out += [o.token for o in eng.step() if o.token is not None]
        if check_blocks:
            assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
        return out
    finally:
        eng.close()


def write_renamed(src: Path, dest: Path, renames: list[tuple[str, str]]) -> dict:
    """``src``'s model.safetensors with each name's first matching prefix renamed, saved as
    ``dest``/model.safetensors; returns the renamed tensors."""
    from safetensors.torch import load_file, save_file

    renamed = {}
    for name, tensor in load_file(str(Path(src) / "model.safetensors")).items():
        old = next((o for o, _ in renames if name.startswith(o)), None)
        if old is not None:
            name = dict(renames)[old] + name[len(old):]
        renamed[name] = tensor
    Path(dest).mkdir(parents=True, exist_ok=True)
    save_file(renamed, str(Path(dest) / "model.safetensors"))
    return renamed
