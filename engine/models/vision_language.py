"""What every vision-language model here shares (LLaVA, Qwen2-VL, InternVL, ...).

The model runner drives one through ``embed_input_ids``, ``encode_images`` (the family's),
``forward(..., inputs_embeds=...)``, ``compute_logits`` (and its two halves: ``head_shard``, then
``logits_from_shard`` or ``argmax_from_shard``) and ``attention_layers``; all but
``encode_images`` are its language model's. Loading splits a checkpoint in two: the language
model's tensors go to its own ``load_weights`` (renamed by the family's ``_route``), the rest
(tower, projector) load here by name, strictly.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from ...protocol.errors import UnsupportedModelError
from ..model_config import ModelConfig
from ..model_registry import model_class
from ..weight_loader import materialize


def refuse_quantized(config: ModelConfig) -> None:
    """UnsupportedModelError for an AWQ / W8A8 checkpoint of a vision-language model."""
    if config.quant is not None:
        raise UnsupportedModelError(f"quantized {config.architecture} checkpoints (AWQ, W8A8) are not supported "
                                    "yet: serve the 16-bit checkpoint")


def build_language_model(config: ModelConfig, rope_scaling_factor: float, max_position: int | None) -> nn.Module:
    """The model of ``config.text_architecture``, refused if it cannot take image embeddings."""
    text_class = model_class(config.text_architecture)
    if "inputs_embeds" not in inspect.signature(text_class.forward).parameters:
        raise UnsupportedModelError(f"{config.text_architecture} cannot take image embeddings yet, so it cannot be "
                                    f"{config.architecture}'s language model here")
    return text_class(config.language_model, rope_scaling_factor, max_position)


class VisionLanguageModel(nn.Module):
    """The runner's interface, delegated to ``self.language_model``, and strict loading of the
    parameters outside it."""

    language_model: nn.Module

    def image_rows_for(self, shape: list[int], grid: list[int]) -> int | None:
        """The encoder rows an image of pixel ``shape`` (one image's, no batch dimension) and
        ``grid`` gives; ValueError naming what does not fit the tower. The engine checks each
        request's images with it before they reach a step. None: the family does not say."""
        return None

    def warmup_images(self, tokens: int) -> tuple[list[int], list[list[int]]] | None:
        """The pixel shape ``[B, ...]`` and grids of a batch of the family's largest images that
        fill about ``tokens`` placeholder tokens (at least one image): what the runner encodes
        once at start-up, so that the tower's activations count in the memory profile and its
        first-call costs (kernel choice, compiles) are paid before the first request. None: no
        warm-up for this family."""
        return None

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] ids -> [T, hidden]: the language model's input embeddings."""
        return self.language_model.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.language_model(input_ids, positions, inputs_embeds=inputs_embeds)

    def compute_logits(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden_rows)

    def head_shard(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        return self.language_model.head_shard(hidden_rows)

    def logits_from_shard(self, shard: torch.Tensor) -> torch.Tensor:
        return self.language_model.logits_from_shard(shard)

    def argmax_from_shard(self, shard: torch.Tensor) -> torch.Tensor:
        return self.language_model.argmax_from_shard(shard)

    def attention_layers(self) -> list:
        return self.language_model.attention_layers()

    @torch.no_grad()
    def load_own(self, own: dict[str, tuple[str, torch.Tensor]]) -> None:
        """Load the tensors outside the language model (parameter name -> (checkpoint name,
        tensor)); raise on a tensor that fits no parameter and on a parameter left unloaded. A
        parameter marked ``zero_padded`` (a GEMM width padded for alignment) takes a smaller
        tensor into its leading slice, zeros after."""
        family = self.config.architecture
        params = {name: p for name, p in self.named_parameters() if not name.startswith("language_model.")}
        for name, (ckpt_name, tensor) in own.items():
            param = params.pop(name, None)
            if param is None:
                raise ValueError(f"checkpoint tensor {ckpt_name} matches no parameter of {family}'s tower or "
                                 "projector")
            fits = tuple(param.shape) == tuple(tensor.shape) or (
                getattr(param, "zero_padded", False) and param.dim() == len(tensor.shape)
                and all(t <= p for t, p in zip(tensor.shape, param.shape)))
            if not fits:
                raise ValueError(f"checkpoint tensor {ckpt_name} has shape {tuple(tensor.shape)}, expected "
                                 f"{tuple(param.shape)}")
            if tuple(param.shape) != tuple(tensor.shape):
                param.data.zero_()
            param.data[tuple(slice(0, t) for t in tensor.shape)].copy_(materialize(tensor))
        if params:
            raise ValueError(f"the checkpoint lacks {len(params)} of {family}'s vision tensors: "
                             f"{', '.join(sorted(params)[:5])}")
