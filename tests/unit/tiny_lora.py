"""LoRA adapters for tests: made with peft on a transformers model, and the greedy tokens of the
same adapter merged into the base (``merge_and_unload``), the reference the engine must equal."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TINY_LLAMA = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, max_position_embeddings=256, rms_norm_eps=1e-6,
                  tie_word_embeddings=False)


def save_tiny_llama(path: Path, seed: int = 0) -> Path:
    """A random-weight transformers Llama (float32) saved at ``path``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).eval()
    model.save_pretrained(path)
    return path


def load_base(path: Path):
    """The transformers model at ``path``, float32, eval."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def make_adapter(base, path: Path, r: int, alpha: float, targets=ALL_TARGETS, seed: int = 1,
                 use_rslora: bool = False, scale: float = 1.0, **lora_kw) -> Path:
    """A PEFT LoRA adapter on (a copy of) ``base`` with seeded random A and B (peft starts B at
    zero, which would change nothing), saved at ``path``; ``scale`` sizes its effect."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets),
                                                            use_rslora=use_rslora, **lora_kw))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name:
                param.copy_(torch.randn(param.shape, generator=gen) / param.shape[1] ** 0.5)
            elif "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * scale / param.shape[1] ** 0.5)
    model.save_pretrained(path)
    return path


def merged(base, adapter: Path):
    """``base`` with ``adapter`` merged into its weights (peft's ``merge_and_unload``)."""
    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(base), adapter).merge_and_unload().eval()


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """``n`` greedy tokens of ``model`` after ``ids``, end tokens included and not stopped at (as
    the engine's ``ignore_eos``; ``generate``'s ``min_new_tokens`` would mask them instead)."""
    out, past, step = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            result = model(step, past_key_values=past, use_cache=True)
            past = result.past_key_values
            out.append(int(result.logits[0, -1].argmax()))
            step = torch.tensor([[out[-1]]])
    return out


def greedy_batch(eng, requests: list[tuple[list[int], str | None]], n: int) -> list[list[int]]:
    """Queue every (prompt ids, adapter name or None) on the engine ``eng`` at once and step to
    the end: each request's ``n`` greedy tokens (end tokens ignored)."""
    from conveyor.protocol.sampling import SamplingParams

    rids = [eng.add_request(p, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True,
                                              adapter_name=a)).request_id for p, a in requests]
    tokens = {rid: [] for rid in rids}
    while eng.has_work:
        for o in eng.step():
            if o.token is not None:
                tokens[o.request_id].append(o.token)
    return [tokens[rid] for rid in rids]
