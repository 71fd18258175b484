"""InternLM-XComposer2 (internlm-xcomposer2-vl-7b, -7b): CLIP ViT-L/14, a two-layer projector, and
InternLM2 with Partial LoRA on the image rows.

Remote code (``InternLMXComposer2ForCausalLM``, model_type ``internlmxcomposer2``) with a flat
config.json: InternLM2's fields at the top level, ``img_size`` the square side every image is
resized to (490 for -vl-7b, whose tower's 24x24 CLIP positions were interpolated to 35x35 before
it was saved: the checkpoint holds the interpolated table). The tower is CLIP ViT-L/14 (its config
is hard-coded in the remote ``build_mlp.py``: width 1024, 24 layers, 16 heads, quick-GELU); an
image's rows are the last layer's patch states (``select_layer`` -1, CLS dropped, no post-norm),
through ``vision_proj`` (Linear -> GELU -> Linear): ``(img_size / 14)²`` rows, 1225 at 490.

Partial LoRA (``layers/plora.py``): each linear of the language model adds a rank-256 delta
(``lora_alpha`` 256: scaling 1, both fixed in the remote code) on the image rows only, so the
language model must know which rows of a step are image rows: ``forward``'s ``image_mask``.

Weights: ``vit.vision_tower.*`` (transformers' CLIP names), ``vision_proj.{0,2}.*``, ``model.*`` /
``output.*`` (InternLM2's), and ``model.layers.N.{attention.wqkv, attention.wo, feed_forward.w1,
feed_forward.w2, feed_forward.w3}.Plora_{A,B}.weight``.

The image placeholder: the remote code splices the image's rows where ``<ImageHere>`` stands in
the text, with no token of its own; here the tokenizer stage writes InternLM2's ``<unk>`` (id 0,
never in a chat's text) once per row (``services/tokenizer/xcomposer2_images.py``).

Not supported: -4khd-7b and XComposer2.5 (their HD tiling, ``plora_glb_GN`` / ``plora_sub_GN``
separators, ``hd_num``), refused by name; tensor parallel (the adapters are not split: tp=1).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from ...protocol.errors import UnsupportedModelError
from ..layers.plora import ImageRows, PartialLoRA
from ..layers.vision import ClipVisionModel
from ..model_config import ModelConfig
from ..weight_loader import materialize
from .internlm2 import unpack_wqkv
from .vision_language import VisionLanguageModel, build_language_model, refuse_quantized

# CLIP ViT-L/14 (openai/clip-vit-large-patch14-336), as the remote build_mlp.py loads it.
CLIP_L14 = {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096,
            "patch_size": 14, "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5}
# the remote PLoRA's rank and alpha (modeling_internlm2.py passes lora_r=256, lora_alpha=256)
PLORA_RANK, PLORA_ALPHA = 256, 256
# checkpoint linear -> (our adapter, its part: None for a whole linear, else the part's index)
_PLORA_LINEARS = {"attention.wqkv": ("qkv", None), "attention.wo": ("o", None),
                  "feed_forward.w1": ("gate_up", 0), "feed_forward.w3": ("gate_up", 1),
                  "feed_forward.w2": ("down", None)}
# what marks the HD (4KHD / 2.5) variants, in config.json and in the weights
_HD_KEYS = ("hd_num",)
_HD_TENSORS = ("plora_glb_GN", "plora_sub_GN")


def refuse_hd(what: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"InternLM-XComposer2-4KHD / XComposer2.5 ({what}) is not supported: their high-resolution tiling "
        "(sub-images with learned separators) is not implemented; serve internlm-xcomposer2-vl-7b or -7b")


class XComposer2Adapters(nn.Module):
    """One decoder layer's Partial LoRA adapters (qkv, o, gate_up, down), hooked onto its linears."""

    def __init__(self, layer: nn.Module, config: ModelConfig, rank: int, scaling: float, rows: ImageRows) -> None:
        super().__init__()
        h, d, inter = config.hidden_size, config.head_dim, config.intermediate_size
        q, kv = config.num_heads * d, config.num_kv_heads * d
        self.qkv = PartialLoRA(h, [q + 2 * kv], rank, scaling, rows)
        self.o = PartialLoRA(config.num_heads * d, [h], rank, scaling, rows)
        self.gate_up = PartialLoRA(h, [inter, inter], rank, scaling, rows)
        self.down = PartialLoRA(inter, [h], rank, scaling, rows)
        self.qkv.attach(layer.self_attn.qkv_proj)
        self.o.attach(layer.self_attn.o_proj)
        self.gate_up.attach(layer.mlp.gate_up_proj)
        self.down.attach(layer.mlp.down_proj)


