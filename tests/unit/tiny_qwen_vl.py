"""A tiny random-weight Qwen-VL in its published layout, for tests against a plain-torch reference.

transformers has no Qwen-VL class (Qwen/Qwen-VL-Chat is remote code), so ``save_tiny_qwen_vl``
writes the checkpoint by hand: config.json with Qwen-VL-Chat's field names (Qwen v1's, plus the
``visual`` dict), and model.safetensors with its tensor names: the tower's ``transformer.visual.*``
(random, the published shapes for this ``visual``) and the language model's ``transformer.*`` /
``lm_head`` from a random transformers ``Qwen2ForCausalLM`` with as many kv heads as heads, which
computes what Qwen (v1) computes (``test_models_remote_code_families.qwen_tensors`` renames it).
The tower: 56-pixel images of 14-pixel patches (a 4 x 4 grid, so both position tables are
resized: the ViT's 16 x 16 down, the Resampler's 2 x 2 up), width 32, 2 blocks of 2 heads, a
Resampler of 4 queries and 2 heads (output_dim 256 = the language model's width).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

START, END, PAD = 120, 121, 122  # <img>, </img>, <imgpad>: image_start_id and the two after it
VISUAL = {"heads": 2, "image_size": 56, "image_start_id": START, "layers": 2, "mlp_ratio": 2.5,
          "output_dim": 256, "patch_size": 14, "width": 32, "n_queries": 4}
TOKENS = VISUAL["n_queries"]
TEXT = dict(hidden_size=256, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, vocab_size=128, max_position_embeddings=512, rms_norm_eps=1e-6,
            bos_token_id=1, eos_token_id=2)


def visual_shapes(visual: dict) -> dict[str, tuple[int, ...]]:
    """The published tower's tensor names (under ``transformer.visual.``) and shapes."""
    w, out, p = visual["width"], visual["output_dim"], visual["patch_size"]
    mlp = int(w * visual["mlp_ratio"])
    shapes = {"conv1.weight": (w, 3, p, p), "positional_embedding": (256, w), "ln_pre.weight": (w,),
              "ln_pre.bias": (w,), "ln_post.weight": (out,), "ln_post.bias": (out,), "proj": (out, out),
              "attn_pool.query": (visual.get("n_queries", 256), out),
              "attn_pool.pos_embed": (visual.get("n_queries", 256), out), "attn_pool.kv_proj.weight": (out, w),
              "attn_pool.attn.in_proj_weight": (3 * out, out), "attn_pool.attn.in_proj_bias": (3 * out,),
              "attn_pool.attn.out_proj.weight": (out, out), "attn_pool.attn.out_proj.bias": (out,),
              "attn_pool.ln_q.weight": (out,), "attn_pool.ln_q.bias": (out,),
              "attn_pool.ln_kv.weight": (out,), "attn_pool.ln_kv.bias": (out,)}
    for i in range(visual["layers"]):
        block = f"transformer.resblocks.{i}."
        shapes.update({f"{block}ln_1.weight": (w,), f"{block}ln_1.bias": (w,), f"{block}ln_2.weight": (w,),
                       f"{block}ln_2.bias": (w,), f"{block}attn.in_proj.weight": (3 * w, w),
                       f"{block}attn.in_proj.bias": (3 * w,), f"{block}attn.out_proj.weight": (w, w),
                       f"{block}attn.out_proj.bias": (w,), f"{block}mlp.c_fc.weight": (mlp, w),
                       f"{block}mlp.c_fc.bias": (mlp,), f"{block}mlp.c_proj.weight": (w, mlp),
                       f"{block}mlp.c_proj.bias": (w,)})
    return shapes


def _random(shape: tuple[int, ...], is_scale: bool, gen: torch.Generator) -> torch.Tensor:
    """Norm scales near 1, everything else 0.1 * N(0, 1)."""
    noise = torch.randn(shape, generator=gen)
    return 1 + 0.1 * noise if is_scale else 0.1 * noise


def qwen_vl_config(visual: dict = VISUAL, **change) -> dict:
    """Qwen-VL-Chat's config.json fields, sized by ``TEXT`` (``intermediate_size`` counts w1 and w2)."""
    return {"architectures": ["QWenLMHeadModel"], "model_type": "qwen",
            "auto_map": {"AutoConfig": "configuration_qwen.QWenConfig",
                         "AutoModelForCausalLM": "modeling_qwen.QWenLMHeadModel"},
            "attn_dropout_prob": 0.0, "bf16": False, "emb_dropout_prob": 0.0, "fp16": False, "fp32": False,
            "hidden_size": TEXT["hidden_size"], "initializer_range": 0.02,
            "intermediate_size": 2 * TEXT["intermediate_size"],
            "kv_channels": TEXT["hidden_size"] // TEXT["num_attention_heads"], "layer_norm_epsilon": 1e-6,
            "max_position_embeddings": 8192, "no_bias": True, "num_attention_heads": TEXT["num_attention_heads"],
            "num_hidden_layers": TEXT["num_hidden_layers"], "onnx_safe": None, "rotary_emb_base": 10000,
            "rotary_pct": 1.0, "scale_attn_weights": True, "seq_length": 2048, "tie_word_embeddings": False,
            "tokenizer_type": "QWenTokenizer", "torch_dtype": "bfloat16", "transformers_version": "4.31.0",
            "use_cache": True, "use_dynamic_ntk": True, "use_flash_attn": False, "use_logn_attn": True,
            "visual": dict(visual), "vocab_size": TEXT["vocab_size"], **change}


def save_tiny_qwen_vl(path: Path, seed: int = 0, vocab_size: int = TEXT["vocab_size"], image_start_id: int = START,
                      **config_change) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """Write the tiny Qwen-VL to ``path`` (``config_change``: config.json fields replaced); returns
    (the transformers Qwen2 that is its language model, the tower's tensors by their names under
    ``transformer.visual.``)."""
    from safetensors.torch import save_file
    from test_models_remote_code_families import qwen_tensors
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    text = {**TEXT, "vocab_size": vocab_size}
    hf = Qwen2ForCausalLM(Qwen2Config(**text, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))
    hf = hf.to(torch.float32).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            param.copy_(_random(tuple(param.shape), "norm" in name and name.endswith("weight"), gen))
    tower = {name: _random(shape, "ln_" in name and name.endswith("weight"), gen)
             for name, shape in visual_shapes(VISUAL).items()}
    tensors = {**qwen_tensors(hf.state_dict()), **{f"transformer.visual.{k}": v for k, v in tower.items()}}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    config = qwen_vl_config({**VISUAL, "image_start_id": image_start_id}, vocab_size=vocab_size, **config_change)
    (path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    return hf, tower


QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<imgpad>"]


def save_byte_tokenizer(path: Path):
    """A byte-level BPE tokenizer without merges (256 byte tokens, any text encodes) and Qwen's
    special tokens after them (<|endoftext|> 256 ... <img> 259, </img> 260, <imgpad> 261), saved
    to ``path`` with no chat template: a real tokenizer small enough for a tiny model's vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                        additional_special_tokens=QWEN_SPECIAL[1:])
    tokenizer.save_pretrained(path)
    return tokenizer
