"""Published model shapes (config.json only) for runs with random weights (``load_format="dummy"``).

The engine builds the model from the config and fills it with seeded random weights on the
device: no weight files are written or read, and the timings are those of the real shape (the
kernels do not depend on the values). The benchmarks build engines of these shapes
(``benchmarks/common.py``); ``conveyor serve api_server --dummy-weights SHAPE`` serves one,
with the tokenizer of the model it is given (:func:`served_model_dir`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from ..protocol.errors import EngineConfigError

logger = logging.getLogger(__name__)

_LLAMA_COMMON: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "torch_dtype": "float16",
}

# Llama-2's vocabulary, RoPE base and context, which its sizes (and the CPU toy) share.
_LLAMA2_COMMON: dict[str, Any] = {
    **_LLAMA_COMMON, "vocab_size": 32000, "rope_theta": 10000.0, "max_position_embeddings": 4096,
    "bos_token_id": 1, "eos_token_id": 2,
}

SHAPES: dict[str, dict[str, Any]] = {
    # meta-llama/Llama-2-7b-hf
    "llama2-7b": {**_LLAMA2_COMMON, "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                  "num_key_value_heads": 32, "intermediate_size": 11008},
    # meta-llama/Meta-Llama-3-8B
    "llama3-8b": {**_LLAMA_COMMON, "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                  "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
                  "rope_theta": 500000.0, "max_position_embeddings": 8192, "bos_token_id": 128000,
                  "eos_token_id": 128001},
    # meta-llama/Llama-2-70b-hf: 138 GB of fp16 weights, more than one H200 holds (tensor parallel)
    "llama2-70b": {**_LLAMA2_COMMON, "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
                   "num_key_value_heads": 8, "intermediate_size": 28672},
    # Qwen/Qwen3-8B
    "qwen3-8b": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
                 "hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
                 "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936, "rope_theta": 1000000.0,
                 "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                 "attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16"},
    # microsoft/Phi-3-mini-4k-instruct (a 2047-token sliding window on every layer)
    "phi3-mini": {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_act": "silu",
                  "hidden_size": 3072, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
                  "intermediate_size": 8192, "vocab_size": 32064, "rope_theta": 10000.0,
                  "max_position_embeddings": 4096, "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
                  "sliding_window": 2047, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 32000,
                  "torch_dtype": "bfloat16"},
    # google/gemma-7b
    "gemma-7b": {"architectures": ["GemmaForCausalLM"], "model_type": "gemma", "hidden_act": "gelu",
                 "hidden_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 16,
                 "head_dim": 256, "intermediate_size": 24576, "vocab_size": 256000, "rope_theta": 10000.0,
                 "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
                 "bos_token_id": 2, "eos_token_id": 1, "torch_dtype": "bfloat16"},
    # google/gemma-2-9b-it: 4096-token windows on even layers, scores capped at 50, logits at 30
    "gemma2-9b": {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
                  "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 3584, "num_hidden_layers": 42,
                  "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "intermediate_size": 14336,
                  "vocab_size": 256000, "rope_theta": 10000.0, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
                  "sliding_window": 4096, "query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0,
                  "final_logit_softcapping": 30.0, "tie_word_embeddings": True, "bos_token_id": 2,
                  "eos_token_id": [1, 107], "torch_dtype": "bfloat16"},
    # google/gemma-3-1b-it: 512-token windows on five layers of six, local and global RoPE bases
    "gemma3-1b": {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                  "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "num_hidden_layers": 26,
                  "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "intermediate_size": 6912,
                  "vocab_size": 262144, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
                  "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "sliding_window": 512,
                  "sliding_window_pattern": 6, "query_pre_attn_scalar": 256, "tie_word_embeddings": True,
                  "bos_token_id": 2, "eos_token_id": [1, 106], "torch_dtype": "bfloat16"},
    # mistralai/Mistral-7B-v0.1: a 4096-token window on every layer
    "mistral-7b-v0.1": {**_LLAMA_COMMON, "architectures": ["MistralForCausalLM"], "model_type": "mistral",
                        "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                        "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000,
                        "rope_theta": 10000.0, "max_position_embeddings": 32768, "sliding_window": 4096,
                        "bos_token_id": 1, "eos_token_id": 2},
    # mistralai/Mixtral-8x7B-v0.1: 8 experts of 14336, top-2, on every layer (46.7B, 12.9B active)
    "mixtral-8x7b": {**_LLAMA_COMMON, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                     "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "intermediate_size": 14336, "num_local_experts": 8,
                     "num_experts_per_tok": 2, "vocab_size": 32000, "rope_theta": 1000000.0,
                     "max_position_embeddings": 32768, "sliding_window": None, "bos_token_id": 1, "eos_token_id": 2},
    # Qwen/Qwen3-30B-A3B: 128 experts of 768, top-8 renormalised, every layer sparse (30.5B, 3.3B active)
    "qwen3-30b-a3b": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_act": "silu",
                      "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
                      "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
                      "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
                      "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                      "vocab_size": 151936, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
                      "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False,
                      "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16"},
    # deepseek-ai/deepseek-moe-16b-base: MHA, layer 0 dense (10944), then 64 routed experts of 1408
    # (top-6 softmax, not renormalised) and 2 shared ones (16.4B, 2.8B active)
    "deepseek-moe-16b": {**_LLAMA_COMMON, "architectures": ["DeepseekForCausalLM"], "model_type": "deepseek",
                         "hidden_size": 2048, "num_hidden_layers": 28, "num_attention_heads": 16,
                         "num_key_value_heads": 16, "intermediate_size": 10944, "moe_intermediate_size": 1408,
                         "n_routed_experts": 64, "num_experts_per_tok": 6, "n_shared_experts": 2,
                         "first_k_dense_replace": 1, "moe_layer_freq": 1, "norm_topk_prob": False,
                         "scoring_func": "softmax", "vocab_size": 102400, "rope_theta": 10000.0,
                         "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "bos_token_id": 100000,
                         "eos_token_id": 100001, "torch_dtype": "bfloat16"},
    # deepseek-ai/DeepSeek-V2-Lite: MLA (16 heads, kv_lora_rank 512, rope 64, nope 128, v 128: a 576-value
    # latent row a token and layer), layer 0 dense (10944), then 64 routed experts of 1408 (top-6) and
    # 2 shared; YaRN x40 (15.7B, 2.4B active)
    "deepseek-v2-lite": {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
                         "hidden_act": "silu", "hidden_size": 2048, "num_hidden_layers": 27,
                         "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": None,
                         "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
                         "intermediate_size": 10944, "moe_intermediate_size": 1408, "n_routed_experts": 64,
                         "num_experts_per_tok": 6, "n_shared_experts": 2, "first_k_dense_replace": 1,
                         "moe_layer_freq": 1, "norm_topk_prob": False, "scoring_func": "softmax",
                         "topk_method": "greedy", "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
                         "vocab_size": 102400, "rope_theta": 10000.0, "max_position_embeddings": 163840,
                         "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                          "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
                         "rms_norm_eps": 1e-6, "attention_bias": False, "tie_word_embeddings": False,
                         "bos_token_id": 100000, "eos_token_id": 100001, "torch_dtype": "bfloat16"},
    # databricks/dbrx-base (dbrx-instruct is the same shape): 16 experts of 10752, top-4, every layer
    # sparse, q/k/v clipped at 8 (132B, 36B active); DBRX's nested config as published
    "dbrx": {"architectures": ["DbrxForCausalLM"], "model_type": "dbrx", "d_model": 6144, "n_heads": 48,
             "n_layers": 40, "max_seq_len": 32768, "vocab_size": 100352,
             "attn_config": {"kv_n_heads": 8, "clip_qkv": 8, "rope_theta": 500000},
             "ffn_config": {"ffn_hidden_size": 10752, "moe_num_experts": 16, "moe_top_k": 4,
                            "moe_jitter_eps": 0, "moe_loss_weight": 0.05, "ffn_act_fn": {"name": "silu"}},
             "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    # llava-hf/llava-1.5-7b-hf: CLIP ViT-L/14 at 336 pixels (576 image tokens), a 2-layer GELU
    # projector, Vicuna-7B (the Llama-2-7B shape) as published, its text_config full here
    "llava-1.5-7b": {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
                     "image_token_index": 32000, "projector_hidden_act": "gelu", "vision_feature_layer": -2,
                     "vision_feature_select_strategy": "default", "torch_dtype": "float16",
                     "text_config": {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                     "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                                     "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32064,
                                     "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                                     "torch_dtype": "float16"},
                     "vision_config": {"model_type": "clip_vision_model", "hidden_size": 1024,
                                       "intermediate_size": 4096, "num_attention_heads": 16, "num_hidden_layers": 24,
                                       "image_size": 336, "patch_size": 14, "projection_dim": 768,
                                       "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5}},
    # Qwen/Qwen2.5-VL-7B-Instruct as published (flat: the language model's fields at top level): a
    # 32-block windowed tower of width 1280 (full attention in 4), 2 x 2 patches merged into one
    # token, Qwen2-7B's language model with M-RoPE
    "qwen2.5-vl-7b": {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
                      "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
                      "vision_start_token_id": 151652, "vision_end_token_id": 151653, "vision_token_id": 151654,
                      "image_token_id": 151655, "video_token_id": 151656, "hidden_act": "silu", "hidden_size": 3584,
                      "intermediate_size": 18944, "max_position_embeddings": 128000, "max_window_layers": 28,
                      "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
                      "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "sliding_window": 32768,
                      "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_sliding_window": False,
                      "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280,
                                        "intermediate_size": 3420, "num_heads": 16, "in_chans": 3,
                                        "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2,
                                        "spatial_patch_size": 14, "window_size": 112,
                                        "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
                                        "temporal_patch_size": 2},
                      "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "vocab_size": 152064},
    # A toy of the same family, for smoke-testing the benchmarks on a CPU.
    "tiny": {**_LLAMA2_COMMON, "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 1000},
}

# What a model directory's tokenizer is made of (transformers' names); nothing else is copied.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                    "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja",
                    "chat_template.json")


def write_model_dir(shape: str, dest: str | Path) -> Path:
    """Write ``dest/config.json`` for ``shape`` (a key of SHAPES); returns ``dest``."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(shape_config(shape), indent=2) + "\n")
    return dest


