"""Qwen2-VL and Qwen2.5-VL: a native-resolution vision tower (``layers/qwen2_vision.py``) before
Qwen2's language model, whose rotary is multimodal (M-RoPE: ``layers/rotary.py``).

The runner's interface is LLaVA's (``llava.py``: ``embed_input_ids``, ``encode_images``,
``forward(..., inputs_embeds=...)``) plus ``mrope_merge``, the tower's spatial merge size: it
tells the runner to give image tokens three positions (``engine/multimodal.mrope_positions``)
and to shift the positions of every token after an image by what the image saved
(``mrope_delta``). ``forward`` takes ``[T]`` positions (text-only steps and decode: the shifted
index, the same for all three sections) or ``[3, T]`` (a step that computes image tokens).

Checkpoints load in transformers 5's layout (``model.visual.*``, ``model.language_model.*``,
``lm_head.*``) and the published one (``visual.*``, ``model.*``, ``lm_head.*``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from ...protocol.errors import UnsupportedModelError
from ..layers.qwen2_vision import Qwen2VisionTransformer
from ..layers.rotary import RotaryEmbedding, get_rope
from ..model_config import ModelConfig
from .qwen2 import Qwen2ForCausalLM
from .vision_language import VisionLanguageModel, refuse_quantized

# Checkpoint prefixes -> the part they belong to and the name inside it; the first match wins.
_PREFIXES = (
    ("model.visual.", "vision", "visual."),
    ("model.language_model.", "text", "model."),
    ("visual.", "vision", "visual."),
    ("model.", "text", "model."),
    ("lm_head.", "text", "lm_head."),
)


def mrope_section(config: ModelConfig) -> list[int]:
    """The language model's M-RoPE sections (pairs rotated by the temporal, row and column
    positions), from ``rope_parameters`` (transformers 5) or ``rope_scaling`` (published configs);
    transformers' default when neither says."""
    raw = config.raw
    for key in ("rope_parameters", "rope_scaling"):
        section = (raw.get(key) or {}).get("mrope_section")
        if section:
            return [int(s) for s in section]
    return [16, 24, 24]


class MRopeQwen2ForCausalLM(Qwen2ForCausalLM):
    """Qwen2 whose rotary takes ``[3, T]`` positions in steps with image tokens."""

    @staticmethod
    def rope(config: ModelConfig, rope_scaling_factor: float, max_position: int | None) -> RotaryEmbedding:
        return get_rope(config, rope_scaling_factor, max_position, mrope_section=mrope_section(config))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        if positions.dim() == 1:
            return super().forward(input_ids, positions, inputs_embeds)
        with self.model.layers[0].self_attn.rotary_emb.at(positions) as rows:
            return super().forward(input_ids, rows, inputs_embeds)


class Qwen2VLForConditionalGeneration(VisionLanguageModel):
    """Qwen2-VL: each image's merged patch rows in place of its ``<|image_pad|>`` tokens."""

    windowed = False  # Qwen2.5-VL's tower attends within windows

    def __init__(self, config: ModelConfig, rope_scaling_factor: float = 0.0, max_position: int | None = None) -> None:
        super().__init__()
        self.config = config
        full = config.vision or {}
        refuse_quantized(config)
        if config.text_architecture != "Qwen2ForCausalLM":
            raise UnsupportedModelError(f"{config.architecture} runs on Qwen2's language model, not "
                                        f"{config.text_architecture}")
        self.language_model = MRopeQwen2ForCausalLM(config.language_model, rope_scaling_factor, max_position)
        self.visual = Qwen2VisionTransformer(full.get("vision_config") or {}, self.windowed)
        self.image_token_id: int = int(full.get("image_token_id", 151655))
        self.mrope_merge: int = self.visual.merge

    # ---- the model runner's interface (the rest: VisionLanguageModel) ------------------------
    def image_rows_for(self, shape: list[int], grid: list[int]) -> int:
        m, width = self.visual.merge, self.visual.patch_embed.proj.weight[0].numel()
        if len(grid) != 3 or min(grid) < 1 or grid[1] % m or grid[2] % m or grid[0] * grid[1] * grid[2] != shape[0] \
                or shape[1:] != [width]:
            raise ValueError(f"Qwen2-VL takes [t * h * w, {width}] patch rows with the patch grid [t, h, w], "
                             f"h and w multiples of {m}")
        return self.visual.rows(grid)

    def warmup_images(self, tokens: int) -> tuple[list[int], list[list[int]]]:
        """448-pixel squares (32 x 32 patches, 256 tokens): the common size; a larger image's
        patches cost the same per patch but for its full-attention blocks."""
        cells = 32
        n = max(1, tokens // self.visual.rows([1, cells, cells]))
        return [n, cells * cells, self.visual.patch_embed.proj.weight[0].numel()], [[1, cells, cells]] * n

    def encode_images(self, pixel_values: torch.Tensor, grids: list[list[int]] | None = None) -> list[torch.Tensor]:
        """``[B, patches, C * T * P * P]`` (images of one size) and each one's patch grid
        ``[t, h, w]`` -> each image's ``[t * h * w / merge², hidden]`` rows, through the tower once."""
        rows = self.visual(pixel_values.flatten(0, 1), grids)
        return list(rows.split([self.visual.rows(g) for g in grids]))

    # ---- weight loading ---------------------------------------------------------------------
    def _route(self, weights: Iterable[tuple[str, torch.Tensor]],
               own: dict[str, tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The language model's tensors, renamed to its layout; the tower's collected in ``own``."""
        for name, tensor in weights:
            match = next((m for m in _PREFIXES if name.startswith(m[0])), None)
            if match is None:
                raise ValueError(f"checkpoint tensor {name} belongs to no part of {self.config.architecture} "
                                 "(visual, language model, lm_head)")
            prefix, part, renamed = match
            if part == "text":
                yield renamed + name[len(prefix):], tensor
            else:
                own[renamed + name[len(prefix):]] = (name, tensor)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load a checkpoint; raise if any parameter stays unloaded or a tensor fits none."""
        own: dict[str, tuple[str, torch.Tensor]] = {}
        self.language_model.load_weights(self._route(weights, own))
        self.load_own(own)


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2.5-VL: the tower with RMSNorm, a gated MLP and windowed attention."""

    windowed = True
