"""The batch-1 cases through Hugging Face transformers, on the same shape with random weights.

transformers' fastest documented single-request path is ``generate`` with a static KV cache,
whose decode steps it compiles with ``torch.compile`` (``mode="reduce-overhead"``: CUDA graphs)
on its own when the cache is static. Measured here, each after an unmeasured warm-up run:

* ``static``: static cache, compilation disabled (``disable_compile=True``);
* ``static+compile``: static cache with the automatic compilation (skipped with --no-compile);
* first-token latency of a 2048-token prompt (``generate(max_new_tokens=1)``, eager prefill).

The weights are random (``LlamaForCausalLM(config)`` initialized on the GPU), as for conveyor's
runs: the kernels do not depend on the values. ``min_new_tokens`` keeps every run at exactly
``output_len`` tokens.

    python -m benchmarks.hf_baseline --model llama2-7b
"""

from __future__ import annotations

import argparse
import time
from statistics import median

import torch

from benchmarks.common import record, save
from benchmarks.dummy_model import SHAPES


def build(shape: str, dtype: torch.dtype):
    """LlamaForCausalLM of ``shape``, random weights, on the GPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(SHAPES[shape])
    cfg.pop("architectures", None)
    cfg.pop("torch_dtype", None)
    config = LlamaConfig(**cfg)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM._from_config(config, dtype=dtype)
    return model.eval()


def timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama2-7b")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=512)
    ap.add_argument("--ttft-len", type=int, default=2048)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    import transformers

    dtype = torch.float16
    model = build(args.model, dtype)
    vocab = model.config.vocab_size
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(100, vocab, (1, args.input_len), device="cuda", generator=gen)
    long_ids = torch.randint(100, vocab, (1, args.ttft_len), device="cuda", generator=gen)
    common = dict(do_sample=False, max_new_tokens=args.output_len, min_new_tokens=args.output_len,
                  cache_implementation="static", pad_token_id=0)
    records = []
    base = dict(engine=f"transformers {transformers.__version__}", model=args.model, precision="float16",
                batch=1, input_len=args.input_len, output_len=args.output_len)

    with torch.inference_mode():
        ttft = []
        for i in range(4):  # first run warms up
            dt = timed(lambda: model.generate(long_ids, do_sample=False, max_new_tokens=1, pad_token_id=0))
            if i:
                ttft.append(dt)
        print(f"2048-token prompt, first token: {median(ttft) * 1e3:.1f} ms", flush=True)
        records.append(record(**{**base, "input_len": args.ttft_len, "output_len": 1},
                              benchmark="hf_first_token", ttft_ms=median(ttft) * 1e3))

        variants = [("static", True)] + ([] if args.no_compile else [("static+compile", False)])
        for label, disable in variants:
            t = timed(lambda: model.generate(ids, disable_compile=disable, **common))  # warm-up / compile
            print(f"{label}: warm-up run {t:.1f}s", flush=True)
            runs = [timed(lambda: model.generate(ids, disable_compile=disable, **common)) for _ in range(2)]
            wall = median(runs)
            tok_s = args.output_len / wall
            print(f"{label}: {tok_s:.1f} out tok/s (bs 1, {args.input_len} in / {args.output_len} out)", flush=True)
            records.append(record(**base, benchmark=f"hf_generate_{label}", out_tok_s=tok_s, wall_s=wall,
                                  warmup_s=t))
            save(records, args.name or f"hf_baseline_{args.model}")
    path = save(records, args.name or f"hf_baseline_{args.model}")
    print(f"saved {path}")


if __name__ == "__main__":
    main()
