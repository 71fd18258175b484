"""The model's shape, read from a Hugging Face ``config.json`` (either spelling of rope settings)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from ..protocol.errors import UnsupportedModelError
from .hf_config import read_config, token_ids, with_defaults
from .model_registry import (
    SAME_NAME_VISION,
    SUPPORTED_ARCHITECTURES,
    TEXT_ARCHITECTURES,
    VISION_LANGUAGE,
    pick_architecture,
    vision_variant,
)

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


def _qwen_v1_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen (v1, remote code): its own names; ``intermediate_size`` is w1 and w2 together."""
    fields: dict[str, Any] = {
        "rms_norm_eps": cfg.get("layer_norm_epsilon", 1e-6),
        "rope_theta": cfg.get("rotary_emb_base", 10000.0),
        "max_position_embeddings": cfg.get("max_position_embeddings") or cfg.get("seq_length", 2048),
        "head_dim": cfg.get("kv_channels"),
    }
    if "intermediate_size" in cfg:
        fields["intermediate_size"] = cfg["intermediate_size"] // 2
    return fields


def _internlm_v1_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """InternLM (v1, remote code): RoPE's base and type in a ``rotary`` dict ("origin": plain;
    "dynamic": dynamic NTK with its ``scaling_factor``, as transformers' "dynamic" computes it)."""
    rotary = cfg.get("rotary")
    if not isinstance(rotary, dict):
        return {}
    fields: dict[str, Any] = {"rope_theta": rotary.get("base", 10000.0)}
    kind = rotary.get("type", "origin")
    if kind == "dynamic" and not cfg.get("rope_scaling"):
        fields["rope_scaling"] = {"rope_type": "dynamic", "factor": float(rotary.get("scaling_factor", 1.0))}
    elif kind != "origin":
        fields["rope_scaling"] = {"rope_type": kind}  # refused by name when the model is built
    return fields


def _baichuan_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Baichuan (remote code): the 13B configs give the context only as ``model_max_length``."""
    if cfg.get("max_position_embeddings"):
        return {}
    return {"max_position_embeddings": cfg.get("model_max_length", 4096)}


def _chatglm_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """ChatGLM2/3 and GLM-4 as THUDM publish them (remote code): their own names; RoPE's base is
    ``10000 * rope_ratio``; ``multi_query_group_num`` kv heads when ``multi_query_attention``.
    ChatGLM-6B (v1: 2D positions, GELU, another layout) is refused here by name."""
    if "position_encoding_2d" in cfg or "inner_hidden_size" in cfg or "ffn_hidden_size" not in cfg:
        raise UnsupportedModelError("ChatGLM-6B (the first ChatGLM: 2D rotary positions, its own layout) is not "
                                    "supported; ChatGLM2, ChatGLM3 and GLM-4 checkpoints are")
    heads = cfg["num_attention_heads"]
    return {
        "num_hidden_layers": cfg["num_layers"],
        "intermediate_size": cfg["ffn_hidden_size"],
        "vocab_size": cfg.get("padded_vocab_size") or cfg.get("vocab_size"),
        "num_key_value_heads": cfg.get("multi_query_group_num", 1) if cfg.get("multi_query_attention") else heads,
        "head_dim": cfg.get("kv_channels") or cfg["hidden_size"] // heads,
        "rms_norm_eps": cfg.get("layernorm_epsilon", 1e-5),
        "rope_theta": 10000.0 * float(cfg.get("rope_ratio", 1)),
        "max_position_embeddings": cfg.get("seq_length", 2048),
        "attention_bias": bool(cfg.get("add_qkv_bias") or cfg.get("add_bias_linear")),
    }


def _falcon_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Falcon, in transformers' names or the older RefinedWeb ones (``n_layer``, ``n_head``,
    ``n_head_kv``); kv heads: one (``multi_query``, Falcon-7B), ``num_kv_heads`` (the grouped
    "new decoder architecture" of 40B/180B) or every head; a tied head unless the config unties it."""
    heads = cfg.get("num_attention_heads") or cfg["n_head"]
    hidden = cfg.get("hidden_size") or cfg["n_embed"]
    if cfg.get("new_decoder_architecture") or cfg.get("model_type") == "RefinedWeb":
        kv_heads = cfg.get("num_kv_heads") or cfg.get("n_head_kv") or heads
    else:
        kv_heads = 1 if cfg.get("multi_query", True) else heads
    return {
        "num_hidden_layers": cfg.get("num_hidden_layers") or cfg["n_layer"],
        "num_attention_heads": heads,
        "hidden_size": hidden,
        "intermediate_size": cfg.get("ffn_hidden_size") or 4 * hidden,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "rms_norm_eps": cfg.get("layer_norm_epsilon", 1e-5),
        "max_position_embeddings": cfg.get("max_position_embeddings", 2048),
        "tie_word_embeddings": cfg.get("tie_word_embeddings", True),
    }