def shape_config(shape: str | Path) -> dict[str, Any]:
    """The config of ``shape``: a key of SHAPES, a config.json file or a model directory holding one."""
    if str(shape) in SHAPES:
        return SHAPES[str(shape)]
    path = Path(shape)
    path = path / "config.json" if path.is_dir() else path
    if path.suffix != ".json" or not path.is_file():
        raise EngineConfigError(f"model shape {str(shape)!r}: name one of {sorted(SHAPES)}, a config.json file "
                                "or a model directory holding one")
    return json.loads(path.read_text())


def shape_name(shape: str | Path) -> str:
    """What to call ``shape`` (as /v1/models reports it): the key, or the model directory's name."""
    path = Path(str(shape).rstrip("/"))
    return path.parent.name if path.name == "config.json" else path.name.removesuffix(".json")


def served_model_dir(shape: str | Path, tokenizer_dir: str | Path) -> Path:
    """A model directory for serving ``shape`` on random weights: its config.json and the tokenizer
    files of ``tokenizer_dir`` (a model directory), so that every stage reads one path.

    The tokenizer is another model's: prompts given as token ids run as they would on the real
    model; text prompts may encode to ids past the shape's vocabulary (the engine refuses them),
    and generated ids the tokenizer does not know decode to nothing. The directory is named by
    its contents and made atomically, so the stages of one deployment (processes or containers
    sharing /tmp) may all call this and get the same one."""
    config = shape_config(shape)
    src = Path(tokenizer_dir)
    if not src.is_dir():
        raise EngineConfigError(f"--dummy-weights takes its tokenizer from a model directory; {str(src)!r} is not "
                                "one (a .gguf file or a missing path): give a model directory as MODEL")
    files = [src / name for name in _TOKENIZER_FILES if (src / name).is_file()]
    if not files:
        raise EngineConfigError(f"{src} holds no tokenizer files ({', '.join(_TOKENIZER_FILES[:3])}, ...)")
    digest = hashlib.sha1(json.dumps(config, sort_keys=True).encode())
    for f in files:
        digest.update(f.name.encode() + f.read_bytes())
    dest = Path(tempfile.gettempdir()) / f"conveyor-dummy-{shape_name(shape)}-{digest.hexdigest()[:12]}"
    if not dest.is_dir():
        part = Path(tempfile.mkdtemp(prefix=f"{dest.name}.part-", dir=dest.parent))
        for f in files:
            shutil.copyfile(f, part / f.name)
        (part / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        try:
            os.rename(part, dest)
        except OSError:  # another stage made it first: the same contents
            shutil.rmtree(part, ignore_errors=True)
    _warn_small_vocab(dest, int(config.get("vocab_size", 0)))
    return dest


def _warn_small_vocab(model_dir: Path, vocab: int) -> None:
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return
    tokenizer = json.loads(path.read_text())
    ids = tokenizer["model"].get("vocab") or {}
    known = 1 + max([*(ids.values() if isinstance(ids, dict) else [len(ids) - 1]),
                     *(t["id"] for t in tokenizer.get("added_tokens", ()))], default=-1)
    if known < vocab:
        logger.warning("the tokenizer knows %d ids, the model shape generates up to %d: the ids past it decode to "
                       "nothing (the detokenizer's work is understated)", known, vocab)


def param_count(shape: str, active: bool = False) -> int:
    """Parameters of the shape, counted on a model built on the meta device (exact for every
    family). ``active``: what one token reads, for bandwidth arithmetic: a mixture-of-experts
    layer's experts count ``top_k / num_experts`` of their parameters (the embeddings and every
    other weight count whole)."""
    import torch  # here: the stateless stages read SHAPES without importing torch

    from .distributed import as_first_of
    from .layers.moe import FusedMoE
    from .model_config import ModelConfig
    from .models import build_model

    with as_first_of(1):  # the whole model, also in a tensor-parallel rank (whose layers are split)
        model = build_model(ModelConfig.from_dict(shape_config(shape)), dtype=torch.bfloat16, device="meta")
    total = sum(p.numel() for p in model.parameters())
    if active:
        for m in model.modules():
            if isinstance(m, FusedMoE):
                total -= round((m.w13.numel() + m.w2.numel()) * (1 - m.top_k / m.num_experts))
    return total
