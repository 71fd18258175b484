"""The model's shape, read from a Hugging Face ``config.json`` (either spelling of rope settings)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .hf_config import read_config, token_ids
from .model_registry import pick_architecture

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """'bf16' / 'bfloat16' / torch.bfloat16 -> torch.bfloat16."""
    if isinstance(name, torch.dtype):
        return name
    key = str(name).replace("torch.", "").lower()
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}: use one of float32, float16, bfloat16")
    return _DTYPES[key]


@dataclass
class ModelConfig:
    """Architecture hyper-parameters the engine needs, independent of the checkpoint's naming."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    dtype: torch.dtype = torch.float16
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)
    # The decoder linears' weight format (engine/quant_format.py), set by the engine once it has
    # checked the checkpoint against EngineConfig.model_format; None: dense 16-bit weights.
    quant: Any = None

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Read a config.json dict; unknown architectures raise UnsupportedModelError."""
        arch = pick_architecture(cfg.get("architectures") or [], cfg.get("model_type"))
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        # Two spellings: transformers 5 nests rope settings in rope_parameters; older configs use
        # rope_theta + rope_scaling at top level.
        rope_params = dict(cfg.get("rope_parameters") or {})
        rope_theta = rope_params.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
        rope_scaling = cfg.get("rope_scaling") or None
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = rope_params
        if rope_scaling is not None:
            rope_scaling = dict(rope_scaling)
            rope_scaling.setdefault("rope_type", rope_scaling.get("type", "default"))
        dtype_name = cfg.get("torch_dtype") or cfg.get("dtype") or "float16"
        return cls(
            architecture=arch,
            model_type=cfg.get("model_type", ""),
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias; InternLM2 spells it "bias"; Llama "attention_bias".
            attention_bias=bool(
                cfg.get("attention_bias", cfg.get("bias", arch == "Qwen2ForCausalLM"))
            ),
            dtype=parse_dtype(dtype_name),
            eos_token_ids=token_ids(cfg.get("eos_token_id")),
            bos_token_id=cfg.get("bos_token_id"),
            raw=cfg,
        )

    @classmethod
    def from_pretrained(cls, model_path: str | Path) -> "ModelConfig":
        """Read ``model_path/config.json``, or the config a ``.gguf`` file's metadata gives."""
        return cls.from_dict(read_config(model_path))
