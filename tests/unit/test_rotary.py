"""The RoPE cos/sin cache equals transformers' rotary embedding for every supported rope type."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from conveyor.engine.layers.rotary import get_rope, rope_scaling_for
from conveyor.engine.model_config import ModelConfig

HEAD_DIM = 32
MAX_POS = 64


def _hf_config(**kwargs) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=HEAD_DIM * 4, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
        intermediate_size=64, vocab_size=32, max_position_embeddings=MAX_POS, **kwargs,
    )


def _ours(hf_config: LlamaConfig, rope_scaling_factor: float = 0.0, max_position: int | None = None):
    cfg = hf_config.to_dict()
    cfg["architectures"] = ["LlamaForCausalLM"]
    return get_rope(ModelConfig.from_dict(cfg), rope_scaling_factor, max_position)


def _hf_rows(hf_config: LlamaConfig, positions: torch.Tensor) -> torch.Tensor:
    """HF cos/sin for ``positions`` of one sequence, in our cache layout (half-dim cos | sin)."""
    rope = LlamaRotaryEmbedding(hf_config)
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = rope(x, positions[None])
    half = HEAD_DIM // 2
    return torch.cat([cos[0, :, :half], sin[0, :, :half]], dim=-1)


CASES = {
    "default": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    "default_theta": {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
    "linear": {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}},
    "llama3": {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
    }},
    "yarn": {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
    }},
    "dynamic": {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_cache_matches_hf_within_context(case: str) -> None:
    """Rows 0..max_position_embeddings equal HF's cos/sin exactly."""
    hf_config = _hf_config(**CASES[case])
    rope = _ours(hf_config)
    assert rope.cos_sin_cache.dtype == torch.float32
    positions = torch.arange(MAX_POS)
    expected = _hf_rows(hf_config, positions)
    torch.testing.assert_close(rope.cos_sin_cache[:MAX_POS], expected, rtol=0, atol=0)


def test_old_rope_scaling_spelling() -> None:
    """Top-level rope_theta + rope_scaling {"type": ...} reads the same as rope_parameters."""
    hf_config = _hf_config(rope_parameters={"rope_type": "linear", "rope_theta": 20000.0, "factor": 2.0})
    cfg = {k: v for k, v in hf_config.to_dict().items() if k != "rope_parameters"}
    cfg.update(architectures=["LlamaForCausalLM"], rope_theta=20000.0, rope_scaling={"type": "linear", "factor": 2.0})
    rope = get_rope(ModelConfig.from_dict(cfg))
    torch.testing.assert_close(
        rope.cos_sin_cache[:MAX_POS], _hf_rows(hf_config, torch.arange(MAX_POS)), rtol=0, atol=1e-6
    )


def test_dynamic_past_context_matches_hf_decode() -> None:
    """Past max_position_embeddings, row p equals HF's rotation of the last token of a p+1 sequence."""
    hf_config = _hf_config(**CASES["dynamic"])
    rope = _ours(hf_config)
    assert rope.cos_sin_cache.shape[0] == 2 * MAX_POS
    for p in (MAX_POS, MAX_POS + 7, 2 * MAX_POS - 1):
        expected = _hf_rows(hf_config, torch.arange(p + 1))[-1]
        torch.testing.assert_close(rope.cos_sin_cache[p], expected, rtol=1e-5, atol=1e-5)


def test_rope_scaling_factor_override_is_dynamic_ntk() -> None:
    """LMDeploy's rope_scaling_factor: dynamic NTK, unless the config already scales RoPE."""
    plain = _hf_config(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    rope = _ours(plain, rope_scaling_factor=2.0)
    assert rope.rope_scaling == {"rope_type": "dynamic", "factor": 2.0}
    reference = _ours(_hf_config(**CASES["dynamic"]))
    torch.testing.assert_close(rope.cos_sin_cache, reference.cos_sin_cache, rtol=0, atol=0)
    assert rope_scaling_for({"rope_type": "linear", "factor": 4.0}, 2.0) == {"rope_type": "linear", "factor": 4.0}
    assert rope_scaling_for({"rope_type": "default"}, 0.0) is None


def test_cache_stays_float32_through_casts() -> None:
    """Casting the module keeps the table float32 and unchanged."""
    rope = _ours(_hf_config(**CASES["llama3"]), max_position=100)
    before = rope.cos_sin_cache.clone()
    rope.to(torch.bfloat16)
    assert rope.cos_sin_cache.dtype == torch.float32 and rope.cos_sin_cache.shape == (100, HEAD_DIM)
    assert torch.equal(rope.cos_sin_cache, before)
