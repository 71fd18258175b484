"""Offline request throughput (LMDeploy's profile_throughput without HTTP) on a fixed workload.

Every request of the workload (``benchmarks/data/sharegpt_shape_3000.jsonl``: input/output
lengths in tokens) becomes random token ids of its input length with ``ignore_eos`` and
``max_new_tokens = output_len``; all are submitted at t=0 and ``LLMEngine.step()`` runs until
the last finishes. Reported: requests/s, output tok/s, total (input + output) tok/s, mean and
P99 time to first token (from t=0, so it includes queueing), and the GPU busy fraction.

GPU busy: the runner records a CUDA event just before each step's first host-to-device copy
and another after the sampled ids are back on the host; the sum of those spans over the wall
time is the share of time the GPU had the step's work in hand (the engine is synchronous, so
outside those spans, while Python schedules and builds the next batch, the GPU is idle). Inside a
span the GPU can still wait on kernel launches (eager prefill), so it is an upper bound.

    python -m benchmarks.profile_throughput --model llama2-7b [--profile 800:30]

``--profile START:COUNT`` runs those steps under torch.profiler and prints (and records) their
kernels by GPU time and how long the host blocked on the GPU; the profiler slows the run.

``--rank-timing DIR`` (tensor parallel; ``EngineConfig.rank_timing_dir``): every rank logs each
step's wait for its plan, host time building and launching it, and GPU span
(``engine/rank_timing.py``); the table per rank and step kind is printed at the end and saved in
the record (``rank_timing``).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from statistics import mean

import torch
from torch.profiler import ProfilerActivity, profile

from conveyor.engine.config import parse_cache_size
from benchmarks.common import StepTimer, drain, dummy_engine, percentile, random_prompt, record, save
from conveyor.engine.rank_timing import alloc_retries, busy_seconds, read_all, table
from benchmarks.profile_step import kernel_table
from conveyor.protocol.sampling import SamplingParams

DATA = Path(__file__).resolve().parent / "data" / "sharegpt_shape_3000.jsonl"


def load_workload(path: Path, limit: int | None) -> list[tuple[int, int]]:
    """(input_len, output_len) pairs from a jsonl file."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    pairs = [(int(r["input_len"]), int(r["output_len"])) for r in rows]
    return pairs[:limit] if limit else pairs


