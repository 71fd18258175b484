"""A tiny Llama for engine tests on checkpoints written by the test itself (dense or quantized)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from conveyor.engine.config import EngineConfig
from conveyor.engine.llm_engine import LLMEngine
from conveyor.protocol.sampling import SamplingParams

TINY = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, intermediate_size=96,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
            max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0, torch_dtype="float32",
            tie_word_embeddings=False)
LINEARS = {"self_attn.q_proj": (64, 64), "self_attn.k_proj": (64, 32), "self_attn.v_proj": (64, 32),
           "self_attn.o_proj": (64, 64), "mlp.gate_proj": (64, 96), "mlp.up_proj": (64, 96),
           "mlp.down_proj": (96, 64)}  # (in, out)


def random_tensors(gen: torch.Generator) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the non-linear tensors: embeddings, norms, lm_head; each decoder linear's dense [out, in] weight)."""
    common = {"model.embed_tokens.weight": torch.randn(128, 64, generator=gen) * 0.5,
              "model.norm.weight": 1 + 0.1 * torch.randn(64, generator=gen),
              "lm_head.weight": torch.randn(128, 64, generator=gen) * 0.1}
    linears = {}
    for i in range(TINY["num_hidden_layers"]):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            common[f"model.layers.{i}.{norm}.weight"] = 1 + 0.1 * torch.randn(64, generator=gen)
        for name, (k, n) in LINEARS.items():
            linears[f"model.layers.{i}.{name}"] = torch.randn(n, k, generator=gen) * 0.2
    return common, linears


def write_checkpoint(path: Path, tensors: dict[str, torch.Tensor], **config) -> Path:
    """A model directory: TINY's config.json (with ``config``'s changes) and ``tensors``."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({**TINY, **config}))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


def engine(path: Path, process_group: bool = False, **kw) -> LLMEngine:
    """A CPU float32 engine on ``path`` with a small cache (``process_group``: LLMEngine's)."""
    return LLMEngine(path, EngineConfig(device="cpu", dtype="float32", cache_max_entry_count=32, block_size=4,
                                        max_batch_size=4, max_prefill_token_num=64, **kw),
                     process_group=process_group)


def greedy(eng: LLMEngine, prompt: list[int], n: int = 12) -> list[int]:
    """``n`` greedy tokens after ``prompt``."""
    eng.add_request(prompt, SamplingParams(max_new_tokens=n, temperature=0.0))
    out = []
    while eng.has_work:
        out += [o.token for o in eng.step() if o.token is not None]
    return out
