"""The real test model (SmolLM2-135M-Instruct) loads and matches Hugging Face's logits."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from conveyor.engine.attention_metadata import AttentionMetadata, set_attention_metadata
from conveyor.engine.models import build_model
from conveyor.engine.weight_loader import load_model, load_model_config, resolve_model_path

TOL = 1e-3
BLOCK_SIZE = 16
PROMPT_LEN = 20


def _prompt(vocab_size: int) -> list[int]:
    return torch.randint(0, vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(0)).tolist()


def _conveyor_logits(path: Path, tokens: list[int]) -> torch.Tensor:
    """Load with conveyor (float32) and prefill ``tokens`` through a paged cache (reversed blocks)."""
    config = load_model_config(path)
    model = load_model(build_model(config, dtype=torch.float32), path)
    num_blocks = 4
    for attn in model.attention_layers():
        shape = (num_blocks, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
        attn.k_cache, attn.v_cache = torch.zeros(shape), torch.zeros(shape)
    blocks = [3, 1]
    n = len(tokens)
    set_attention_metadata(AttentionMetadata(
        slot_mapping=torch.tensor([blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(n)]),
        block_tables=torch.tensor([blocks], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
        seqlens_k=torch.tensor([n], dtype=torch.int32),
        max_seqlen_q=n, max_seqlen_k=n,
    ))
    try:
        with torch.no_grad():
            return model.compute_logits(model(torch.tensor(tokens), torch.arange(n)))
    finally:
        set_attention_metadata(None)


@pytest.fixture(scope="module")
def reference(smollm2_dir: Path) -> tuple[list[int], torch.Tensor]:
    """(prompt, Hugging Face float32 logits for it) from the safetensors test model."""
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    tokens = _prompt(hf.config.vocab_size)
    with torch.no_grad():
        return tokens, hf(torch.tensor([tokens])).logits[0].float()


def test_safetensors_model_matches_hf(smollm2_dir: Path, reference) -> None:
    """The safetensors test model's logits match Hugging Face's."""
    tokens, ref = reference
    assert resolve_model_path(str(smollm2_dir)) == smollm2_dir
    diff = (_conveyor_logits(smollm2_dir, tokens) - ref).abs().max().item()
    assert diff < TOL, f"max abs diff {diff:.3g}"


def test_gguf_model_matches_hf(smollm2_dir: Path, reference) -> None:
    """Loads the Q4_1 GGUF file the safetensors test model was converted from (kept beside it)."""
    pytest.importorskip("gguf")
    from conveyor.default_model import gguf_path

    path = resolve_model_path(os.environ.get("CONVEYOR_TEST_GGUF") or gguf_path(smollm2_dir))
    tokens, ref = reference
    # The cached safetensors model is this file dequantized, so the same reference applies.
    diff = (_conveyor_logits(path, tokens) - ref).abs().max().item()
    assert diff < TOL, f"max abs diff {diff:.3g}"
