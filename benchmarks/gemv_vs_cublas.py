"""Batch-1 decode projections: cuBLAS (``F.linear``) against the Triton GEMV of kernels/gemv.py.

The Llama-2-7B shapes at M = 1 (fp16): fused qkv, o_proj, fused gate_up, down, LM head. Each
candidate configuration is checked against the reference, then timed as decode steps run it:
128 calls captured in one CUDA graph and replayed (median of 5), cycling through enough copies
of the weight (>= 200 MB) that none is read from the L2 cache. (Launched one by one from Python,
every shape took ~28 µs on an H200, the Triton launcher's host time, whatever its size.)
Reported in µs per call and in weight GB/s, plus the per-token sum over the 32 layers and the head.

    python -m benchmarks.gemv_vs_cublas [--tp N]

``--tp N``: the shapes one rank of N holds (qkv, gate_up and the head split by output features,
o_proj and down by input features). Also prints each projection's fastest configuration.
"""

import argparse
import itertools

import torch
import torch.nn.functional as F

from benchmarks.common import graph_time_us, record, save
from conveyor.kernels.gemv import ONE_ROW_TILE, gemv_ref, gemv_triton

SHAPES = {"qkv": (12288, 4096), "o_proj": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008),
          "lm_head": (32000, 4096)}
ROW_PARALLEL = ("o_proj", "down")  # split along K under tensor parallel; the others along N
PER_TOKEN = {"qkv": 32, "o_proj": 32, "gate_up": 32, "down": 32, "lm_head": 1}
DEFAULT = (ONE_ROW_TILE[0], 1024, ONE_ROW_TILE[1], 3)  # gemv_triton's one-row launch: (block_n, block_k, warps, stages)


def rank_shapes(tp: int) -> dict[str, tuple[int, int]]:
    """(N, K) of each projection as one rank of ``tp`` holds it."""
    return {name: (n, k // tp) if name in ROW_PARALLEL else (n // tp, k) for name, (n, k) in SHAPES.items()}


def time_us(fn, weights: list[torch.Tensor]) -> float:
    """µs per call of ``fn(w)`` replayed from a CUDA graph, cycling through ``weights``."""
    return graph_time_us([lambda w=w: fn(w) for w in weights], rounds=5)


def weight_copies(n: int, k: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Copies of one random [n, k] weight, >= 200 MB together: none stays in the L2 cache."""
    w = torch.randn(n, k, device="cuda", dtype=torch.float16, generator=gen) * 0.02
    return [w] + [w.clone() for _ in range(max(1, -(-200_000_000 // (2 * n * k))) - 1)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=1, help="the shapes of one rank of this many")
    args = ap.parse_args()
    if args.tp < 1 or any(n % args.tp or k % args.tp for n, k in SHAPES.values()):
        ap.error(f"--tp {args.tp}: the Llama-2-7B projections split evenly over 1, 2, 4 or 8 ranks")
    shapes = rank_shapes(args.tp)
    gen = torch.Generator(device="cuda").manual_seed(0)
    data = {}
    for name, (n, k) in shapes.items():
        ws = weight_copies(n, k, gen)
        x = torch.randn(1, k, device="cuda", dtype=torch.float16, generator=gen)
        data[name] = (x, ws, gemv_ref(x, ws[0]))
    records = []

    def per_token(times: dict) -> float:
        return sum(times[s] * PER_TOKEN[s] for s in shapes)

    cublas = {name: time_us(lambda w, x=x: F.linear(x, w), ws) for name, (x, ws, _) in data.items()}
    for name, us in cublas.items():
        n, k = shapes[name]
        print(f"cublas {name:8s} {us:8.1f} us  {n * k * 2 / us / 1e3:7.0f} GB/s", flush=True)
    print(f"cublas per token: {per_token(cublas):.0f} us", flush=True)
    records.append(record(engine="cublas", model="llama2-7b", precision="float16", benchmark="gemv_vs_cublas",
                          batch=1, config="F.linear", us=cublas, per_token_us=per_token(cublas), tp=args.tp,
                          shapes=shapes))

    # every tile at 3 stages, then the best three at 1, 2, 4 and 5
    configs = list(itertools.product((4, 8, 16), (256, 512, 1024), (2, 4, 8), (3,)))
    results = []
    for bn, bk, warps, stages in configs:
        times, worst = {}, 0.0
        try:
            for name, (x, ws, ref) in data.items():
                out = gemv_triton(x, ws[0], block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)
                worst = max(worst, ((out.float() - ref.float()).norm() / ref.float().norm()).item())
                times[name] = time_us(lambda w, x=x: gemv_triton(x, w, block_n=bn, block_k=bk,
                                                                 num_warps=warps, num_stages=stages), ws)
        except Exception as exc:  # noqa: BLE001 - a configuration that does not compile
            print(f"bn{bn} bk{bk} w{warps} s{stages}: failed ({type(exc).__name__})", flush=True)
            continue
        total = per_token(times)
        results.append((total, (bn, bk, warps, stages), times, worst))
        print(f"bn{bn:<2} bk{bk:<4} w{warps} s{stages}: per token {total:7.0f} us (rel err {worst:.1e}) "
              + " ".join(f"{s}={t:.1f}" for s, t in times.items()), flush=True)
    results.sort(key=lambda r: r[0])
    for _total, cfg, _times, worst in results[:3]:  # the best three with other pipeline depths
        for stages in (1, 2, 4, 5):
            bn, bk, warps, _ = cfg
            t = {name: time_us(lambda w, x=x: gemv_triton(x, w, block_n=bn, block_k=bk, num_warps=warps,
                                                          num_stages=stages), ws) for name, (x, ws, _) in data.items()}
            results.append((per_token(t), (bn, bk, warps, stages), t, worst))
            print(f"bn{bn:<2} bk{bk:<4} w{warps} s{stages}: per token {per_token(t):7.0f} us", flush=True)
    results.sort(key=lambda r: r[0])
    for total, (bn, bk, warps, stages), times, worst in results:
        records.append(record(engine="conveyor", model="llama2-7b", precision="float16", benchmark="gemv_vs_cublas",
                              batch=1, config=f"bn{bn}_bk{bk}_w{warps}_s{stages}", us=times, per_token_us=total,
                              rel_err=worst, tp=args.tp, shapes=shapes))
    best = results[0]
    print(f"best {best[1]}: {best[0]:.0f} us per token vs cublas {per_token(cublas):.0f}", flush=True)
    for name in shapes:  # each projection's own fastest, against the overall best's time for it
        t, cfg = min((r[2][name], r[1]) for r in results)
        print(f"{name:8s} {shapes[name]}: fastest {cfg} {t:.1f} us, overall best {best[2][name]:.1f} us, "
              f"default {DEFAULT} {_default_time(results, name)}", flush=True)
    print(f"saved {save(records, 'gemv_vs_cublas' + (f'_tp{args.tp}' if args.tp > 1 else ''))}")


def _default_time(results, name: str) -> str:
    """The default configuration's time for ``name``, if it ran."""
    times = [r[2][name] for r in results if r[1] == DEFAULT]
    return f"{times[0]:.1f} us" if times else "not run"


if __name__ == "__main__":
    main()
