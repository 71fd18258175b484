"""LMDeploy's profile_generation, on the engine directly: a grid of batch x input x output lengths.

For each case, ``batch`` requests of random token ids of ``input_len`` are submitted at once
(``ignore_eos``, greedy, exactly ``output_len`` new tokens) and ``LLMEngine.step()`` is called
until they finish. Reported per case: output tok/s (all output tokens / wall time), first-token
latency (submission to the step that returned the first token: mean, min, max), per-token
latency P50/P75/P95/P99 (gaps between a request's consecutive tokens), and peak GPU memory
(what PyTorch reserved: weights, KV cache, activations, graphs). Each case runs once unmeasured
first, so Triton compilation stays out of the numbers. No HTTP, no tokenizer.

    python -m benchmarks.profile_generation --model llama2-7b            # default grid
    python -m benchmarks.profile_generation -b 1 -c 128:512 -c 2048:1   # chosen cases

``--hf-baseline`` first runs the batch-1 cases through transformers ``generate`` (static cache,
with and without ``torch.compile``: ``benchmarks/hf_baseline.py``) in a child process, so its
GPU memory is gone before the engine sizes its cache, and puts those records in the same
results file: every file then carries its own baseline, measured on the same machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import mean

import torch

from conveyor.engine.config import KERNEL_MODES, parse_cache_size
from benchmarks.common import add_tp_arguments, dummy_engine, percentile, random_prompt, record, save, tp_fields
from conveyor.protocol.sampling import SamplingParams

DEFAULT_BATCHES = (1, 16, 32, 64)
DEFAULT_CASES = ((128, 128), (128, 512), (2048, 1), (2048, 128))


def run_case(engine, batch: int, input_len: int, output_len: int, seed: int = 0) -> dict:
    """Submit ``batch`` requests at once and step until done; returns the measured numbers."""
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    prompts = [random_prompt(rng, input_len, vocab) for _ in range(batch)]
    params = SamplingParams(max_new_tokens=output_len, temperature=0.0, top_k=1, ignore_eos=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    seqs = [engine.add_request(p, params) for p in prompts]
    arrivals: dict[str, list[float]] = {s.request_id: [] for s in seqs}
    steps = 0
    while engine.has_work:
        outs = engine.step()
        now = time.perf_counter()
        steps += 1
        for o in outs:
            if o.token is not None and o.request_id in arrivals:
                arrivals[o.request_id].append(now)
    wall = time.perf_counter() - t0
    ttft = [a[0] - t0 for a in arrivals.values() if a]
    gaps = [b - a for times in arrivals.values() for a, b in zip(times, times[1:])]
    n_out = sum(len(a) for a in arrivals.values())
    peak = torch.cuda.max_memory_reserved() / 1e9 if torch.cuda.is_available() else None
    return {
        "wall_s": wall, "steps": steps, "out_tokens": n_out, "out_tok_s": n_out / wall,
        "ttft_ms": mean(ttft) * 1e3, "ttft_min_ms": min(ttft) * 1e3, "ttft_max_ms": max(ttft) * 1e3,
        "tpot_p50_ms": _ms(percentile(gaps, 50)), "tpot_p75_ms": _ms(percentile(gaps, 75)),
        "tpot_p95_ms": _ms(percentile(gaps, 95)), "tpot_p99_ms": _ms(percentile(gaps, 99)),
        "peak_mem_gb": peak,
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def hf_baseline_records(model: str) -> list[dict]:
    """Run benchmarks/hf_baseline.py in a child process (its memory freed on exit); its records."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "BENCH_OUT": tmp}
        cmd = [sys.executable, "-m", "benchmarks.hf_baseline", "--model", model, "--name", "_hf_baseline_child"]
        subprocess.run(cmd, env=env, check=True)
        records = json.loads((Path(tmp) / "_hf_baseline_child.json").read_text())
    (Path(__file__).parent / "results" / "h100" / "_hf_baseline_child.json").unlink(missing_ok=True)
    return records


