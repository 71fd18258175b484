"""A tiny random-weight InternLM-XComposer2 checkpoint in the published layout (no transformers
class exists: the remote code's names, written by hand).

``save_tiny_xcomposer2`` writes config.json (a flat InternLM2 config with ``img_size``, as the
published one; plus ``vision_config`` and ``plora_rank``, conveyor's test-only keys that shrink
the hard-coded CLIP ViT-L and rank 256) and model.safetensors with ``vit.vision_tower.*``,
``vision_proj.{0,2}.*``, ``model.*``, ``output.weight`` and each linear's ``Plora_A`` /
``Plora_B``: a 2-layer InternLM2 of width 64 after a 2-layer CLIP tower on 28x28 images (14-pixel
patches: 4 image rows a picture).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

SIDE, PATCH = 28, 14
ROWS = (SIDE // PATCH) ** 2
VOCAB, IMAGE_TOKEN = 128, 0
TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": VOCAB, "rms_norm_eps": 1e-5, "rope_theta": 1000000,
        "max_position_embeddings": 512}
VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
RANK = 8


def xcomposer2_config(**change) -> dict:
    """internlm-xcomposer2-vl-7b's config.json, sized down (test-only keys: vision_config, plora_rank)."""
    cfg = {"architectures": ["InternLMXComposer2ForCausalLM"], "model_type": "internlmxcomposer2",
           "auto_map": {"AutoConfig": "configuration_internlm_xcomposer2.InternLMXcomposer2Config",
                        "AutoModel": "modeling_internlm_xcomposer2.InternLMXComposer2ForCausalLM",
                        "AutoModelForCausalLM": "modeling_internlm_xcomposer2.InternLMXComposer2ForCausalLM"},
           "bias": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "hidden_act": "silu",
           "initializer_range": 0.02, "max_length": 4096, "rope_scaling": None, "tie_word_embeddings": False,
           "torch_dtype": "float32", "use_cache": True, "img_size": SIDE, **TEXT,
           "vision_config": VISION, "plora_rank": RANK}
    cfg.update(change)
    return cfg


def tiny_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """The published names -> random float32 tensors (norm scales near 1, the rest 0.1 · N(0, 1))."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, norm: bool = False) -> torch.Tensor:
        noise = 0.1 * torch.randn(*shape, generator=gen)
        return 1 + noise if norm else noise

    t: dict[str, torch.Tensor] = {}
    vh, vi, positions = VISION["hidden_size"], VISION["intermediate_size"], ROWS + 1
    v = "vit.vision_tower.vision_model."
    t[v + "embeddings.class_embedding"] = rand(vh)
    t[v + "embeddings.patch_embedding.weight"] = rand(vh, 3, PATCH, PATCH)
    t[v + "embeddings.position_embedding.weight"] = rand(positions, vh)
    t[v + "embeddings.position_ids"] = torch.arange(positions)[None]
    for norm in ("pre_layrnorm", "post_layernorm"):
        t[f"{v}{norm}.weight"], t[f"{v}{norm}.bias"] = rand(vh, norm=True), rand(vh)
    for i in range(VISION["num_hidden_layers"]):
        p = f"{v}encoder.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            t[f"{p}self_attn.{proj}.weight"], t[f"{p}self_attn.{proj}.bias"] = rand(vh, vh), rand(vh)
        for norm in ("layer_norm1", "layer_norm2"):
            t[f"{p}{norm}.weight"], t[f"{p}{norm}.bias"] = rand(vh, norm=True), rand(vh)
        t[p + "mlp.fc1.weight"], t[p + "mlp.fc1.bias"] = rand(vi, vh), rand(vi)
        t[p + "mlp.fc2.weight"], t[p + "mlp.fc2.bias"] = rand(vh, vi), rand(vh)
    h, inter = TEXT["hidden_size"], TEXT["intermediate_size"]
    t["vision_proj.0.weight"], t["vision_proj.0.bias"] = rand(h, vh), rand(h)
    t["vision_proj.2.weight"], t["vision_proj.2.bias"] = rand(h, h), rand(h)
    heads, kv = TEXT["num_attention_heads"], TEXT["num_key_value_heads"]
    d = h // heads
    t["model.tok_embeddings.weight"] = rand(VOCAB, h)
    linears = {"attention.wqkv": (h, (heads + 2 * kv) * d), "attention.wo": (heads * d, h),
               "feed_forward.w1": (h, inter), "feed_forward.w3": (h, inter), "feed_forward.w2": (inter, h)}
    for i in range(TEXT["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "attention_norm.weight"], t[p + "ffn_norm.weight"] = rand(h, norm=True), rand(h, norm=True)
        for name, (n_in, n_out) in linears.items():
            t[f"{p}{name}.weight"] = rand(n_out, n_in)
            t[f"{p}{name}.Plora_A.weight"] = rand(RANK, n_in)
            t[f"{p}{name}.Plora_B.weight"] = rand(n_out, RANK)
    t["model.norm.weight"] = rand(h, norm=True)
    t["output.weight"] = rand(VOCAB, h)
    return t


def save_tiny_xcomposer2(path: Path, seed: int = 0, drop: tuple[str, ...] = (), extra: dict | None = None,
                         **config_change) -> dict[str, torch.Tensor]:
    """Write config.json and model.safetensors to ``path`` (``drop``: names left out; ``extra``:
    tensors added); returns the tensors."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v for k, v in tiny_tensors(seed).items() if k not in drop}
    tensors.update(extra or {})
    (path / "config.json").write_text(json.dumps(xcomposer2_config(**config_change)))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return tensors
