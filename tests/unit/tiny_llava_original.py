"""Tiny checkpoints in the original LLaVA repository's layout (liuhaotian's ``LlavaLlamaForCausalLM``)
and Yi-VL's, converted from ``tiny_vlm``'s transformers models, for tests against transformers on
the same weights.

``save_original_llava(path, kind)`` writes, for ``kind``:

- ``"1.5"``: config.json's Llama fields at top level plus ``mm_*`` (``pad``, ``mlp2x_gelu``), the
  language model as ``model.*`` / ``lm_head.*``, the projector as ``model.mm_projector.{0,2}.*``,
  and NO tower: it lies in a separate CLIPVisionModel directory (``<path>-clip``: config.json,
  weights, preprocessor_config.json) that ``mm_vision_tower`` names by its full path, as a
  downloaded ``openai/clip-vit-large-patch14-336`` would be;
- ``"1.6"``: LLaVA-NeXT's weights with the tower inside (``model.vision_tower.vision_tower.*``) and
  ``model.image_newline``; ``anyres`` / ``spatial_unpad``, the canvases as the original's
  ``[width, height]``; ``mm_vision_tower`` ``./clip``, a folder of the model's with the tower's
  config and processor only;
- ``"yi"``: Yi-VL's layout: ``mlp2x_gelu_Norm`` (Linear, LayerNorm, GELU, Linear, LayerNorm as
  ``model.mm_projector.{0,1,3,4}``, random), the tower in ``./vit/clip-tiny-448`` with its own
  weights, as 01-ai/Yi-VL-6B ships it.

It returns the transformers model (for Yi-VL, its tower and language model are the reference;
the projector's tensors are in ``yi_projector``). With a ``tokenizer_dir`` the tokenizer is saved
beside the weights WITHOUT an image token, as these repositories' tokenizers are.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tiny_vlm import IMAGE_SIZE, NEXT_PINPOINTS, _randomize, llava_config

# hf in-memory name prefixes (transformers 5; 4.x's too) -> (part, original prefix)
_RENAMES = (
    ("model.language_model.", "text", "model."), ("language_model.model.", "text", "model."),
    ("language_model.lm_head.", "text", "lm_head."), ("lm_head.", "text", "lm_head."),
    ("model.vision_tower.vision_model.", "tower", "vision_model."), ("model.vision_tower.", "tower", "vision_model."),
    ("vision_tower.vision_model.", "tower", "vision_model."), ("vision_tower.", "tower", "vision_model."),
    ("model.multi_modal_projector.linear_1.", "text", "model.mm_projector.0."),
    ("model.multi_modal_projector.linear_2.", "text", "model.mm_projector.2."),
    ("multi_modal_projector.linear_1.", "text", "model.mm_projector.0."),
    ("multi_modal_projector.linear_2.", "text", "model.mm_projector.2."),
    ("model.image_newline", "text", "model.image_newline"), ("image_newline", "text", "model.image_newline"),
)
YI_PLACEHOLDER = "<image_placeholder>"


def _split(model: torch.nn.Module) -> tuple[dict, dict]:
    """(the checkpoint's tensors in the original names, the tower's as a CLIPVisionModel's)."""
    main, tower = {}, {}
    for name, tensor in model.state_dict().items():
        prefix, part, new = next(r for r in _RENAMES if name.startswith(r[0]))
        (main if part == "text" else tower)[new + name[len(prefix):]] = tensor.contiguous().clone()
    return main, tower


def _save_tower(directory: Path, vision_config, weights: dict | None) -> None:
    from transformers import CLIPImageProcessor

    directory.mkdir(parents=True, exist_ok=True)
    cfg = {**vision_config.to_dict(), "architectures": ["CLIPVisionModel"], "model_type": "clip_vision_model"}
    (directory / "config.json").write_text(json.dumps(cfg))
    CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                       crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(directory)
    if weights is not None:
        save_file(weights, str(directory / "model.safetensors"))


def yi_projector(vision_width: int, text_width: int, seed: int) -> dict[str, torch.Tensor]:
    """Random Yi-VL projector tensors (LayerNorm scales near 1), under ``model.mm_projector.``."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for index, (rows, cols) in ((0, (text_width, vision_width)), (3, (text_width, text_width))):
        out[f"model.mm_projector.{index}.weight"] = 0.1 * torch.randn(rows, cols, generator=gen)
        out[f"model.mm_projector.{index}.bias"] = 0.1 * torch.randn(rows, generator=gen)
    for index in (1, 4):
        out[f"model.mm_projector.{index}.weight"] = 1 + 0.1 * torch.randn(text_width, generator=gen)
        out[f"model.mm_projector.{index}.bias"] = 0.1 * torch.randn(text_width, generator=gen)
    return out


def save_original_llava(path: Path, kind: str, seed: int = 0, tokenizer_dir: Path | None = None):
    """Write a tiny ``kind`` ("1.5", "1.6", "yi") checkpoint to ``path``; returns the transformers
    model (and, for "yi", the projector's tensors: ``(model, projector)``)."""
    from transformers import LlavaForConditionalGeneration, LlavaNextConfig, LlavaNextForConditionalGeneration

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer, vocab = None, 128
    if tokenizer_dir is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        vocab = len(tokenizer) + 1  # the transformers model's own image token, after the vocabulary
    base = llava_config(vocab, vocab - 1)
    torch.manual_seed(seed)
    if kind == "1.6":
        config = LlavaNextConfig(text_config=base.text_config, vision_config=base.vision_config,
                                 image_token_id=vocab - 1, image_grid_pinpoints=NEXT_PINPOINTS,
                                 vision_feature_select_strategy="default", vision_feature_layer=-2)
        model = LlavaNextForConditionalGeneration(config)
    else:
        model = LlavaForConditionalGeneration(base)
    model = model.to(torch.float32).eval()
    _randomize(model, seed)
    main, tower = _split(model)
    fields = {**base.text_config.to_dict(), "architectures": ["LlavaLlamaForCausalLM"], "model_type": "llava",
              "torch_dtype": "float32", "mm_hidden_size": base.vision_config.hidden_size,
              "mm_vision_select_layer": -2, "mm_vision_select_feature": "patch", "mm_projector_type": "mlp2x_gelu",
              "mm_use_im_start_end": False, "mm_use_im_patch_token": False, "mm_patch_merge_type": "flat",
              "image_aspect_ratio": "pad", "use_mm_proj": True}
    projector = None
    if kind == "1.5":
        fields["mm_vision_tower"] = str(path.parent / f"{path.name}-clip")
        _save_tower(Path(fields["mm_vision_tower"]), base.vision_config, tower)
    elif kind == "1.6":
        fields.update(mm_vision_tower="./clip", image_aspect_ratio="anyres", mm_patch_merge_type="spatial_unpad",
                      image_grid_pinpoints=[[w, h] for h, w in NEXT_PINPOINTS])
        _save_tower(path / "clip", base.vision_config, None)
        main.update({f"model.vision_tower.vision_tower.{k}": v for k, v in tower.items()})
    elif kind == "yi":
        fields.update(mm_vision_tower="./vit/clip-tiny-448", mm_projector_type="mlp2x_gelu_Norm")
        _save_tower(path / "vit" / "clip-tiny-448", base.vision_config, tower)
        main = {k: v for k, v in main.items() if not k.startswith("model.mm_projector.")}
        projector = yi_projector(base.vision_config.hidden_size, base.text_config.hidden_size, seed)
        main.update(projector)
    else:
        raise ValueError(kind)
    save_file(main, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(fields))
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return (model, projector) if kind == "yi" else model
