"""Qwen3, InternLM3, OLMo 2, the Mistral-Nemo shape (head_dim from the config) and Llama 3.1's
rope scaling against transformers: tiny random models built with transformers' own config classes,
saved with ``save_pretrained``, loaded by the engine; logits (CPU, float32) and greedy tokens
must match. The helpers are test_models.py's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_models import (
    check_greedy_matches_generate,
    check_chunked_prefill,
    check_prefill_then_decode,
    check_prefills,
    check_two_sequence_batch,
    TINY,
    assert_close,
    load_ours,
    save_tiny,
)
from tiny_llama import engine
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Olmo2Config, Qwen3Config

from conveyor.engine.model_config import ModelConfig
from conveyor.engine.models import build_model
from conveyor.protocol.errors import EngineConfigError, UnsupportedModelError

# transformers added InternLM3 late (5.17 lacks it): its cases run where it is installed.
InternLM3Config = getattr(transformers, "InternLM3Config", None)

pytestmark = pytest.mark.usefixtures("torch_single_thread")  # tiny models: see tests/conftest.py

IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
# Llama 3.1's rope_scaling, with an original context short enough that the tiny head's
# frequencies fall in all three bands (kept, blended, divided by factor).
LLAMA31_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
# Each saved config.json's architectures, where transformers' class writes another name.
ARCHITECTURE = {"internlm3": "InternLM3ForCausalLM"}


def _configs() -> dict[str, object]:
    return {
        # head_dim 32 from the config: 4 heads * 32 = 128 != hidden 64 (Qwen3's 128 everywhere).
        "qwen3": Qwen3Config(**TINY, head_dim=32, **IDS),
        "qwen3_tied_mqa_bias": Qwen3Config(**{**TINY, "num_key_value_heads": 1}, head_dim=16,
                                           tie_word_embeddings=True, attention_bias=True, **IDS),
        # q/k norms over the whole projection; norms after attention and the MLP, none before.
        "olmo2": Olmo2Config(**TINY, **IDS),
        # Mistral-Nemo: head_dim 128 with hidden 5120 / 32 heads = 160; here 32 vs 16.
        "mistral_nemo_shape": MistralConfig(**TINY, head_dim=32, sliding_window=None, **IDS),
        # Llama 3.1: llama3 rope scaling (and a head_dim of its own, as Llama 3.2 1B/3B would allow).
        "llama31_rope": LlamaConfig(**TINY, head_dim=32, rope_parameters=LLAMA31_ROPE, **IDS),
    } | ({"internlm3": InternLM3Config(**TINY, head_dim=32, **IDS)} if InternLM3Config else {})


@pytest.fixture(scope="module", params=sorted(_configs()))
def tiny(request, tmp_path_factory) -> tuple[torch.nn.Module, torch.nn.Module, Path]:
    """(HF reference model loaded back from disk, ours loaded from the same files, the directory)."""
    name = request.param
    path = tmp_path_factory.mktemp(name)
    save_tiny(_configs()[name], path)
    if name in ARCHITECTURE:
        cfg = json.loads((path / "config.json").read_text())
        cfg["architectures"] = [ARCHITECTURE[name]]
        (path / "config.json").write_text(json.dumps(cfg))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return hf, load_ours(path), path


def test_prefill_matches_hf(tiny) -> None:
    """Single-sequence prefills of several lengths (past the llama3 original context of 32)."""
    hf, ours, _ = tiny
    check_prefills(hf, ours, (5, 13, 40))


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
    check_greedy_matches_generate(hf, path, IDS["eos_token_id"], (50, 51, 52))


def test_head_dim_and_qk_norms_come_from_the_config(tiny) -> None:
    """The attention uses the config's head_dim; Qwen3 alone has the [head_dim] q/k norm scales."""
    hf, ours, _ = tiny
    attn = ours.model.layers[0].self_attn
    head_dim = getattr(hf.config, "head_dim", None) or hf.config.hidden_size // hf.config.num_attention_heads
    assert attn.head_dim == head_dim
    assert attn.rotary_emb.cos_sin_cache.shape[-1] == head_dim
    if ours.config.architecture in ("Qwen3ForCausalLM", "Olmo2ForCausalLM"):
        assert_close(attn.q_norm.weight, hf.model.layers[0].self_attn.q_norm.weight)
        assert_close(attn.k_norm.weight, hf.model.layers[0].self_attn.k_norm.weight)
    else:
        assert attn.q_norm is None and attn.k_norm is None


@pytest.mark.skipif(InternLM3Config is None, reason="this transformers has no InternLM3")
def test_internlm3_unequal_bias_flags_are_refused_before_loading() -> None:
    """transformers refuses qkv_bias != bias; so does the engine, when the model is built."""
    cfg = InternLM3Config(**TINY, head_dim=32, **IDS).to_dict()
    cfg.update(architectures=["InternLM3ForCausalLM"], qkv_bias=True, bias=False)
    cfg.pop("attention_bias", None)
    cfg.pop("mlp_bias", None)
    with pytest.raises(UnsupportedModelError, match="qkv_bias"):
        build_model(ModelConfig.from_dict(cfg), dtype=torch.float32)


def test_olmo2_at_tp2_is_refused_before_any_rank_starts(tiny) -> None:
    """OLMo 2's q/k norm takes its mean over all heads: tp>1 is an EngineConfigError naming tp=1."""
    _, ours, path = tiny
    if ours.config.architecture != "Olmo2ForCausalLM":
        pytest.skip("OLMo 2 only")
    with pytest.raises(EngineConfigError, match="tp=1"):
        engine(path, tp=2)


@pytest.mark.parametrize("tp", [2])
def test_qwen3_tp_matches_tp1(tiny, tp) -> None:
    """Qwen3's per-head q/k norms under tensor parallel (CPU, gloo): each rank's heads normed with
    the whole [head_dim] scale give tp=1's greedy tokens and logprobs."""
    from test_tensor_parallel import _run, _same

    _, ours, path = tiny
    if ours.config.architecture != "Qwen3ForCausalLM":
        pytest.skip("Qwen3 only")
    (trace1, ppl1), (trace_tp, ppl_tp) = _run(path, 1), _run(path, tp)
    _same(trace1, trace_tp)
    assert ppl_tp == pytest.approx(ppl1, rel=1e-4)
