"""Tiny random Hugging Face Llamas for the quantization tools' tests: norms with outlier channels
(as real LLMs have), a word-level tokenizer, calibration text, and a model directory fixture."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conveyor.engine.quantization import calibration_windows

WORDS = ("the a of and to in was he she it his her that with for on as at by from had not but were this "
         "which be have they all one or so my an me we no if are who when there their been would more out "
         "time night sea ice ship cold light dark storm shore snow wind creature river mountain friend").split()
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=256, rms_norm_eps=1e-5)


def tiny_model_dir(tmp_path: Path) -> Path:
    """A tiny Llama checkpoint directory with a tokenizer (GQA 4/2, group size 32 fits every layer), and
    ``calib.txt`` beside it."""
    out = tmp_path / "tiny-llama"
    tiny_model().save_pretrained(out)
    tokenizer().save_pretrained(out)
    (tmp_path / "calib.txt").write_text(text())
    return out


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[UNK]", "<s>", "</s>", *WORDS, ",", "."])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="[UNK]")


def tiny_model(kv_heads: int = 2, seed: int = 0, tie: bool = False) -> LlamaForCausalLM:
    """A random Llama whose norms give a few input channels large activations, as real LLMs have."""
    torch.manual_seed(seed)
    config = LlamaConfig(**TINY, num_key_value_heads=kv_heads, vocab_size=len(WORDS) + 5, tie_word_embeddings=tie)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.1 * torch.randn(param.shape, generator=gen))
                param[torch.randperm(param.numel(), generator=gen)[:3]] *= 12  # outlier channels
            else:
                param.copy_(0.08 * torch.randn(param.shape, generator=gen))
    return model


def text(words: int = 3000, seed: int = 0) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def windows(n: int = 8, seqlen: int = 32) -> torch.Tensor:
    ids = tokenizer()(text(), add_special_tokens=False)["input_ids"]
    return calibration_windows(ids, n, seqlen)


def logits(model: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits
