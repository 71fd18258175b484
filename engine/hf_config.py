"""A model's Hugging Face config files, read as plain JSON: no torch at import or in use.

The engine's ModelConfig parses the dict ``read_config`` returns; the stateless stages read
their end-of-sequence ids here without the engine's model code (torch, the layers, Triton).
Only a GGUF file needs transformers (its config is derived from the file's metadata), and
transformers' config classes import torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` names a GGUF file."""
    return Path(path).suffix.lower() == ".gguf"


def token_ids(value: int | list[int] | None) -> list[int]:
    """A config's token id field (absent, one id or a list) as a list."""
    return [] if value is None else ([value] if isinstance(value, int) else list(value))


def load_gguf_config(path: str | Path) -> dict[str, Any]:
    """The Hugging Face config dict transformers derives from a GGUF file's metadata."""
    from transformers import AutoConfig

    path = Path(path)
    cfg = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name).to_dict()
    if not cfg.get("architectures"):
        # GGUF metadata names only the model type; use the causal-LM class transformers maps it to.
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(cfg.get("model_type", ""))
        cfg["architectures"] = [arch] if arch else []
    return cfg


def read_config(path: str | Path) -> dict[str, Any]:
    """The config dict of a model directory (its ``config.json``) or of a ``.gguf`` file."""
    if is_gguf(path):
        return load_gguf_config(path)
    file = Path(path) / "config.json"
    if not file.exists():
        raise FileNotFoundError(
            f"{file} not found: pass a Hugging Face model directory (config.json + weights) or a .gguf file"
        )
    return json.loads(file.read_text())


def config_eos_ids(path: str | Path) -> list[int]:
    """The end-of-sequence ids a model's config names (``eos_token_id``)."""
    return token_ids(read_config(path).get("eos_token_id"))


def generation_eos_ids(model_dir: Path) -> list[int]:
    """eos ids from generation_config.json (chat models often add their end-of-turn token there)."""
    gen = model_dir / "generation_config.json"
    if not gen.exists():
        return []
    return token_ids(json.loads(gen.read_text()).get("eos_token_id"))


def with_defaults(cfg: dict[str, Any]) -> dict[str, Any]:
    """A config.json dict with what it leaves out filled from transformers' config class of its
    ``model_type`` (nested ``text_config`` / ``vision_config`` too): published multimodal configs
    write only what differs from those defaults (llava-1.5's text_config has no hidden_size, its
    vision_config no hidden_act). An unknown ``model_type`` leaves the dict as it is."""
    from transformers import CONFIG_MAPPING

    model_type = cfg.get("model_type")
    if model_type not in CONFIG_MAPPING:
        return cfg
    filled = CONFIG_MAPPING[model_type](**{k: v for k, v in cfg.items() if k != "model_type"}).to_dict()
    return {**filled, **{k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")}}
