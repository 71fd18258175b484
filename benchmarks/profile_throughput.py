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

The record also keeps a timeline of the timed run (``timeline``), one entry per wall-clock second
``s`` (from t=0): the steps that ended in it, the output tokens they returned, the mean running
sequences after them, the waiting ones at the second's end, how many steps ran eagerly (not a
decode CUDA graph), and the mean SM clock (MHz) and power draw (W) of the GPUs in use, which a
thread reads from ``nvidia-smi`` every ``--gpu-sample-s`` (default 0.5 s; ``benchmarks/gpu_monitor.py``;
None without nvidia-smi). ``gpu_clocks`` has each GPU's mean/min/max clock and power over the
run, and ``timeline_summary`` the output tok/s of the first 20 s against the rest: what a run
that is 10 % slower than the last one lost, and when (a slow start, a clock that dropped, a stall).
The end of the run prints the timeline in 10 s rows.

``--rank-timing DIR`` (tensor parallel; ``EngineConfig.rank_timing_dir``): every rank logs each
step's wait for its plan, host time building and launching it, and GPU span
(``engine/rank_timing.py``); the table per rank and step kind is printed at the end and saved in
the record (``rank_timing``).

``--stack-samples DIR`` samples this process's Python stacks through the timed run
(``services/stack_sampler.py``, every 5 ms, weighted by wall time) into ``DIR/engine-<pid>.folded``
and prints the main thread's frames by time (``benchmarks/stack_summary.py``): where the host goes
in steps whose launch it cannot hide (eager prefill steps), without the profiler's own cost.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from collections.abc import Sequence
from pathlib import Path
from statistics import mean
from typing import NamedTuple

import torch
from torch.profiler import ProfilerActivity, profile

from conveyor.engine.config import parse_cache_size
from benchmarks.common import (StepTimer, add_tp_arguments, drain, dummy_engine, percentile, random_prompt, record,
                               save, tp_fields)
from benchmarks.gpu_monitor import GpuMonitor, GpuSample, summary
from conveyor.engine.rank_timing import alloc_retries, busy_seconds, read_all, table
from benchmarks.profile_step import kernel_table
from benchmarks.stack_summary import read_folded, summarize
from conveyor.services.stack_sampler import start_in
from conveyor.protocol.sampling import SamplingParams

DATA = Path(__file__).resolve().parent / "data" / "sharegpt_shape_3000.jsonl"
START_S = 20  # timeline_summary's split: the first seconds (queue full, prefills) against the rest
PRINT_EVERY_S = 10


class StepSample(NamedTuple):
    """What one ``engine.step()`` left: when it returned (``time.perf_counter()``), the output
    tokens it returned, the sequences running and waiting after it, and how many forwards it
    launched without a decode graph."""

    t: float
    tokens: int
    running: int
    waiting: int
    eager: int


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


