"""Tensor parallel against one rank on the same weights: greedy tokens and top logprobs.

    python -m benchmarks.tp_correctness [--model llama2-7b] [--layers 4] [--tp 2]

Writes a checkpoint of ``--model``'s shape cut to ``--layers`` decoder layers (full width:
every matmul, head split and the vocabulary are the real model's), with seeded random weights
(std 0.02), as safetensors; then runs the same batch of prompts at tp=1 and at ``--tp`` through
the real loading path (each rank reads its slices) and compares each step's greedy token and
top-5 logprobs. ``load_format="dummy"`` cannot serve here: each rank would draw its own shard,
not a slice of one model. Saves ``tp_correctness_tp<N>`` with the agreement numbers.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

import torch


def write_checkpoint(shape: str, layers: int, dest: Path, seed: int = 0) -> Path:
    """``shape`` cut to ``layers`` layers, with random fp16 weights in one safetensors file per layer."""
    from safetensors.torch import save_file

    from benchmarks.dummy_model import SHAPES

    cfg = {**SHAPES[shape], "num_hidden_layers": layers}
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(cfg, indent=2))
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * d
    gen = torch.Generator(device="cuda" if torch.cuda.is_available() else "cpu").manual_seed(seed)

    def rnd(*shape):
        return (torch.randn(*shape, generator=gen, device=gen.device) * 0.02).half().cpu()

    files = {"model.embed_tokens.weight": rnd(v, h), "lm_head.weight": rnd(v, h),
             "model.norm.weight": torch.ones(h, dtype=torch.float16)}
    save_file(files, str(dest / "model-head.safetensors"))
    index = {name: "model-head.safetensors" for name in files}
    for i in range(layers):
        p = f"model.layers.{i}."
        t = {p + "self_attn.q_proj.weight": rnd(h, h), p + "self_attn.k_proj.weight": rnd(kv, h),
             p + "self_attn.v_proj.weight": rnd(kv, h), p + "self_attn.o_proj.weight": rnd(h, h),
             p + "mlp.gate_proj.weight": rnd(inter, h), p + "mlp.up_proj.weight": rnd(inter, h),
             p + "mlp.down_proj.weight": rnd(h, inter),
             p + "input_layernorm.weight": torch.ones(h, dtype=torch.float16),
             p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.float16)}
        save_file(t, str(dest / f"model-{i:03d}.safetensors"))
        index.update({name: f"model-{i:03d}.safetensors" for name in t})
    (dest / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    return dest


def trace(path: Path, tp: int, prompts: list[list[int]], n: int,
          all_reduce: str = "nccl") -> tuple[list[list[int]], list[list[dict]]]:
    from conveyor.engine.config import EngineConfig
    from conveyor.engine.llm_engine import LLMEngine
    from conveyor.protocol.sampling import SamplingParams

    eng = LLMEngine(path, EngineConfig(tp=tp, dtype="float16", cache_max_entry_count=0.3, max_batch_size=64,
                                       tp_all_reduce=all_reduce if tp > 1 else "nccl"))
    try:
        for i, p in enumerate(prompts):
            eng.add_request(p, SamplingParams(max_new_tokens=n, temperature=0.0, logprobs=5, ignore_eos=True),
                            request_id=str(i))
        tokens = {str(i): [] for i in range(len(prompts))}
        tops = {str(i): [] for i in range(len(prompts))}
        while eng.has_work:
            for o in eng.step():
                if o.token is not None:
                    tokens[o.request_id].append(o.token)
                    tops[o.request_id].append(dict(o.top_logprobs))
    finally:
        eng.close()
    return [tokens[str(i)] for i in range(len(prompts))], [tops[str(i)] for i in range(len(prompts))]


def main() -> None:
    from benchmarks.common import record, save

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama2-7b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--tp-all-reduce", default="nccl",
                    help="the tp>1 run's all-reduce path (EngineConfig.tp_all_reduce)")
    args = ap.parse_args()
    path = write_checkpoint(args.model, args.layers,
                            Path(tempfile.gettempdir()) / f"tp-check-{args.model}-{args.layers}")
    from benchmarks.dummy_model import SHAPES

    rng = random.Random(0)
    vocab = SHAPES[args.model]["vocab_size"]
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randrange(8, 200))] for _ in range(args.prompts)]
    ref_tok, ref_top = trace(path, 1, prompts, args.new_tokens)
    got_tok, got_top = trace(path, args.tp, prompts, args.new_tokens, args.tp_all_reduce)
    same_prompts = sum(a == b for a, b in zip(ref_tok, got_tok))
    # Logprob differences over the steps where both runs chose the same tokens so far.
    diffs = []
    for ta, tb, sa, sb in zip(ref_tok, got_tok, ref_top, got_top):
        for step, (x, y) in enumerate(zip(sa, sb)):
            diffs += [abs(x[t] - y[t]) for t in x.keys() & y.keys()]
            if ta[step] != tb[step]:
                break
    worst = max(diffs) if diffs else None
    mean = sum(diffs) / len(diffs) if diffs else None
    print(f"tp={args.tp} ({args.tp_all_reduce}) vs tp=1, {args.model} x {args.layers} layers: identical greedy "
          f"tokens for {same_prompts}/{len(prompts)} prompts; top-5 logprob |diff| mean {mean:.2e}, max {worst:.2e}")
    save([record(engine="conveyor", model=f"{args.model}-{args.layers}l", benchmark="tp_correctness", tp=args.tp,
                 batch=len(prompts), output_len=args.new_tokens, precision="float16", model_format="hf",
                 quant_policy=0, tp_all_reduce=args.tp_all_reduce,
                 identical_prompts=same_prompts, logprob_diff_mean=mean, logprob_diff_max=worst)],
         f"tp_correctness_tp{args.tp}_{args.tp_all_reduce}")


if __name__ == "__main__":
    main()
