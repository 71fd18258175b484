"""Tiny random-weight DeepSeek-VL models in the remote code's layout, and their reference.

DeepSeek-VL has no transformers class of its remote layout, so the reference is built from
transformers' parts: ``SiglipVisionModel`` (the low-res SigLIP: its trunk is timm's ViT that the
remote code runs, exact GELU, eps 1e-6), ``SamVisionEncoder`` (the SAM-B trunk and neck; a second
``SamVisionNeck`` as ``neck_hd``), plain torch for what the remote code adds (the resize to 4x the
low-res grid, the stride-2 convolutions, ``hd_alpha_downsamples``, each tower's normalization, the
low-res resize, the aligner), and ``LlamaForCausalLM`` for the language model. ``save`` writes
those weights under the remote code's names (``vision_model.vision_tower_low.vision_tower.blocks.0
.attn.qkv``, ``...neck.0``, ``aligner.layers.1``, ``language_model.model.*``) with a config.json in
its field names; the geometry keys in the tower params (``width``, ``layers``, ...) are conveyor's
extension for tiny towers.

Geometry: SigLIP 48-pixel images, 16-pixel patches (3 x 3 = 9 rows an image), width 32; SAM
96-pixel images (a 6 x 6 grid: windows of 4, zero-padded to 8), width 32, global blocks 1 and 3,
neck 16 channels, resized to 12 x 12, downsampled by convolutions of 24 and 32 channels to 3 x 3;
a 2-layer Llama of width 64, vocabulary 128, image token 127.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from tiny_vlm import _randomize
from torch import nn

IMAGE_TOKEN = 127
ROWS = 9
LOW, HIGH = 48, 96
CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]


def _siglip_params(select_layer: int = -1, layers: int = 2) -> dict:
    return {"model_name": "siglip_large_patch16_384", "image_size": LOW, "select_feature": "same",
            "select_layer": select_layer, "ckpt_path": "", "pixel_mean": [0.5, 0.5, 0.5], "pixel_std": [0.5, 0.5, 0.5],
            "output_dim": 32, "width": 32, "layers": layers, "heads": 2, "mlp_ratio": 4}


def _sam_params() -> dict:
    return {"model_name": "sam_b_downsample", "image_size": HIGH, "select_feature": "same", "select_layer": -1,
            "ckpt_path": "", "pixel_mean": CLIP_MEAN, "pixel_std": CLIP_STD, "output_dim": 32,
            "width": 32, "layers": 4, "heads": 2, "window_size": 4, "global_attn_indexes": [1, 3],
            "out_chans": 16, "downsample_channels": [24, 32]}


def deepseek_vl_config(hybrid: bool, vocab_size: int = 128, image_token: int | None = IMAGE_TOKEN) -> dict:
    """config.json in the remote code's fields (hybrid: the 7B's towers; else the 1.3B's SigLIP
    alone, read one layer before the last of 3); ``image_token`` None: none named (as published:
    the tokenizer names it)."""
    from transformers import LlamaConfig

    text = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=vocab_size, max_position_embeddings=512, rms_norm_eps=1e-6,
                       bos_token_id=1, eos_token_id=2).to_dict()
    language = {k: text[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                     "num_key_value_heads", "vocab_size", "max_position_embeddings", "rms_norm_eps",
                                     "bos_token_id", "eos_token_id")}
    language["model_type"] = "llama"
    if hybrid:
        vision = {"cls": "HybridVisionTower", "model_type": "vision",
                  "params": {"concat_type": "tuple", "freeze_high": True, "freeze_low": True,
                             "high_res_cfg": _sam_params(), "low_res_cfg": _siglip_params()}}
        aligner = {"depth": 2, "input_dim": 32, "n_embed": 64, "projector_type": "low_high_hybrid_split_mlp_gelu"}
    else:
        vision = {"cls": "CLIPVisionTower", "model_type": "vision", "params": _siglip_params(-2, 3)}
        aligner = {"depth": 2, "input_dim": 32, "n_embed": 64, "projector_type": "mlp_gelu"}
    cfg = {"architectures": ["MultiModalityCausalLM"], "model_type": "multi_modality", "torch_dtype": "float32",
           "language_config": language, "vision_config": vision,
           "aligner_config": {"cls": "MlpProjector", "model_type": "aligner", "params": aligner}}
    if image_token is not None:
        cfg["image_token_id"] = image_token
    return cfg


def _siglip(params: dict):
    from transformers import SiglipVisionConfig, SiglipVisionModel

    layers = params["layers"] + params["select_layer"] + 1
    return SiglipVisionModel(SiglipVisionConfig(
        hidden_size=32, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=2, image_size=LOW,
        patch_size=16, hidden_act="gelu", layer_norm_eps=1e-6, vision_use_head=False))


def _siglip_remote(model) -> dict[str, torch.Tensor]:
    """transformers' SigLIP tensors under timm's names (q, k, v fused into qkv)."""
    # transformers 5.24 keeps the trunk at the top; earlier releases under vision_model.
    sd = {k.removeprefix("vision_model."): v for k, v in model.state_dict().items()}
    out = {"patch_embed.proj.weight": sd["embeddings.patch_embedding.weight"],
           "patch_embed.proj.bias": sd["embeddings.patch_embedding.bias"],
           "pos_embed": sd["embeddings.position_embedding.weight"][None],
           "norm.weight": sd["post_layernorm.weight"], "norm.bias": sd["post_layernorm.bias"],
           "attn_pool.latent": torch.randn(1, 1, 32)}  # the head the remote code builds and never runs
    for i in range(model.config.num_hidden_layers):
        p = f"encoder.layers.{i}."
        for part in ("weight", "bias"):
            out[f"blocks.{i}.norm1.{part}"] = sd[f"{p}layer_norm1.{part}"]
            out[f"blocks.{i}.norm2.{part}"] = sd[f"{p}layer_norm2.{part}"]
            out[f"blocks.{i}.attn.qkv.{part}"] = torch.cat([sd[f"{p}self_attn.{x}_proj.{part}"] for x in "qkv"])
            out[f"blocks.{i}.attn.proj.{part}"] = sd[f"{p}self_attn.out_proj.{part}"]
            out[f"blocks.{i}.mlp.fc1.{part}"] = sd[f"{p}mlp.fc1.{part}"]
            out[f"blocks.{i}.mlp.fc2.{part}"] = sd[f"{p}mlp.fc2.{part}"]
    return out


_NECK = {"conv1.": "0.", "layer_norm1.": "1.", "conv2.": "2.", "layer_norm2.": "3."}


def _neck_remote(sd: dict, prefix: str) -> dict[str, torch.Tensor]:
    return {prefix + _NECK[next(k for k in _NECK if n.startswith(k))] + n.split(".", 1)[1]: t for n, t in sd.items()}


class Reference(nn.Module):
    """The remote DeepSeek-VL computation from transformers' parts and plain torch."""

    def __init__(self, hybrid: bool, seed: int, vocab_size: int = 128, image_token: int | None = IMAGE_TOKEN) -> None:
        super().__init__()
        from transformers import LlamaForCausalLM, SamVisionConfig
        from transformers.models.sam.modeling_sam import SamVisionEncoder, SamVisionNeck

        cfg = deepseek_vl_config(hybrid, vocab_size, image_token)
        self.config, self.hybrid, self.image_token = cfg, hybrid, image_token
        params = cfg["vision_config"]["params"]
        self.siglip = _siglip(params["low_res_cfg"] if hybrid else params)
        if hybrid:
            sam_cfg = SamVisionConfig(hidden_size=32, output_channels=16, num_hidden_layers=4, num_attention_heads=2,
                                      image_size=HIGH, patch_size=16, window_size=4, global_attn_indexes=[1, 3],
                                      mlp_ratio=4.0, layer_norm_eps=1e-6, hidden_act="gelu", use_rel_pos=True,
                                      use_abs_pos=True, qkv_bias=True)
            self.sam = SamVisionEncoder(sam_cfg)
            self.neck_hd = SamVisionNeck(sam_cfg)
            self.downsamples = nn.Sequential(nn.Conv2d(16, 24, 3, 2, 1, bias=False),
                                             nn.Conv2d(24, 32, 3, 2, 1, bias=False))
            self.alpha = nn.Parameter(torch.zeros(1))
            self.high_up_proj, self.low_up_proj = nn.Linear(32, 32), nn.Linear(32, 32)
            self.layers = nn.Sequential(nn.GELU(), nn.Linear(64, 64))
        else:
            self.layers = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64))
        from transformers import LlamaConfig

        self.llama = LlamaForCausalLM(LlamaConfig(**cfg["language_config"]))
        _randomize(self, seed)
        if hybrid:
            with torch.no_grad():
                self.alpha.fill_(0.7)  # the sam_hd branch counts
        self.eval()

    # ---- the computation --------------------------------------------------------------------
    def _sam_rows(self, pixels: torch.Tensor) -> torch.Tensor:
        x = (pixels - torch.tensor(CLIP_MEAN).view(1, 3, 1, 1)) / torch.tensor(CLIP_STD).view(1, 3, 1, 1)
        x = self.sam.patch_embed(x) + self.sam.pos_embed
        first = None
        for i, layer in enumerate(self.sam.layers):
            out = layer(x)
            x = out[0] if isinstance(out, tuple) else out
            if i == 1:
                first = x

        def down(neck: nn.Module, h: torch.Tensor) -> torch.Tensor:
            return self.downsamples(F.interpolate(neck(h), size=(12, 12), mode="bilinear", align_corners=False))

        y = down(self.sam.neck, x) + down(self.neck_hd, first) * self.alpha
        return y.flatten(2).transpose(1, 2)

    def image_rows(self, pixels: torch.Tensor) -> torch.Tensor:
        """[B, 3, S, S] processor pixels -> [B, ROWS, 64] aligned rows."""
        with torch.no_grad():
            low = pixels
            if self.hybrid:
                low = F.interpolate(pixels, size=(LOW, LOW), mode="bilinear", align_corners=False, antialias=True)
            siglip = self.siglip(pixel_values=(low - 0.5) / 0.5).last_hidden_state
            if not self.hybrid:
                return self.layers(siglip)
            x = torch.cat([self.high_up_proj(self._sam_rows(pixels)), self.low_up_proj(siglip)], dim=-1)
            return self.layers(x)

    def embeds(self, ids: list[int], pixels: torch.Tensor | None) -> torch.Tensor:
        t = torch.tensor(ids)
        with torch.no_grad():
            e = self.llama.get_input_embeddings()(t)
            if pixels is not None:
                e[t == self.image_token] = self.image_rows(pixels).flatten(0, 1)
        return e

    def logits(self, ids: list[int], pixels: torch.Tensor | None) -> torch.Tensor:
        with torch.no_grad():
            return self.llama(inputs_embeds=self.embeds(ids, pixels)[None]).logits[0]

    def greedy(self, ids: list[int], pixels: torch.Tensor, n: int) -> list[int]:
        """``n`` greedy tokens, the image rows in the prompt's embeddings (no cache: tiny)."""
        e = self.embeds(ids, pixels)
        out = []
        with torch.no_grad():
            for _ in range(n):
                token = int(self.llama(inputs_embeds=e[None]).logits[0, -1].argmax())
                out.append(token)
                e = torch.cat([e, self.llama.get_input_embeddings()(torch.tensor([token]))])
        return out

    # ---- the checkpoint ---------------------------------------------------------------------
    def remote_state(self) -> dict[str, torch.Tensor]:
        """Every tensor under the remote code's names (with the ones it never runs)."""
        out = {f"language_model.{k}": v for k, v in self.llama.state_dict().items()}
        if self.hybrid:
            low, high = "vision_model.vision_tower_low.vision_tower.", "vision_model.vision_tower_high.vision_tower."
            out.update({low + k: v for k, v in _siglip_remote(self.siglip).items()})
            sam = self.sam.state_dict()
            out[high + "patch_embed.proj.weight"] = sam["patch_embed.projection.weight"]
            out[high + "patch_embed.proj.bias"] = sam["patch_embed.projection.bias"]
            out[high + "pos_embed"] = sam["pos_embed"]
            for name, t in sam.items():
                if name.startswith("layers."):
                    rest = name.split(".", 2)[2].replace("layer_norm1", "norm1").replace("layer_norm2", "norm2")
                    out[f"{high}blocks.{name.split('.')[1]}.{rest}"] = t
            out.update(_neck_remote({k[5:]: v for k, v in sam.items() if k.startswith("neck.")}, high + "neck."))
            out.update(_neck_remote(self.neck_hd.state_dict(), high + "neck_hd."))
            out.update({f"{high}downsamples.{k}": v for k, v in self.downsamples.state_dict().items()})
            out[high + "hd_alpha_downsamples"] = self.alpha.detach().clone()
            for side in ("high", "low"):  # built by the remote HybridVisionTower, never run
                out[f"vision_model.{side}_layer_norm.weight"] = torch.ones(32)
                out[f"vision_model.{side}_layer_norm.bias"] = torch.zeros(32)
            for proj in ("high_up_proj", "low_up_proj"):
                out.update({f"aligner.{proj}.{k}": v for k, v in getattr(self, proj).state_dict().items()})
        else:
            out.update({f"vision_model.vision_tower.{k}": v for k, v in _siglip_remote(self.siglip).items()})
        out.update({f"aligner.layers.{k}": v for k, v in self.layers.state_dict().items()})
        return {k: v.detach().contiguous().clone() for k, v in out.items()}


def save_tiny_deepseek_vl(path: Path, hybrid: bool = True, seed: int = 0, vocab_size: int = 128,
                          image_token: int | None = IMAGE_TOKEN) -> Reference:
    """Write a tiny DeepSeek-VL (config.json, model.safetensors) to ``path``; return its reference
    (``image_token``: the id its rows replace, written to config.json unless None)."""
    from safetensors.torch import save_file

    ref = Reference(hybrid, seed, vocab_size, image_token)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(ref.config))
    save_file(ref.remote_state(), str(path / "model.safetensors"))
    return ref