def parse_case(text: str) -> tuple[int, int]:
    """'IN:OUT' -> (IN, OUT)."""
    a, b = text.split(":")
    return int(a), int(b)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama2-7b", help="a shape of benchmarks.dummy_model")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("-b", "--batch", type=int, action="append", help="batch sizes (repeatable)")
    ap.add_argument("-c", "--case", type=parse_case, action="append", help="IN:OUT token lengths (repeatable)")
    ap.add_argument("--max-batch-size", type=int, default=256)
    ap.add_argument("--cache-max-entry-count", type=parse_cache_size, default=0.8)
    ap.add_argument("--quant-policy", type=int, default=0, choices=[0, 4, 8], help="KV cache: 0 (16-bit), 8 or 4 bits")
    add_tp_arguments(ap)
    ap.add_argument("--model-format", default=None, choices=[None, "hf", "awq", "smooth_quant"],
                    help="awq: the decoder linears as 4-bit AWQ weights (random, group size 128); "
                         "smooth_quant: as W8A8 int8 weights (random) with per-token int8 activations")
    ap.add_argument("--kernels", default="auto", choices=KERNEL_MODES,
                    help="EngineConfig.kernels: 'triton' leaves the CUDA C++ kernels out (an A/B against 'auto')")
    ap.add_argument("--process-group", action="store_true",
                    help="join a process group even at tp=1 (every collective runs, on one GPU)")
    ap.add_argument("--name", default=None, help="results file name (default profile_generation_<model>)")
    ap.add_argument("--hf-baseline", action="store_true",
                    help="also run transformers generate on the batch-1 cases, into the same file")
    args = ap.parse_args()
    batches = args.batch or list(DEFAULT_BATCHES)
    cases = args.case or list(DEFAULT_CASES)
    baseline = hf_baseline_records(args.model) if args.hf_baseline else []

    t = time.perf_counter()
    engine = dummy_engine(args.model, args.dtype, max_batch_size=args.max_batch_size,
                          cache_max_entry_count=args.cache_max_entry_count, model_format=args.model_format,
                          quant_policy=args.quant_policy, tp=args.tp, tp_all_reduce=args.tp_all_reduce,
                          kernels=args.kernels, process_group=args.process_group)
    graphs = engine.runner.decode_graphs
    print(f"engine ready in {time.perf_counter() - t:.1f}s: {engine.runner.num_blocks} KV blocks of "
          f"{engine.config.block_size}, activations {engine.runner.activation_bytes / 2**30:.2f} GiB, "
          f"graphs {graphs.sizes if graphs else None}", flush=True)
    records = []
    header = (f"{'batch':>5} {'in':>5} {'out':>5} | {'out tok/s':>10} {'ttft ms':>9} {'p50 ms':>7} {'p99 ms':>7} "
              f"{'peak GB':>8}")
    print(header, flush=True)
    for batch in batches:
        for input_len, output_len in cases:
            run_case(engine, batch, input_len, min(output_len, 4), seed=1)  # warm-up: compile kernels
            r = run_case(engine, batch, input_len, output_len)
            print(f"{batch:>5} {input_len:>5} {output_len:>5} | {r['out_tok_s']:>10.1f} {r['ttft_ms']:>9.1f} "
                  f"{r['tpot_p50_ms'] or 0:>7.2f} {r['tpot_p99_ms'] or 0:>7.2f} {r['peak_mem_gb'] or 0:>8.1f}",
                  flush=True)
            records.append(record(
                engine="conveyor", model=args.model, precision=args.dtype, benchmark="profile_generation",
                batch=batch, input_len=input_len, output_len=output_len, model_format=args.model_format or "hf",
                quant_policy=args.quant_policy, **tp_fields(args), kv_blocks=engine.runner.num_blocks,
                kernels=args.kernels, kv_tokens=engine.runner.num_blocks * engine.config.block_size,
                cuda_graphs=bool(graphs and engine.runner.use_cuda_graphs), **r,
            ))
    path = save(records + baseline, args.name or f"profile_generation_{args.model}")
    engine.close()  # tensor parallel: stops the other ranks
    print(f"saved {path}")


if __name__ == "__main__":
    main()