class InternLMXComposer2ForCausalLM(VisionLanguageModel):
    """CLIP tower + ``vision_proj`` + InternLM2 with Partial LoRA on the image rows."""

    def __init__(self, config: ModelConfig, rope_scaling_factor: float = 0.0, max_position: int | None = None) -> None:
        super().__init__()
        self.config = config
        refuse_quantized(config)
        full = config.vision or {}
        hd = [k for k in _HD_KEYS if full.get(k) is not None]
        if hd:
            raise refuse_hd(f"config.json has {hd[0]}")
        self.language_model = build_language_model(config, rope_scaling_factor, max_position)
        side = int(full.get("img_size", 490))
        vision = {**CLIP_L14, **(full.get("vision_config") or {}), "image_size": side}
        self.vision_tower = ClipVisionModel(vision, [-1])
        width = int(vision["hidden_size"])
        self.vision_proj = nn.Sequential(nn.Linear(width, config.hidden_size), nn.GELU(),
                                         nn.Linear(config.hidden_size, config.hidden_size))
        # the rank is the remote code's constant; plora_rank (conveyor's own key) lets a test shrink it
        rank = int(full.get("plora_rank", PLORA_RANK))
        self.image_rows = ImageRows()
        self.plora = nn.ModuleList(
            XComposer2Adapters(layer, config, rank, PLORA_ALPHA / PLORA_RANK, self.image_rows)
            for layer in self.language_model.model.layers)
        self.side, self.patch = side, int(vision["patch_size"])
        # the id the tokenizer stage writes on image rows (InternLM2's <unk>)
        self.image_token_id: int = int(full.get("image_token_id", 0))

    # ---- the model runner's interface (the rest: VisionLanguageModel) ------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None,
                image_mask: torch.Tensor | None = None) -> torch.Tensor:
        """As the language model's, ``image_mask`` ([T] bool, True at the step's image rows)
        turning the adapters on at those rows; None: a step without image rows."""
        self.image_rows.set(image_mask)
        try:
            return self.language_model(input_ids, positions, inputs_embeds=inputs_embeds)
        finally:
            self.image_rows.set(None)

    def encode_images(self, pixel_values: torch.Tensor, grids: list[list[int]] | None = None) -> list[torch.Tensor]:
        """[B, 3, side, side] pixels -> each image's [(side / 14)², hidden] rows."""
        states = self.vision_tower.hidden_states(pixel_values)[0][:, 1:]
        return list(self.vision_proj(states))

    def image_rows_for(self, shape: list[int], grid: list[int]) -> int:
        if list(shape) != [3, self.side, self.side]:
            raise ValueError(f"InternLM-XComposer2 takes [3, {self.side}, {self.side}] pixels (config.json's img_size)")
        return (self.side // self.patch) ** 2

    def warmup_images(self, tokens: int) -> tuple[list[int], list[list[int]]]:
        n = max(1, tokens // (self.side // self.patch) ** 2)
        return [n, 3, self.side, self.side], [[]] * n

    # ---- weight loading ---------------------------------------------------------------------
    def _route(self, weights: Iterable[tuple[str, torch.Tensor]],
               own: dict[str, tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The language model's tensors as they are (InternLM2's names); the tower's, projector's
        and adapters' into ``own``."""
        skip = tuple(f"vision_tower.{p}" for p in self.vision_tower.unused_prefixes())
        gate_up: dict[tuple[int, str], list] = {}
        for name, tensor in weights:
            if any(t in name for t in _HD_TENSORS):
                raise refuse_hd(f"the checkpoint has {name}")
            if name.startswith("vit."):
                param = name[len("vit."):]
                if not param.startswith(skip):
                    own[param] = (name, tensor)
            elif name.startswith("vision_proj."):
                own[name] = (name, tensor)
            elif ".Plora_" in name:
                self._adapter(name, tensor, own, gate_up)
            else:
                yield name, tensor
        for (layer, which), pieces in gate_up.items():  # w1's and w3's, side by side
            if None in pieces:
                raise ValueError(f"the checkpoint has layer {layer}'s w1 or w3 Plora_{which}, not both")
            param = f"plora.{layer}.gate_up.lora_{which.lower()}"
            own[param] = (f"model.layers.{layer}.feed_forward.w1/w3.Plora_{which}.weight", torch.cat(pieces))

    def _adapter(self, name: str, tensor: torch.Tensor, own: dict, gate_up: dict) -> None:
        """One ``model.layers.N.<linear>.Plora_{A,B}.weight`` into ``own`` (w1 / w3 into ``gate_up``)."""
        parts = name.split(".")
        if len(parts) != 7 or parts[:2] != ["model", "layers"] or parts[-1] != "weight":
            raise ValueError(f"checkpoint tensor {name} is not a Partial LoRA weight this model has")
        layer, linear, which = int(parts[2]), ".".join(parts[3:5]), parts[5].removeprefix("Plora_")
        if linear not in _PLORA_LINEARS or which not in ("A", "B"):
            raise ValueError(f"checkpoint tensor {name} is not a Partial LoRA weight this model has")
        ours, part = _PLORA_LINEARS[linear]
        if part is not None:
            gate_up.setdefault((layer, which), [None, None])[part] = materialize(tensor)
            return
        if ours == "qkv" and which == "B":  # wqkv's rows are grouped per kv head: to [q | k | v]
            cfg = self.config
            tensor = torch.cat(unpack_wqkv(materialize(tensor), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim))
        own[f"plora.{layer}.{ours}.lora_{which.lower()}"] = (name, tensor)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the checkpoint; raise if any parameter stays unloaded or a tensor fits none."""
        own: dict[str, tuple[str, torch.Tensor]] = {}
        self.language_model.load_weights(self._route(weights, own))
        self.load_own(own)
