"""Tiny random-weight InternVL models saved by transformers, for tests against it.

``save_tiny_internvl`` writes an ``InternVLForConditionalGeneration`` (the ``-hf`` layout: a
3-layer InternViT on 28-pixel tiles of 7-pixel patches, pixel-shuffled 2x2 into 4 rows a tile,
before a 2-layer Qwen2 or Llama of width 64) in float32 with ``save_pretrained``; given a
tokenizer directory (the default model's), it adds InternVL's ``<img>`` / ``</img>`` /
``<IMG_CONTEXT>`` tokens, sizes the vocabulary to them, and saves the tokenizer and GotOcr2's
tiling image processor beside the weights (``internvl_processor`` builds transformers'
``InternVLProcessor`` over them).

``save_remote_internvl`` rewrites such a directory as OpenGVLab's remote-code layout
(``InternVLChatModel``): its config.json written by hand with the published field names, the
tower's and projector's tensors renamed (``vision_model.*`` with a fused ``qkv``, ``mlp1.*``),
and, for a Llama language model, InternLM2's names (``tok_embeddings``, a packed ``wqkv``,
``output``) as InternVL2.5-8B's checkpoint has them: the same numbers in the other layout.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

TILE, PATCH, ROWS_PER_TILE = 28, 7, 4
MAX_TILES = 6
IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
INTERNVL_TOKENS = ["<img>", "</img>", "<IMG_CONTEXT>"]
# InternVL3-hf's template, shortened: ChatML, <IMG_CONTEXT> and a newline for an image part.
INTERNVL_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}<IMG_CONTEXT>\n"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# The remote repositories' tokenizer template: ChatML over string contents only.
REMOTE_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def internvl_config(vocab_size: int, image_token: int, text: str = "qwen2", feature_layer: int = -1,
                    **vision_kwargs):
    from transformers import InternVLConfig

    text_config = dict(model_type=text, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab_size,
                       max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                       tie_word_embeddings=False)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                  image_size=TILE, patch_size=PATCH, attention_bias=True, layer_scale_init_value=0.1)
    vision.update(vision_kwargs)
    return InternVLConfig(text_config=text_config, vision_config=vision, image_token_id=image_token,
                          image_seq_length=ROWS_PER_TILE, downsample_ratio=0.5, vision_feature_layer=feature_layer,
                          tie_word_embeddings=False)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Norm scales near 1, everything else 0.1 * N(0, 1) (layer scales too, so that every
    branch counts): logits that tell models apart."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            is_norm = "norm" in name and name.endswith("weight")
            param.copy_(1 + 0.1 * noise if is_norm else (0.5 + 0.1 * noise if "lambda" in name else 0.1 * noise))


def _tokenizer(tokenizer_dir: Path | None):
    """(the tokenizer of ``tokenizer_dir`` with InternVL's tokens added, its size, <IMG_CONTEXT>'s
    id); without a directory (None, 128, 127)."""
    if tokenizer_dir is None:
        return None, 128, 127
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, extra_special_tokens={
        "start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
        "video_token": "<video>"})
    tokenizer.add_special_tokens({"additional_special_tokens": [*INTERNVL_TOKENS, "<video>"]})
    return tokenizer, len(tokenizer), tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>")


def image_processor():
    """GotOcr2's tiling processor as InternVL's -hf repositories configure it, at ``TILE`` pixels."""
    try:
        from transformers import GotOcr2ImageProcessorPil as cls
    except ImportError:  # transformers < 5.20: the PIL processor had the plain name
        from transformers import GotOcr2ImageProcessor as cls
    return cls(size={"height": TILE, "width": TILE}, crop_to_patches=True, min_patches=1, max_patches=MAX_TILES,
               image_mean=IMAGENET_MEAN, image_std=IMAGENET_STD)


def save_tiny_internvl(path: Path, tokenizer_dir: Path | None = None, seed: int = 0, text: str = "qwen2",
                       feature_layer: int = -1, **vision_kwargs) -> torch.nn.Module:
    """Write a tiny -hf InternVL (and, with ``tokenizer_dir``, its tokenizer and processor) to
    ``path``; returns the transformers model."""
    from transformers import InternVLForConditionalGeneration

    path = Path(path)
    tokenizer, vocab, image_token = _tokenizer(tokenizer_dir)
    config = internvl_config(vocab, image_token, text, feature_layer, **vision_kwargs)
    torch.manual_seed(seed)
    model = InternVLForConditionalGeneration(config).to(torch.float32).eval()
    _randomize(model, seed)
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.chat_template = INTERNVL_TEMPLATE
        tokenizer.save_pretrained(path)
        image_processor().save_pretrained(path)
    return model


def internvl_processor(path: Path):
    """transformers' ``InternVLProcessor`` over ``path``'s tokenizer and image processor. Built
    without a video processor, which needs torchvision (absent here): the class check that
    would import one is skipped, images do not need it."""
    from unittest import mock

    from transformers import AutoImageProcessor, AutoTokenizer, InternVLProcessor
    from transformers.processing_utils import ProcessorMixin

    tokenizer = AutoTokenizer.from_pretrained(path)
    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: type(arg)):
        return InternVLProcessor(image_processor=AutoImageProcessor.from_pretrained(path), tokenizer=tokenizer,
                                 image_seq_length=ROWS_PER_TILE, chat_template=INTERNVL_TEMPLATE)


# transformers' InternViT / projector names -> the remote code's (after the layout prefix).
_VISION_TO_REMOTE = (
    ("embeddings.cls_token", "embeddings.class_embedding"),
    ("embeddings.patch_embeddings.projection.", "embeddings.patch_embedding."),
    ("embeddings.position_embeddings", "embeddings.position_embedding"),
    (".attention.projection_layer.", ".attn.proj."),
    (".attention.q_norm.", ".attn.q_norm."),
    (".attention.k_norm.", ".attn.k_norm."),
    (".layernorm_before.", ".norm1."),
    (".layernorm_after.", ".norm2."),
    (".lambda_1", ".ls1"),
    (".lambda_2", ".ls2"),
)
_LLAMA_TO_INTERNLM2 = (
    ("model.embed_tokens.", "model.tok_embeddings."),
    (".self_attn.o_proj.", ".attention.wo."),
    (".mlp.gate_proj.", ".feed_forward.w1."),
    (".mlp.up_proj.", ".feed_forward.w3."),
    (".mlp.down_proj.", ".feed_forward.w2."),
    (".input_layernorm.", ".attention_norm."),
    (".post_attention_layernorm.", ".ffn_norm."),
    ("lm_head.", "output."),
)


def _remote_tensors(tensors: dict[str, torch.Tensor], heads: int, kv_heads: int, internlm2: bool):
    out: dict[str, torch.Tensor] = {}
    qkv: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        for old in ("model.", ""):  # transformers 5 nests the parts in model.; 4.x did not
            if name.startswith(f"{old}vision_tower."):
                rest = name[len(f"{old}vision_tower."):].replace("encoder.layer.", "encoder.layers.")
                for a, b in _VISION_TO_REMOTE:
                    rest = rest.replace(a, b)
                if ".attention." in rest:  # q/k/v, fused below
                    key, part = rest.rsplit(".attention.", 1)
                    proj, kind = part.split(".")
                    qkv.setdefault(f"vision_model.{key}.attn.qkv.{kind}", {})[proj] = tensor
                else:
                    out[f"vision_model.{rest}"] = tensor
                break
            if name.startswith(f"{old}multi_modal_projector."):
                rest = name[len(f"{old}multi_modal_projector."):]
                for a, b in (("layer_norm.", "0."), ("linear_1.", "1."), ("linear_2.", "3.")):
                    rest = rest.replace(a, b)
                out[f"mlp1.{rest}"] = tensor
                break
        else:
            rest = name.replace("model.language_model.", "model.", 1).replace("language_model.model.", "model.", 1)
            rest = rest.replace("language_model.lm_head.", "lm_head.", 1)
            out[f"language_model.{rest}"] = tensor
    for name, parts in qkv.items():
        out[name] = torch.cat([parts["q_proj"], parts["k_proj"], parts["v_proj"]])
    if internlm2:
        out = _as_internlm2(out, heads, kv_heads)
    return out


def _as_internlm2(tensors: dict[str, torch.Tensor], heads: int, kv_heads: int) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    packed: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        if not name.startswith("language_model."):
            out[name] = tensor
            continue
        if ".self_attn." in name and any(f".{p}_proj." in name for p in "qkv"):
            layer, part = name.split(".self_attn.")
            packed.setdefault(f"{layer}.attention.wqkv.weight", {})[part[0]] = tensor
            continue
        for a, b in _LLAMA_TO_INTERNLM2:
            name = name.replace(a, b)
        out[name] = tensor
    for name, parts in packed.items():
        q, k, v = parts["q"], parts["k"], parts["v"]
        dim = k.shape[0] // kv_heads
        q = q.view(kv_heads, heads // kv_heads, dim, -1)
        out[name] = torch.cat([q, k.view(kv_heads, 1, dim, -1), v.view(kv_heads, 1, dim, -1)], dim=1).reshape(
            -1, q.shape[-1])
    return out


def save_remote_internvl(hf_dir: Path, path: Path, ps_version: str = "v2") -> None:
    """``hf_dir``'s tiny InternVL rewritten as the remote-code layout in ``path`` (a Llama language
    model becomes InternLM2, as in InternVL2.5-8B); its tokenizer files copied when there are any,
    else a tokenizer_config.json naming <IMG_CONTEXT> (the id the engine reads from there)."""
    from safetensors.torch import load_file, save_file

    hf_dir, path = Path(hf_dir), Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf = json.loads((hf_dir / "config.json").read_text())
    text, vision = hf["text_config"], hf["vision_config"]
    internlm2 = text["model_type"] == "llama"
    llm = {key: text[key] for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                      "num_hidden_layers", "vocab_size", "rms_norm_eps", "max_position_embeddings",
                                      "bos_token_id", "eos_token_id", "tie_word_embeddings")}
    rope = text.get("rope_parameters") or {}
    llm["rope_theta"] = rope.get("rope_theta", text.get("rope_theta", 10000.0))
    llm["torch_dtype"] = "float32"
    if internlm2:
        llm.update(architectures=["InternLM2ForCausalLM"], model_type="internlm2", bias=False, rope_scaling=None,
                   auto_map={"AutoConfig": "configuration_internlm2.InternLM2Config"}, attn_implementation="eager")
    else:
        llm.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=False)
    # InternVL2_5's config.json, field for field (the tiny sizes aside)
    config = {
        "_commit_hash": None, "architectures": ["InternVLChatModel"],
        "auto_map": {"AutoConfig": "configuration_internvl_chat.InternVLChatConfig",
                     "AutoModel": "modeling_internvl_chat.InternVLChatModel",
                     "AutoModelForCausalLM": "modeling_internvl_chat.InternVLChatModel"},
        "downsample_ratio": hf["downsample_ratio"], "dynamic_image_size": True, "force_image_size": TILE,
        "llm_config": llm, "max_dynamic_patch": MAX_TILES, "min_dynamic_patch": 1, "model_type": "internvl_chat",
        "ps_version": ps_version, "select_layer": hf["vision_feature_layer"], "template": "internvl2_5",
        "torch_dtype": "float32",
        "use_backbone_lora": 0, "use_llm_lora": 0, "use_thumbnail": True,
        "vision_config": {
            "architectures": ["InternVisionModel"], "attention_dropout": 0.0, "drop_path_rate": 0.0, "dropout": 0.0,
            "hidden_act": vision["hidden_act"], "hidden_size": vision["hidden_size"], "image_size": TILE,
            "initializer_factor": 1.0, "initializer_range": 0.02, "intermediate_size": vision["intermediate_size"],
            "layer_norm_eps": vision["layer_norm_eps"], "model_type": "intern_vit_6b", "norm_type": vision["norm_type"],
            "num_attention_heads": vision["num_attention_heads"], "num_channels": 3,
            "num_hidden_layers": vision["num_hidden_layers"], "patch_size": PATCH,
            "qk_normalization": vision["use_qk_norm"], "qkv_bias": vision["attention_bias"], "torch_dtype": "float32",
            "use_flash_attn": True}}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    tensors = _remote_tensors(load_file(str(hf_dir / "model.safetensors")), text["num_attention_heads"],
                              text["num_key_value_heads"], internlm2)
    save_file(tensors, str(path / "model.safetensors"))
    copied = False
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt"):
        if (hf_dir / name).is_file():
            shutil.copy(hf_dir / name, path / name)
            copied = True
    if copied:
        tok = json.loads((path / "tokenizer_config.json").read_text())
        tok["chat_template"] = REMOTE_TEMPLATE
        (path / "tokenizer_config.json").write_text(json.dumps(tok))
        (path / "chat_template.jinja").unlink(missing_ok=True)
    else:
        (path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {
            "125": {"content": "<img>", "special": True}, "126": {"content": "</img>", "special": True},
            "127": {"content": "<IMG_CONTEXT>", "special": True}}}))