def _starcoder2_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """StarCoder2: LayerNorm's ``norm_epsilon``; ``use_bias`` on every projection; tied by default."""
    return {
        "rms_norm_eps": cfg.get("norm_epsilon", 1e-5),
        "attention_bias": cfg.get("use_bias", True),
        "tie_word_embeddings": cfg.get("tie_word_embeddings", True),
    }


def _dbrx_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """DBRX: its nested ``attn_config`` / ``ffn_config`` (transformers' DbrxConfig defaults where a
    field is absent); the experts' width is the intermediate size, as Mixtral's. RoPE's base is
    ``attn_config.rope_theta`` even where a ``rope_parameters`` says otherwise: transformers 5
    reads a released config without it and writes its default base there. LayerNorm's eps is
    torch's default, which DBRX's code uses (its configs carry none)."""
    attn, ffn = cfg.get("attn_config") or {}, cfg.get("ffn_config") or {}
    fields: dict[str, Any] = {
        "hidden_size": cfg.get("d_model", 2048),
        "num_attention_heads": cfg.get("n_heads", 16),
        "num_hidden_layers": cfg.get("n_layers", 24),
        "max_position_embeddings": cfg.get("max_seq_len", 2048),
        "num_key_value_heads": attn.get("kv_n_heads", 1),
        "intermediate_size": ffn.get("ffn_hidden_size", 3584),
        "num_experts": ffn.get("moe_num_experts", 4),
        "num_experts_per_tok": ffn.get("moe_top_k", 1),
        "rms_norm_eps": 1e-5,
    }
    if attn.get("rope_theta") is not None:
        fields["rope_theta"] = attn["rope_theta"]
        if cfg.get("rope_parameters"):
            fields["rope_parameters"] = {**cfg["rope_parameters"], "rope_theta": attn["rope_theta"]}
    return fields


