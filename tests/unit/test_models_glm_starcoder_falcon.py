"""GLM / GLM-4 / ChatGLM, StarCoder2, Falcon and Phi-4-mini's partial rotary against transformers:
tiny random models built with transformers' own config classes, saved with ``save_pretrained``
(or, for ChatGLM, converted to THUDM's checkpoint layout), loaded by the engine; logits (CPU,
float32) and greedy tokens must match. The helpers are test_models.py's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_models import (
    TINY,
    check_chunked_prefill,
    check_greedy_matches_generate,
    check_prefill_then_decode,
    check_prefills,
    check_two_sequence_batch,
    load_ours,
    save_tiny,
)
from transformers import AutoModelForCausalLM, Glm4Config, GlmConfig

pytestmark = pytest.mark.usefixtures("torch_single_thread")  # tiny models: see tests/conftest.py

IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _configs() -> dict[str, object]:
    return {
        # Half of each 16-dim head rotated, in interleaved pairs; q/k/v bias, GQA 4/2.
        "glm": GlmConfig(**TINY, head_dim=16, **IDS),
        # GLM-4-0414: post-attention and post-MLP norms; MQA, no bias, tied head.
        "glm4_mqa_tied": Glm4Config(**{**TINY, "num_key_value_heads": 1}, head_dim=16, attention_bias=False,
                                    tie_word_embeddings=True, **IDS),
    }


@pytest.fixture(scope="module", params=sorted(_configs()))
def tiny(request, tmp_path_factory) -> tuple[torch.nn.Module, torch.nn.Module, Path]:
    """(HF reference model loaded back from disk, ours loaded from the same files, the directory)."""
    name = request.param
    path = tmp_path_factory.mktemp(name)
    save_tiny(_configs()[name], path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return hf, load_ours(path), path


def test_prefill_matches_hf(tiny) -> None:
    """Single-sequence prefills of several lengths."""
    hf, ours, _ = tiny
    check_prefills(hf, ours)


def test_two_sequence_batch_matches_hf(tiny) -> None:
    """Two sequences flattened into one prefill batch."""
    hf, ours, _ = tiny
    check_two_sequence_batch(hf, ours)


def test_prefill_then_decode_matches_hf(tiny) -> None:
    """Prefill, then a batched and a single decode step reading the cached keys."""
    hf, ours, _ = tiny
    check_prefill_then_decode(hf, ours)


def test_chunked_prefill_matches_hf(tiny) -> None:
    """A prefill split in two chunks (the second attends to the cached first)."""
    hf, ours, _ = tiny
    check_chunked_prefill(hf, ours)


def test_greedy_tokens_match_hf_generate(tiny) -> None:
    """Greedy decoding through the engine (scheduler, runner, sampler) equals ``generate``."""
    hf, _, path = tiny
    check_greedy_matches_generate(hf, path, IDS["eos_token_id"])
