"""Many LoRA adapters on one base model: output tok/s with adapters mixed in the batch vs the base
model alone, in the same process and run back to back (random weights of a published shape and
random PEFT adapters of rank ``--rank`` on all seven projections, written once under /tmp).

Cases, each ``--runs`` times alternating base / adapters so that drift hits both alike:
  * batch ``-b``: request i runs adapter i mod ``--adapters`` (S-LoRA's mixed batch), vs no adapter;
  * batch 1: one request with an adapter, vs none.
The ratio of medians is the number the issue sets targets for (>= 0.8 at batch 64 with 8
adapters of rank 16, >= 0.85 at batch 1).

    python -m benchmarks.bench_lora --model llama2-7b --adapters 8 --rank 16 -b 64
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path
from statistics import median

import torch

from benchmarks.common import dummy_engine, random_prompt, record, run_batch, save
from benchmarks.dummy_model import write_model_dir
from conveyor.protocol.sampling import SamplingParams

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(path: Path, config: dict, rank: int, seed: int) -> Path:
    """A PEFT LoRA directory of random fp16 weights for ``config``'s shape (every projection)."""
    from safetensors.torch import save_file

    if (path / "adapter_model.safetensors").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    blocks = {"o_proj": "self_attn", "q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn"}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(config["num_hidden_layers"]):
        for name, (k, n) in shapes.items():
            prefix = f"base_model.model.model.layers.{i}.{blocks.get(name, 'mlp')}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, k, generator=gen) / k ** 0.5).half()
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(n, rank, generator=gen) * 0.01).half()
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
         "bias": "none", "task_type": "CAUSAL_LM"}))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama2-7b")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-loras", type=int, default=None, help="pool slots (default: one per adapter)")
    ap.add_argument("-b", "--batch", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--eager", action="store_true", help="no decode CUDA graphs")
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    model_dir = write_model_dir(args.model, Path(tempfile.gettempdir()) / f"conveyor-dummy-{args.model}")
    config = json.loads((model_dir / "config.json").read_text())
    root = Path(tempfile.gettempdir()) / f"conveyor-lora-{args.model}-r{args.rank}"
    adapters = {f"lora{i}": str(write_adapter(root / f"lora{i}", config, args.rank, seed=i))
                for i in range(args.adapters)}
    engine = dummy_engine(args.model, args.dtype, adapters=adapters, max_loras=args.max_loras or args.adapters,
                          max_lora_rank=args.rank, eager_mode=args.eager)
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    names = list(adapters)

    def params(adapter: str | None) -> SamplingParams:
        return SamplingParams(max_new_tokens=args.output_len, temperature=0.0, ignore_eos=True, adapter_name=adapter)

    def case(batch: int, with_adapters: bool) -> dict:
        prompts = [random_prompt(rng, args.input_len, vocab) for _ in range(batch)]
        per = [params(names[i % len(names)] if with_adapters else None) for i in range(batch)]
        r = run_batch(engine, prompts, per)
        r.pop("lengths")
        return r

    common = dict(engine="conveyor", model=args.model, model_format="hf", quant_policy=0, tp=1,
                  precision=args.dtype, input_len=args.input_len, output_len=args.output_len,
                  adapters=args.adapters, lora_rank=args.rank, eager=args.eager)
    records = []
    for batch in sorted({args.batch, 1}, reverse=True):
        case(batch, False)  # warm-up: kernels compile, adapters page in
        case(batch, True)
        runs: dict[bool, list[dict]] = {False: [], True: []}
        for _ in range(args.runs):
            for with_adapters in (False, True):
                runs[with_adapters].append(case(batch, with_adapters))
        medians = {k: median(r["out_tok_s"] for r in v) for k, v in runs.items()}
        ratio = medians[True] / medians[False]
        print(f"batch {batch}: base {medians[False]:.1f} out tok/s, with adapters {medians[True]:.1f} "
              f"({ratio:.3f}x; runs {[round(r['out_tok_s'], 1) for r in runs[False]]} vs "
              f"{[round(r['out_tok_s'], 1) for r in runs[True]]})", flush=True)
        for with_adapters, rs in runs.items():
            best = sorted(rs, key=lambda r: r["out_tok_s"])[len(rs) // 2]
            records.append(record(benchmark="bench_lora_" + ("adapters" if with_adapters else "base"), **common,
                                  batch=batch, out_tok_s=medians[with_adapters], ttft_ms=best["ttft_ms"],
                                  runs_out_tok_s=[r["out_tok_s"] for r in rs],
                                  ratio_to_base=ratio if with_adapters else 1.0))
    out = save(records, args.name or f"bench_lora_{args.model}")
    print(f"saved {out}")


if __name__ == "__main__":
    main()