def timeline(steps: list[StepSample], t0: float, gpu: Sequence[GpuSample] = (), width: int = 1) -> list[dict]:
    """The run in buckets of ``width`` seconds from ``t0``, up to the last step's: steps that ended
    in each, their output tokens, mean running, waiting at the bucket's end, eager steps, and the
    mean SM clock and power of the ``gpu`` samples taken in it. A bucket no step ended in (a
    stall) keeps the last step's running and waiting counts (None before the first step)."""
    if not steps:
        return []
    buckets = [{"s": i * width, "steps": 0, "out_tokens": 0, "running": None, "waiting": None,
                "eager_steps": 0} for i in range(int((steps[-1].t - t0) // width) + 1)]
    running: list[list[int]] = [[] for _ in buckets]
    for step in steps:
        i = int((step.t - t0) // width)
        b = buckets[i]
        b["steps"] += 1
        b["out_tokens"] += step.tokens
        b["eager_steps"] += step.eager
        b["waiting"] = step.waiting
        running[i].append(step.running)
    last_running = last_waiting = None
    for b, counts in zip(buckets, running):
        if counts:
            b["running"], last_running, last_waiting = round(mean(counts), 1), counts[-1], b["waiting"]
        else:
            b["running"], b["waiting"] = last_running, last_waiting
    readings: list[tuple[list[float], list[float]]] = [([], []) for _ in buckets]
    for g in gpu:
        i = int((g.t - t0) // width)
        if 0 <= i < len(buckets):
            for values, value in zip(readings[i], (g.sm_mhz, g.power_w)):
                if value is not None:
                    values.append(value)
    for b, (mhz, watts) in zip(buckets, readings):
        b["sm_mhz"] = round(mean(mhz)) if mhz else None
        b["power_w"] = round(mean(watts), 1) if watts else None
    return buckets


def start_vs_rest(per_second: list[dict], wall: float) -> dict[str, float | None]:
    """Output tok/s of the first START_S seconds and of the rest of the run (None if it is shorter)."""
    first = sum(b["out_tokens"] for b in per_second if b["s"] < START_S)
    rest = sum(b["out_tokens"] for b in per_second if b["s"] >= START_S)
    return {"split_s": START_S, "out_tok_s_first": round(first / min(wall, START_S), 1),
            "out_tok_s_rest": round(rest / (wall - START_S), 1) if wall > START_S else None}


def gpus_in_use(tp: int) -> list[str]:
    """nvidia-smi ids of the GPUs the engine's ranks run on: the first ``tp`` of CUDA_VISIBLE_DEVICES
    (indices or UUIDs, both ids to nvidia-smi, which does not read that variable itself), else 0..tp-1."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[:tp] if visible else [str(i) for i in range(tp)]


def print_timeline(steps: list[StepSample], t0: float, gpu: Sequence[GpuSample], wall: float,
                   split: dict[str, float | None]) -> None:
    """The timeline in rows of PRINT_EVERY_S seconds, then ``start_vs_rest``'s rates."""
    print(f"{'s':>5} {'steps':>6} {'tok/s':>7} {'running':>8} {'waiting':>8} {'eager':>6} {'MHz':>5} {'W':>6}")
    for b in timeline(steps, t0, gpu, width=PRINT_EVERY_S):
        span = max(min(PRINT_EVERY_S, wall - b["s"]), 1e-3)  # the last row ends with the run
        cell = {k: "-" if b[k] is None else str(b[k]) for k in ("running", "waiting", "sm_mhz", "power_w")}
        print(f"{b['s']:>5.0f} {b['steps']:>6} {b['out_tokens'] / span:>7.0f} {cell['running']:>8} "
              f"{cell['waiting']:>8} {b['eager_steps']:>6} {cell['sm_mhz']:>5} {cell['power_w']:>6}")
    rest = f"{split['out_tok_s_rest']:.0f}" if split["out_tok_s_rest"] is not None else "-"
    print(f"out tok/s: first {split['split_s']} s {split['out_tok_s_first']:.0f}, the rest {rest}")


def print_main_thread_stacks(path: Path, top: int = 25) -> None:
    """The timed run's stack samples (``--stack-samples``): the engine loop's thread, by frame."""
    stacks = read_folded(path).get("MainThread")
    if not stacks:
        print(f"stack samples: no main-thread samples in {path}")
        return
    print(f"stack samples ({path}): main thread, {sum(stacks.values()) / 1e3:.1f} s sampled")
    print("\n".join(summarize(stacks, top)))


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
    add_tp_arguments(ap)
    ap.add_argument("--name", default=None)
    ap.add_argument("--eager-mode", action="store_true", help="no decode CUDA graphs (EngineConfig.eager_mode)")
    ap.add_argument("--no-overlap", action="store_true",
                    help="read every step back before scheduling the next (EngineConfig.overlap_schedule=False)")
    ap.add_argument("--rank-timing", default=None, metavar="DIR",
                    help="every rank writes its step times (wait, host, GPU) to DIR; printed and recorded at the end")
    ap.add_argument("--gpu-sample-s", type=float, default=0.5, metavar="SECONDS",
                    help="read the GPUs' SM clock and power through nvidia-smi this often during the timed run "
                         "(0: never, to check that the sampling itself costs nothing)")
    ap.add_argument("--profile", type=profile_window, default=None, metavar="START:COUNT",
                    help="profile steps START..START+COUNT (torch.profiler; their kernels, by GPU time, "
                         "go into the record: the run's own numbers then include the profiler's cost)")
    ap.add_argument("--stack-samples", type=Path, default=None, metavar="DIR",
                    help="sample this process's Python stacks through the timed run into DIR "
                         "(services/stack_sampler.py) and print the main thread's frames by wall time")
    args = ap.parse_args()
    window = args.profile
    if args.gpu_sample_s < 0:
        ap.error(f"--gpu-sample-s {args.gpu_sample_s}: give seconds between samples, or 0 for none")
    if window and not torch.cuda.is_available():
        ap.error("--profile times CUDA kernels: it needs a GPU")
    if args.stack_samples is not None:
        try:  # before the engine is built: a directory that cannot be made is said at once
            args.stack_samples.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            ap.error(f"--stack-samples {args.stack_samples}: {exc}")

    work = load_workload(args.dataset, args.num_prompts)
    engine = dummy_engine(args.model, args.dtype, max_batch_size=args.max_batch_size,
                          cache_max_entry_count=args.cache_max_entry_count, quant_policy=args.quant_policy, tp=args.tp,
                          tp_all_reduce=args.tp_all_reduce, rank_timing_dir=args.rank_timing,
                          eager_mode=args.eager_mode, overlap_schedule=False if args.no_overlap else None)
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
    monitor = GpuMonitor(gpus_in_use(args.tp), args.gpu_sample_s)
    if args.gpu_sample_s > 0:
        monitor.start()
    step_samples: list[StepSample] = []
    sampler = start_in(args.stack_samples, "engine") if args.stack_samples is not None else None
    t0 = time.perf_counter()
    first: dict[str, float] = {}
    ids = []
    for prompt, (_, out_len) in zip(prompts, work):
        params = SamplingParams(max_new_tokens=out_len, temperature=0.0, ignore_eos=True)
        ids.append(engine.add_request(prompt, params).request_id)
    n_out = steps = reported = 0
    next_report = t0 + PRINT_EVERY_S
    profiled, prof = None, None
    while engine.has_work:
        if window and steps == window[0]:
            torch.cuda.synchronize()
            prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            prof.__enter__()
            prof_t0, prof_running = time.perf_counter(), len(engine.scheduler.running)
        eager_before = timer.eager_steps
        outs = engine.step()
        now = time.perf_counter()
        steps += 1
        step_tokens = sum(o.token is not None for o in outs)
        step_samples.append(StepSample(now, step_tokens, len(engine.scheduler.running), len(engine.scheduler.waiting),
                                       timer.eager_steps - eager_before))
        if prof is not None and steps == window[0] + window[1]:
            torch.cuda.synchronize()
            prof.__exit__(None, None, None)
            wall_step = (time.perf_counter() - prof_t0) / window[1]
            profiled = kernel_table(prof, f"steps {window[0]}..{steps} ({prof_running} running at the start)",
                                    window[1], wall_step)
            prof = None
        if now > next_report:  # progress, so a run cut short still tells its rate
            next_report = now + PRINT_EVERY_S
            # GPU busy over the spans since the last report (the last two may still be in flight).
            recent, reported = timer.spans[reported:-2], max(reported, len(timer.spans) - 2)
            busy = (f", GPU busy {busy_seconds(recent) / (recent[0][0].elapsed_time(recent[-1][1]) / 1e3):.0%}"
                    if len(recent) > 1 else "")
            reading = monitor.last()
            clock = (f", GPU{reading.gpu} {reading.sm_mhz:.0f} MHz {reading.power_w:.0f} W"
                     if reading and reading.sm_mhz is not None and reading.power_w is not None else "")
            print(f"  {now - t0:6.1f}s: {n_out} tokens out ({n_out / (now - t0):.0f} tok/s), "
                  f"{len(engine.scheduler.running)} running, {len(engine.scheduler.waiting)} waiting, "
                  f"step {steps}{busy}{clock}", flush=True)
        n_out += step_tokens
        for o in outs:
            if o.token is not None:
                first.setdefault(o.request_id, now)
    wall = time.perf_counter() - t0
    gpu_samples = monitor.stop()
    if sampler is not None:
        sampler.stop()
        print_main_thread_stacks(sampler.path)
    timer.detach(engine)
    spans = timer.spans
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        busy = busy_seconds(spans)
    else:
        busy = None
    ttft = [first[i] - t0 for i in ids if i in first]
    n_in = sum(i for i, _ in work)
    per_second = timeline(step_samples, t0, gpu_samples)
    split = start_vs_rest(per_second, wall)
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
        "gpu_clocks": summary(gpu_samples),
        "timeline_summary": split,
        "timeline": per_second,
    }
    if profiled:
        result["profiled_steps"] = profiled
    for k, v in result.items():
        if k in ("profiled_steps", "timeline", "timeline_summary"):  # printed when the window closed, or below
            continue
        print(f"{k:>14}: {v:.3f}" if isinstance(v, float) else f"{k:>14}: {v}")
    print_timeline(step_samples, t0, gpu_samples, wall, split)
    rec = record(engine="conveyor", model=args.model, precision=args.dtype, benchmark="profile_throughput",
                 batch=args.max_batch_size, quant_policy=args.quant_policy, **tp_fields(args),
                 dataset=args.dataset.name, **result)
    path = save([rec], args.name or f"profile_throughput_{args.model}")
    print(f"saved {path}", flush=True)
    engine.close()  # every rank writes its step times (--rank-timing) as it stops
    if args.rank_timing:
        rec["rank_timing"] = read_all(Path(args.rank_timing))
        print(table(rec["rank_timing"]))
        print(f"saved {save([rec], args.name or f'profile_throughput_{args.model}')} (with every rank's step times)")


if __name__ == "__main__":
    main()
