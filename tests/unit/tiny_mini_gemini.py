"""A tiny Mini-Gemini checkpoint (dvlab-research/MGM's ``MGMLlamaForCausalLM`` layout), built on
``tiny_llava_original``'s LLaVA 1.5 checkpoint, for tests against transformers and plain torch.

``save_mini_gemini(path)`` writes the 1.5 checkpoint (the CLIP tower in ``<path>-clip``), then adds:

- the aux tower: a random transformers ``ConvNextModel`` (``AUX_WIDTHS`` / ``AUX_DEPTHS``) renamed
  into the original's ``model.vision_tower_aux.vision_stem.*`` / ``vision_stages.*`` (timm's
  names), its final LayerNorm left out as MGM leaves it, and its config.json in ``./convnext-aux``
  (which ``mm_vision_tower_aux`` names);
- the mining projectors ``model.vlm_uni_{query,aux,val}_projector.{0,1}.*`` (random);
- config.json's MGM fields (``image_size_aux`` ``AUX_SIZE``, ``mm_hidden_size_aux``, ``image_grid`` 1).

It returns (the transformers LLaVA model, the ConvNextModel, the mining projectors' tensors).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tiny_llava_original import save_original_llava
from tiny_vlm import _randomize

AUX_WIDTHS, AUX_DEPTHS, AUX_SIZE = [8, 16, 24, 32], [1, 1, 2, 1], 64
UNI = ("vlm_uni_query_projector", "vlm_uni_aux_projector", "vlm_uni_val_projector")
# transformers' ConvNext names -> timm's, as the MGM checkpoint holds them
_BLOCK = {"dwconv": "conv_dw", "layernorm": "norm", "pwconv1": "mlp.fc1", "pwconv2": "mlp.fc2"}


def _timm_name(name: str) -> str | None:
    """A ConvNextModel tensor's name in timm's trunk (``stem.*`` / ``stages.*``); None for the final norm."""
    if name.startswith("layernorm."):
        return None
    if name.startswith("embeddings.patch_embeddings."):
        return "stem.0." + name.rsplit(".", 1)[1]
    if name.startswith("embeddings.layernorm."):
        return "stem.1." + name.rsplit(".", 1)[1]
    match = re.match(r"^encoder\.stages\.(\d+)\.downsampling_layer\.(\d)\.(\w+)$", name)
    if match:
        return f"stages.{match[1]}.downsample.{match[2]}.{match[3]}"
    match = re.match(r"^encoder\.stages\.(\d+)\.layers\.(\d+)\.layer_scale_parameter$", name)
    if match:
        return f"stages.{match[1]}.blocks.{match[2]}.gamma"
    match = re.match(r"^encoder\.stages\.(\d+)\.layers\.(\d+)\.(\w+)\.(\w+)$", name)
    return f"stages.{match[1]}.blocks.{match[2]}.{_BLOCK[match[3]]}.{match[4]}"


def convnext_as_trunk(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A ConvNextModel's tensors in timm's trunk names (``stem.*``, ``stages.*``), final LayerNorm dropped."""
    return {new: t.contiguous().clone() for name, t in model.state_dict().items()
            if (new := _timm_name(name)) is not None}


def uni_projectors(clip_width: int, aux_width: int, seed: int) -> dict[str, torch.Tensor]:
    """Random ``model.vlm_uni_*_projector.{0,1}`` tensors (LayerNorm scales near 1)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name in UNI:
        width_in = clip_width if name == UNI[0] else aux_width
        out[f"model.{name}.0.weight"] = 1 + 0.1 * torch.randn(width_in, generator=gen)
        out[f"model.{name}.0.bias"] = 0.1 * torch.randn(width_in, generator=gen)
        out[f"model.{name}.1.weight"] = 0.1 * torch.randn(clip_width, width_in, generator=gen)
        out[f"model.{name}.1.bias"] = 0.1 * torch.randn(clip_width, generator=gen)
    return out


def save_mini_gemini(path: Path, seed: int = 0, aux_in_checkpoint: bool = True):
    """Write the tiny checkpoint to ``path``; returns (LLaVA model, ConvNextModel, mining tensors).
    ``aux_in_checkpoint`` False: the aux tower lies in ``./convnext-aux`` as open_clip's
    ``visual.trunk.*`` instead."""
    from transformers import ConvNextConfig, ConvNextModel

    path = Path(path)
    hf = save_original_llava(path, "1.5", seed=seed)
    torch.manual_seed(seed + 1)
    aux_config = ConvNextConfig(hidden_sizes=AUX_WIDTHS, depths=AUX_DEPTHS, num_channels=3)
    convnext = ConvNextModel(aux_config).to(torch.float32).eval()
    _randomize(convnext, seed + 1)
    clip_width = hf.config.vision_config.hidden_size
    uni = uni_projectors(clip_width, sum(AUX_WIDTHS), seed + 2)
    weights = load_file(str(path / "model.safetensors"))
    trunk = convnext_as_trunk(convnext)
    weights.update(uni)
    aux_dir = path / "convnext-aux"
    aux_dir.mkdir()
    (aux_dir / "config.json").write_text(json.dumps(aux_config.to_dict()))
    if aux_in_checkpoint:
        weights.update({"model.vision_tower_aux.vision_" + k: v for k, v in trunk.items()})
    else:
        openclip = {"visual.trunk." + k: v for k, v in trunk.items()}
        openclip["visual.head.proj.weight"] = torch.zeros(2, 2)  # open_clip's other tensors, ignored
        save_file(openclip, str(aux_dir / "open_clip_model.safetensors"))
    save_file(weights, str(path / "model.safetensors"))
    fields = json.loads((path / "config.json").read_text())
    fields.update(architectures=["MGMLlamaForCausalLM"], model_type="mgm", mm_vision_tower_aux="./convnext-aux",
                  image_size_aux=AUX_SIZE, mm_hidden_size_aux=sum(AUX_WIDTHS), image_grid=1, image_global=False,
                  optimize_vision_tower_aux=False)
    (path / "config.json").write_text(json.dumps(fields))
    return hf, convnext, uni
