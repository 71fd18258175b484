"""The model registry: ``config.json``'s ``architectures`` names -> the engine's model classes.

The table names each class by its module under ``engine/models/`` as a string and imports it
only when a model is built (vLLM's registry does the same), so reading a config (ModelConfig,
``conveyor list``) never imports torch model code, and ``model_config.py`` needs nothing from
``models/``: the dependency runs one way, models -> model_config.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

from ..protocol.errors import EngineConfigError, UnsupportedModelError

# architecture name -> (module under engine/models/, class name). A new family is one line here
# and one file there.
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "InternLM2ForCausalLM": ("internlm2", "InternLM2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "InternLM3ForCausalLM": ("internlm3", "InternLM3ForCausalLM"),
    "Olmo2ForCausalLM": ("olmo2", "Olmo2ForCausalLM"),
    "GemmaForCausalLM": ("gemma", "GemmaForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "Gemma2ForCausalLM": ("gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma", "Gemma3ForCausalLM"),
    "InternLMForCausalLM": ("internlm", "InternLMForCausalLM"),
    "QWenLMHeadModel": ("qwen", "QWenLMHeadModel"),
    "BaichuanForCausalLM": ("baichuan", "BaichuanForCausalLM"),
    "BaiChuanForCausalLM": ("baichuan", "BaiChuanForCausalLM"),
    "GlmForCausalLM": ("glm", "GlmForCausalLM"),
    "Glm4ForCausalLM": ("glm", "Glm4ForCausalLM"),
    "ChatGLMModel": ("chatglm", "ChatGLMModel"),
    "ChatGLMForConditionalGeneration": ("chatglm", "ChatGLMForConditionalGeneration"),
    "Starcoder2ForCausalLM": ("starcoder2", "Starcoder2ForCausalLM"),
    "FalconForCausalLM": ("falcon", "FalconForCausalLM"),
    "RWForCausalLM": ("falcon", "RWForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "DeepseekV2ForCausalLM": ("deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekForCausalLM": ("deepseek", "DeepseekForCausalLM"),
    "DbrxForCausalLM": ("dbrx", "DbrxForCausalLM"),
    # Vision-language models: a vision tower and projector before one of the language models above
    # (config.json's text_config names which; VISION_LANGUAGE below).
    "LlavaForConditionalGeneration": ("llava", "LlavaForConditionalGeneration"),
    "LlavaNextForConditionalGeneration": ("llava", "LlavaNextForConditionalGeneration"),
    "Qwen2VLForConditionalGeneration": ("qwen2_vl", "Qwen2VLForConditionalGeneration"),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_vl", "Qwen2_5_VLForConditionalGeneration"),
    "InternVLForConditionalGeneration": ("internvl", "InternVLForConditionalGeneration"),
    "InternVLChatModel": ("internvl", "InternVLChatModel"),
    # the original LLaVA repository's layout (liuhaotian/llava-v1.5 / v1.6, Yi-VL): no text_config
    "LlavaLlamaForCausalLM": ("llava_original", "LlavaLlamaForCausalLM"),
    "LlavaMistralForCausalLM": ("llava_original", "LlavaMistralForCausalLM"),
    # Mini-Gemini (dvlab-research/MGM): the original layout plus a ConvNeXt tower and patch mining
    "MGMLlamaForCausalLM": ("mini_gemini", "MGMLlamaForCausalLM"),
    "MiniGeminiLlamaForCausalLM": ("mini_gemini", "MiniGeminiLlamaForCausalLM"),
    # DeepSeek-VL (remote code): language_config (a Llama), vision_config, aligner_config
    "MultiModalityCausalLM": ("deepseek_vl", "MultiModalityCausalLM"),
    # Qwen-VL: published as QWenLMHeadModel with a "visual" dict (SAME_NAME_VISION below)
    "QWenVLLMHeadModel": ("qwen_vl", "QWenVLLMHeadModel"),
    # InternLM-XComposer2 (remote code): a flat InternLM2 config plus img_size; Partial LoRA
    "InternLMXComposer2ForCausalLM": ("xcomposer2", "InternLMXComposer2ForCausalLM"),
}

# The vision-language architectures, and the text architecture each text_config model_type runs on.
VISION_LANGUAGE = frozenset({
    "LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration",
    "Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
    "InternVLForConditionalGeneration", "InternVLChatModel",
    "LlavaLlamaForCausalLM", "LlavaMistralForCausalLM",
    "MGMLlamaForCausalLM", "MiniGeminiLlamaForCausalLM",
    "MultiModalityCausalLM",
    "QWenVLLMHeadModel",
    "InternLMXComposer2ForCausalLM",
})
# Remote-code vision-language models published under their language model's architecture name,
# told apart by a config.json key: that name -> (the key, the registry's name for the VL model).
SAME_NAME_VISION = {"QWenLMHeadModel": ("visual", "QWenVLLMHeadModel")}
TEXT_ARCHITECTURES = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "gemma": "GemmaForCausalLM", "phi3": "Phi3ForCausalLM", "internlm2": "InternLM2ForCausalLM",
    # Qwen2-VL's language model is Qwen2's, its rotary made multimodal (M-RoPE) by the VL model
    "qwen2_vl_text": "Qwen2ForCausalLM", "qwen2_5_vl_text": "Qwen2ForCausalLM",
}

# Architectures a tensor-parallel rank cannot run a slice of, and why (refused before any rank starts).
SINGLE_RANK_ONLY: dict[str, str] = {
    "Olmo2ForCausalLM": "its q/k RMSNorm takes one mean over all heads, which no rank holds",
    "InternLMXComposer2ForCausalLM": "its Partial LoRA adapters are not split over ranks",
}


def check_tp_support(arch: str, tp: int) -> None:
    """EngineConfigError for a tp > 1 that ``arch`` cannot be split over."""
    if tp > 1 and arch in SINGLE_RANK_ONLY:
        raise EngineConfigError(f"tp={tp}: {arch} runs at tp=1 only ({SINGLE_RANK_ONLY[arch]}); use tp=1")


def unsupported(names: Sequence[str] | str | None) -> UnsupportedModelError:
    """The error for a model whose architecture (or model type) the registry lacks."""
    return UnsupportedModelError(
        f"model architecture {names!r} is not supported; supported: {sorted(SUPPORTED_ARCHITECTURES)}. "
        "Convert the model to one of these or add a model file under engine/models/."
    )


def pick_architecture(names: Sequence[str], model_type: str | None = None) -> str:
    """The first of a config's ``architectures`` the engine runs; UnsupportedModelError if none."""
    arch = next((a for a in names if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise unsupported(list(names) or model_type)
    return arch


def vision_variant(arch: str, cfg: dict) -> str:
    """``arch``, or the registry's name of the vision-language model published under it that
    ``cfg`` (its config.json) describes (Qwen-VL's ``QWenLMHeadModel`` with a ``visual`` dict)."""
    key, name = SAME_NAME_VISION.get(arch, (None, arch))
    return name if key is not None and cfg.get(key) else arch


def model_class(arch: str) -> type:
    """The model class for ``arch``, importing its module now (torch and the layers come with it)."""
    if arch not in SUPPORTED_ARCHITECTURES:
        raise unsupported(arch)
    module, name = SUPPORTED_ARCHITECTURES[arch]
    return getattr(importlib.import_module(f".models.{module}", __package__), name)