def warm_up(engine, vocab: int) -> None:
    """Compile the kernels' variants untimed: short and long prompts, then a full batch of
    sequences that finish at different steps (decode at every batch size down from the maximum,
    eager above the largest CUDA graph, mixed steps). Without the full batch, a fresh machine
    compiled Triton variants inside the timed run: the first run of a setting in a device call
    measured up to 25 % slower than a second one (H200, ShareGPT int8 at max batch 512)."""
    rng = random.Random(123)
    for length in (5, 20, 40, 100, 300, 1000, 2000):
        engine.add_request(random_prompt(rng, length, vocab),
                           SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
    drain(engine)
    for i in range(engine.config.max_batch_size):
        engine.add_request(random_prompt(rng, 16 + 61 * i % 700, vocab),
                           SamplingParams(max_new_tokens=2 + i % 40, temperature=0.0, ignore_eos=True))
    drain(engine)


def profile_window(text: str) -> tuple[int, int]:
    """``--profile START:COUNT``: the first step to profile and how many (COUNT >= 1)."""
    try:
        start, count = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give START:COUNT, e.g. 800:30") from None
    if start < 0 or count < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: START must be >= 0 and COUNT >= 1")
    return start, count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama2-7b")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--dataset", type=Path, default=DATA)
    ap.add_argument("--num-prompts", type=int, default=None, help="first N requests (default: all)")
    ap.add_argument("--max-batch-size", type=int, default=256)
    ap.add_argument("--cache-max-entry-count", type=parse_cache_size, default=0.8)
    ap.add_argument("--quant-policy", type=int, default=0, choices=[0, 4, 8], help="KV cache: 0 (16-bit), 8 or 4 bits")
    ap.add_argument("--tp", type=int, default=1, help="tensor parallel: GPUs the model is split over")
    ap.add_argument("--name", default=None)
    ap.add_argument("--eager-mode", action="store_true", help="no decode CUDA graphs (EngineConfig.eager_mode)")
    ap.add_argument("--no-overlap", action="store_true",
                    help="read every step back before scheduling the next (EngineConfig.overlap_schedule=False)")
    ap.add_argument("--rank-timing", default=None, metavar="DIR",
                    help="every rank writes its step times (wait, host, GPU) to DIR; printed and recorded at the end")
    ap.add_argument("--profile", type=profile_window, default=None, metavar="START:COUNT",
                    help="profile steps START..START+COUNT (torch.profiler; their kernels, by GPU time, "
                         "go into the record: the run's own numbers then include the profiler's cost)")
    args = ap.parse_args()
    window = args.profile
    if window and not torch.cuda.is_available():
        ap.error("--profile times CUDA kernels: it needs a GPU")

    work = load_workload(args.dataset, args.num_prompts)
    engine = dummy_engine(args.model, args.dtype, max_batch_size=args.max_batch_size,
                          cache_max_entry_count=args.cache_max_entry_count, quant_policy=args.quant_policy, tp=args.tp,
                          rank_timing_dir=args.rank_timing, eager_mode=args.eager_mode,
                          overlap_schedule=False if args.no_overlap else None)
    vocab = engine.model_config.vocab_size
    print(f"engine ready: {engine.runner.num_blocks} KV blocks of {engine.config.block_size}", flush=True)
    warm_up(engine, vocab)
    rng = random.Random(0)
    prompts = [random_prompt(rng, i, vocab) for i, _ in work]
    timer = StepTimer().attach(engine)
    preempted = [0]
    schedule = engine.scheduler.schedule

    def counting_schedule():  # counts preemptions (each is a later recompute of the sequence)
        out = schedule()
        preempted[0] += len(out.preempted)
        return out

    engine.scheduler.schedule = counting_schedule
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    first: dict[str, float] = {}
    ids = []
    for prompt, (_, out_len) in zip(prompts, work):
        params = SamplingParams(max_new_tokens=out_len, temperature=0.0, ignore_eos=True)
        ids.append(engine.add_request(prompt, params).request_id)
    n_out = steps = reported = 0
    next_report = t0 + 10.0
    profiled, prof = None, None
    while engine.has_work:
        if window and steps == window[0]:
            torch.cuda.synchronize()
            prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            prof.__enter__()
            prof_t0, prof_running = time.perf_counter(), len(engine.scheduler.running)
        outs = engine.step()
        now = time.perf_counter()
        steps += 1
        if prof is not None and steps == window[0] + window[1]:
            torch.cuda.synchronize()
            prof.__exit__(None, None, None)
            wall_step = (time.perf_counter() - prof_t0) / window[1]
            profiled = kernel_table(prof, f"steps {window[0]}..{steps} ({prof_running} running at the start)",
                                    window[1], wall_step)
            prof = None
        if now > next_report:  # progress, so a run cut short still tells its rate
            next_report = now + 10.0
            # GPU busy over the spans since the last report (the last two may still be in flight).
            recent, reported = timer.spans[reported:-2], max(reported, len(timer.spans) - 2)
            busy = (f", GPU busy {busy_seconds(recent) / (recent[0][0].elapsed_time(recent[-1][1]) / 1e3):.0%}"
                    if len(recent) > 1 else "")
            print(f"  {now - t0:6.1f}s: {n_out} tokens out ({n_out / (now - t0):.0f} tok/s), "
                  f"{len(engine.scheduler.running)} running, {len(engine.scheduler.waiting)} waiting, "
                  f"step {steps}{busy}", flush=True)
        for o in outs:
            if o.token is not None:
                n_out += 1
                first.setdefault(o.request_id, now)
    wall = time.perf_counter() - t0
    timer.detach(engine)
    spans = timer.spans
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        busy = busy_seconds(spans)
    else:
        busy = None
    ttft = [first[i] - t0 for i in ids if i in first]
    n_in = sum(i for i, _ in work)
    result = {
        "num_requests": len(work), "wall_s": wall, "steps": steps, "in_tokens": n_in, "out_tokens": n_out,
        "req_s": len(work) / wall, "out_tok_s": n_out / wall, "total_tok_s": (n_in + n_out) / wall,
        "ttft_ms": mean(ttft) * 1e3, "ttft_p99_ms": percentile(ttft, 99) * 1e3,
        "gpu_busy": busy / wall if busy is not None else None, "gpu_busy_s": busy,
        "preemptions": preempted[0], "graph_steps": timer.graph_steps, "eager_steps": timer.eager_steps,
        "kv_blocks": engine.runner.num_blocks, "block_size": engine.config.block_size,
        "kv_tokens": engine.runner.num_blocks * engine.config.block_size,
        "peak_mem_gb": torch.cuda.max_memory_reserved() / 1e9 if torch.cuda.is_available() else None,
        "alloc_retries": alloc_retries() if torch.cuda.is_available() else None,  # each one waited for the GPU
    }
    if profiled:
        result["profiled_steps"] = profiled
    for k, v in result.items():
        if k == "profiled_steps":  # printed when the window closed
            continue
        print(f"{k:>14}: {v:.3f}" if isinstance(v, float) else f"{k:>14}: {v}")
    rec = record(engine="conveyor", model=args.model, precision=args.dtype, benchmark="profile_throughput",
                 batch=args.max_batch_size, quant_policy=args.quant_policy, tp=args.tp, dataset=args.dataset.name,
                 **result)
    path = save([rec], args.name or f"profile_throughput_{args.model}")
    print(f"saved {path}", flush=True)
    engine.close()  # every rank writes its step times (--rank-timing) as it stops
    if args.rank_timing:
        rec["rank_timing"] = read_all(Path(args.rank_timing))
        print(table(rec["rank_timing"]))
        print(f"saved {save([rec], args.name or f'profile_throughput_{args.model}')} (with every rank's step times)")


if __name__ == "__main__":
    main()
