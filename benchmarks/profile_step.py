"""Where a step's GPU time goes: torch.profiler over single steps, top kernels by GPU time.

Profiles (each after warm-up): a batch-1 decode step replayed from its CUDA graph, the same
step run eagerly, a batch-64 decode step, and a 2048-token prefill. Prints each step's wall
time, the summed kernel time, and the top kernels; saves them to results/h100/profile_step_<model>.json.
Also prints the weight-read floor of a decode step (parameter bytes / measured copy bandwidth).

    python -m benchmarks.profile_step --model llama2-7b [--quant-policy 8] [--model-format awq] [--decode-only]

With ``--tp N`` (``--tp-all-reduce``) the model is split over N GPUs and rank 0's GPU is profiled:
its kernels, and the collectives in which it waits for the other ranks; the floor is then a
rank's share of the weights.
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import add_tp_arguments, drain, dummy_engine, random_prompt, record, save, tp_fields
from benchmarks.dummy_model import param_count
from conveyor.protocol.sampling import SamplingParams


def copy_bandwidth() -> float:
    """Device-to-device copy rate in bytes/s (read + write counted), median of 10."""
    a = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    times = []
    for _ in range(12):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    times.sort()
    return 2 * a.numel() / times[len(times) // 2]


def profile_steps(engine, label: str, n_steps: int) -> dict:
    """Profile the next ``n_steps`` engine steps; returns per-step wall, kernel sums and top kernels."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(n_steps):
            engine.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / n_steps
    return kernel_table(prof, label, n_steps, wall)


def kernel_table(prof, label: str, n_steps: int, wall: float) -> dict:
    """The kernels a profile of ``n_steps`` steps (``wall`` seconds each) saw, by GPU time a step:
    printed (top 12) and returned (top 25) with the step's wall and summed kernel time."""
    rows = []
    # Kernels only: a CPU op (aten::mm) also reports the device time of the kernels it launched,
    # so summing every row would count a matmul twice.
    for e in prof.key_averages():
        if getattr(e, "device_type", None) != DeviceType.CUDA or e.key.startswith("aten::"):
            continue
        dev = getattr(e, "self_device_time_total", None)
        if dev is None:
            dev = getattr(e, "self_cuda_time_total", 0)
        if dev > 0:
            rows.append((e.key, dev / n_steps, e.count / n_steps))
    rows.sort(key=lambda r: -r[1])
    kernel_us = sum(r[1] for r in rows)
    # The host blocked on the device (the engine's read-back of a step's ids): near zero means the
    # GPU waited for the host instead, i.e. the host's work a step is longer than the GPU's.
    wait_us = sum(e.self_cpu_time_total for e in prof.key_averages()
                  if getattr(e, "device_type", None) == DeviceType.CPU and e.key.startswith("cuda")
                  and "Synchronize" in e.key) / n_steps
    print(f"--- {label}: {wall * 1e3:.2f} ms/step wall, {kernel_us / 1e3:.2f} ms/step in kernels "
          f"({kernel_us / 1e6 / wall:.0%} busy), host blocked on the GPU {wait_us / 1e3:.2f} ms/step")
    for name, us, count in rows[:12]:
        print(f"{us:9.1f} us {count:6.1f}x  {name[:110]}")
    return {"label": label, "wall_ms": wall * 1e3, "kernel_ms": kernel_us / 1e3, "host_wait_ms": wait_us / 1e3,
            "top": [{"name": n[:200], "us_per_step": us, "calls_per_step": c} for n, us, c in rows[:25]]}


def start(engine, batch: int, input_len: int, output_len: int) -> None:
    rng = random.Random(0)
    for _ in range(batch):
        engine.add_request(random_prompt(rng, input_len, engine.model_config.vocab_size),
                           SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama2-7b")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--quant-policy", type=int, default=0, help="KV cache: 0 (16-bit), 8 (int8) or 4 (int4)")
    ap.add_argument("--model-format", default=None, choices=[None, "hf", "awq", "smooth_quant"],
                    help="weights: fp16 (hf), W4A16 (awq) or W8A8 (smooth_quant), random, of the same shape")
    ap.add_argument("--decode-only", action="store_true", help="the graph-replayed decode steps only")
    add_tp_arguments(ap)
    args = ap.parse_args()
    engine = dummy_engine(args.model, args.dtype, max_batch_size=256, quant_policy=args.quant_policy,
                          model_format=args.model_format, tp=args.tp, tp_all_reduce=args.tp_all_reduce)
    bw = copy_bandwidth()
    # A MoE step reads k of E experts a token; a tensor-parallel rank its share of the weights.
    weight_bytes = 2 * param_count(args.model, active=True) / args.tp
    floor_ms = weight_bytes / bw * 1e3
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; decode weight-read floor of fp16 weights {floor_ms:.2f} ms "
          f"({1e3 / floor_ms:.0f} tok/s at batch 1)")
    results = []
    for graphs in (True,) if args.decode_only else (True, False):
        engine.runner.use_cuda_graphs = graphs
        start(engine, 1, 128, 64)
        for _ in range(10):
            engine.step()
        results.append(profile_steps(engine, f"decode bs1 ({'graph' if graphs else 'eager'})", 20))
        drain(engine)
    engine.runner.use_cuda_graphs = True
    start(engine, 64, 128, 64)
    for _ in range(10):
        engine.step()
    results.append(profile_steps(engine, "decode bs64 (graph)", 20))
    drain(engine)
    if not args.decode_only:
        start(engine, 1, 2048, 1)
        drain(engine)
        start(engine, 1, 2048, 1)
        results.append(profile_steps(engine, "prefill 2048 tokens", 1))
        drain(engine)
    save([record(engine="conveyor", model=args.model, precision=args.dtype, benchmark="profile_step",
                 quant_policy=args.quant_policy, model_format=args.model_format or "hf", **tp_fields(args),
                 copy_tb_s=bw / 1e12,
                 decode_floor_ms=floor_ms, steps=results)],
         f"profile_step_{args.model}" + (f"_kv{args.quant_policy}" if args.quant_policy else "")
         + (f"_{args.model_format}" if args.model_format not in (None, "hf") else "")
         + (f"_tp{args.tp}_{args.tp_all_reduce}" if args.tp > 1 else ""))
    engine.close()  # a tensor-parallel engine's ranks leave with it


if __name__ == "__main__":
    main()