# architecture -> the Llama-named fields its config.json spells its own way (config.raw keeps
# the file as written; the model files read their family's other flags from it).
_FAMILY_FIELDS = {
    "QWenLMHeadModel": _qwen_v1_fields,
    "InternLMForCausalLM": _internlm_v1_fields,
    "BaichuanForCausalLM": _baichuan_fields,
    "BaiChuanForCausalLM": _baichuan_fields,
    "ChatGLMModel": _chatglm_fields,
    "ChatGLMForConditionalGeneration": _chatglm_fields,
    "FalconForCausalLM": _falcon_fields,
    "RWForCausalLM": _falcon_fields,
    "Starcoder2ForCausalLM": _starcoder2_fields,
    "DbrxForCausalLM": _dbrx_fields,
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
    # Mixture-of-experts (0: dense): routed experts per layer and how many each token takes.
    # Mixtral and transformers 5 spell the count num_local_experts, Qwen's releases num_experts.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    # The decoder linears' weight format (engine/quant_format.py), set by the engine once it has
    # checked the checkpoint against EngineConfig.model_format; None: dense 16-bit weights.
    quant: Any = None
    # A vision-language model: its whole config.json (defaults filled: vision_config, projector,
    # image token), and the architecture of its language model, which every other field describes.
    vision: dict[str, Any] | None = field(default=None, repr=False)
    text_architecture: str | None = None

    @property
    def language_model(self) -> "ModelConfig":
        """The config of the model that computes the tokens (itself, for a text model)."""
        if self.text_architecture is None:
            return self
        return replace(self, architecture=self.text_architecture, vision=None, text_architecture=None)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Read a config.json dict; unknown architectures raise UnsupportedModelError."""
        arch = pick_architecture(cfg.get("architectures") or [], cfg.get("model_type"))
        if vision_variant(arch, cfg) != arch:  # Qwen-VL: the language model's config plus a "visual" dict
            text = {k: v for k, v in cfg.items() if k != SAME_NAME_VISION[arch][0]}
            return replace(cls.from_dict(text), architecture=vision_variant(arch, cfg), vision=dict(cfg),
                           text_architecture=arch)
        if arch in VISION_LANGUAGE:
            return cls._vision_language(arch, cfg)
        raw = cfg
        if arch in _FAMILY_FIELDS:
            cfg = {**cfg, **{k: v for k, v in _FAMILY_FIELDS[arch](cfg).items() if v is not None}}
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
            raw=raw,
            num_experts=int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0),
            num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0),
        )

    @classmethod
    def _vision_language(cls, arch: str, cfg: dict[str, Any]) -> "ModelConfig":
        """A vision-language config: its language model's fields from ``text_config`` (InternVL's
        remote-code layout: ``llm_config``), or, in the original LLaVA repository's layout
        (``LlavaLlamaForCausalLM``: no ``text_config``, an ``mm_vision_tower``), from the top level,
        which is its Llama / Mistral config (``engine/models/llava_original.py`` reads the rest)."""
        if "mm_vision_tower" in cfg and not cfg.get("text_config"):
            # LlavaLlamaForCausalLM / MGMLlamaForCausalLM / MiniGeminiLlamaForCausalLM -> LlamaForCausalLM
            text_arch = next((arch.removeprefix(p) for p in ("Llava", "MiniGemini", "MGM") if arch.startswith(p)), arch)
            text = {**cfg, "architectures": [text_arch], "model_type": text_arch.removesuffix("ForCausalLM").lower()}
            return replace(cls.from_dict(text), architecture=arch, vision=dict(cfg), text_architecture=text_arch)
        if arch == "InternLMXComposer2ForCausalLM":  # flat: InternLM2's fields at top level, img_size beside
            text = {**cfg, "architectures": ["InternLM2ForCausalLM"], "model_type": "internlm2"}
            return replace(cls.from_dict(text), architecture=arch, vision=dict(cfg),
                           text_architecture="InternLM2ForCausalLM")
        full = with_defaults(cfg)
        text = dict(full.get("text_config") or full.get("llm_config") or {})
        if not text and isinstance(full.get("language_config"), dict):
            # DeepSeek-VL: a Llama config that writes only what differs from LlamaConfig's defaults
            # (not its token ids, 1 and 2, which are not DeepSeek's tokenizer's)
            given = full["language_config"]
            text = {k: v for k, v in with_defaults({"model_type": "llama", **given}).items()
                    if k in given or k not in ("bos_token_id", "eos_token_id", "pad_token_id")}
        named = [a for a in text.get("architectures") or () if a in SUPPORTED_ARCHITECTURES]
        text_arch = named[0] if named else TEXT_ARCHITECTURES.get(text.get("model_type"))
        if text_arch is None or text_arch in VISION_LANGUAGE:
            raise UnsupportedModelError(
                f"{arch}'s language model ({text.get('model_type')!r}) is not one conveyor runs inside a "
                f"vision-language model: {', '.join(sorted(TEXT_ARCHITECTURES))}")
        text["architectures"] = [text_arch]
        # what a published config keeps at top level (Qwen2-VL's are flat: transformers moves the
        # language model's fields into text_config but leaves these)
        for key in ("torch_dtype", "dtype", "eos_token_id", "bos_token_id", "tie_word_embeddings"):
            if text.get(key) is None and full.get(key) is not None:
                text[key] = full[key]
        return replace(cls.from_dict(text), architecture=arch, vision=full, text_architecture=text_arch)

    @classmethod
    def from_pretrained(cls, model_path: str | Path) -> "ModelConfig":
        """Read ``model_path/config.json``, or the config a ``.gguf`` file's metadata gives."""
        cfg = read_config(model_path)
        for key in ("mm_vision_tower", "mm_vision_tower_aux"):  # (the aux: Mini-Gemini's ConvNeXt)
            tower = cfg.get(key)
            if isinstance(tower, str) and (Path(model_path) / tower).is_dir():
                # the original LLaVA layout may name a folder of the model's as its tower (Yi-VL's ./vit/...)
                cfg = {**cfg, key: str(Path(model_path) / tower)}
        if "llm_config" in cfg and cfg.get("image_token_id") is None:
            # InternVL's remote-code layout names its image token only in the tokenizer
            cfg = {**cfg, "image_token_id": _added_token_id(Path(model_path), "<IMG_CONTEXT>")}
        if "language_config" in cfg and cfg.get("image_token_id") is None:
            # DeepSeek-VL's image token, <image_placeholder>, is also the tokenizer's alone
            cfg = {**cfg, "image_token_id": _added_token_id(Path(model_path), "<image_placeholder>")}
        return cls.from_dict(cfg)


def _added_token_id(model_dir: Path, content: str) -> int | None:
    """The id of an added token in a model directory's tokenizer files (plain JSON), or None."""
    config, full = model_dir / "tokenizer_config.json", model_dir / "tokenizer.json"
    if config.is_file():
        for token_id, token in (json.loads(config.read_text()).get("added_tokens_decoder") or {}).items():
            if token.get("content") == content:
                return int(token_id)
    if full.is_file():
        for token in json.loads(full.read_text()).get("added_tokens") or ():
            if token.get("content") == content:
                return int(token["id"])
    return None
