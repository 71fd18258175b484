"""W4A16 (AWQ, group 128) matrix products against fp16 ``torch.matmul`` on Llama-2-7B shapes.

For each projection (fused qkv, o_proj, fused gate_up, down) and each row count M, three ways
to compute ``x [M, K] @ W [K, N]`` in fp16:

* ``w4a16``: ``conveyor.kernels.w4a16_matmul`` on the packed 4-bit weight (what the layer runs:
  the GEMV at M = 1, the fused GEMM below ``DEQUANT_MIN_ROWS`` rows, the Triton dequantization
  plus cuBLAS from there on);
* ``fp16``: ``torch.matmul`` on the dense fp16 weight (cuBLAS: what an unquantized model runs);
* ``dequant``: the reference path, ``dequantize_awq_ref`` to fp16, then ``torch.matmul``.

Each case is first checked against the fp32 reference. Timing: the calls are captured in one
CUDA graph (so Python launch overhead, tens of µs for a Triton call, does not hide a few-µs
kernel) over several copies of the weights whose bytes together exceed three times the L2
(60 MB on an H200: a 25 MB 4-bit layer would otherwise be read from L2, not HBM, as no decode
step would); after a warm-up replay the graph is replayed between CUDA events many times and
the median per call is reported, in µs, as effective GB/s (weights, scales, zeros, x and y
bytes over the time) and TFLOP/s, with the speed-up over fp16 (fp16 time / w4a16 time).

For M = 1 the floor is reading the packed weights: 25 MB for qkv at ~4.2 TB/s is ~6 µs.

    python -m benchmarks.bench_w4a16 [--quick] [--sweep] [--out PATH]

``--sweep`` also times a list of tile configurations of the Triton kernels per case and reports
the fastest (for choosing ``gemv_config``/``gemm_config``'s defaults).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch

import importlib

from benchmarks import common
from benchmarks.common import cuda_time_us, record, save_to
from conveyor.kernels._triton import cdiv
from conveyor.kernels.w4a16 import GemmConfig, GemvConfig, dequantize_awq_ref
from conveyor.kernels.w4a16.policy import split_k, tile_k

IMPL = importlib.import_module("conveyor.kernels.w4a16")  # --impl: another copy, to time before/after

SHAPES = {"qkv": (4096, 12288), "o_proj": (4096, 4096), "gate_up": (4096, 22016), "down": (11008, 4096)}
ROWS = [1, 16, 64, 256, 2048]
QUICK_SHAPES = ["qkv", "down"]
QUICK_ROWS = [1, 16, 256]
GROUP = 128
GEMV_SWEEP = [GemvConfig(*c) for c in (  # block_p, block_r, num_warps, programs_per_sm, chain
    (16, 8, 1, 12, 2), (32, 4, 1, 12, 2), (16, 8, 1, 8, 2),
)]
GEMM_SWEEP = [GemmConfig(*c[:3], num_warps=c[3], num_stages=c[4]) for c in (
    (16, 64, 128, 4, 3), (16, 128, 64, 4, 3), (64, 64, 128, 4, 4), (64, 128, 64, 4, 3),
)]
# The swapped kernel (weight columns on the MMA's 64-row side): block_n, block_k, warps, stages;
# block_m follows M (8 or 16 rows for M = 1, else the power of two >= M, 16..64).
SWAP_SWEEP = ((64, 128, 4, 4), (128, 64, 4, 3), (128, 64, 4, 4), (128, 128, 4, 3), (128, 128, 8, 3),
              (256, 64, 8, 3), (64, 64, 4, 4))
SWAP_SWEEP_M1 = ((64, 128, 4, 4), (128, 64, 4, 4), (128, 128, 4, 3))


def sweep_configs(m: int) -> list[GemvConfig | GemmConfig]:
    """The candidate configurations for M rows (GEMV and swapped GEMM for M = 1)."""
    def swap(bm: int, c: tuple[int, ...]) -> GemmConfig:
        return GemmConfig(bm, c[0], c[1], num_warps=c[2], num_stages=c[3], swap=True)

    if m == 1:
        return [*GEMV_SWEEP, *(swap(bm, c) for bm in (8, 16) for c in SWAP_SWEEP_M1)]
    bm = min(64, max(16, 1 << (m - 1).bit_length()))
    return [*(c for c in GEMM_SWEEP if c.block_m >= min(m, 64) or c.block_m == 16),
            *(swap(bm, c) for c in SWAP_SWEEP)]


def layer_copies(k: int, n: int, copies: int) -> list[tuple[torch.Tensor, ...]]:
    """``copies`` random AWQ layers [K, N] on the GPU: (qweight, qzeros, scales). Random int32
    words are random 4-bit codes in every nibble (the timing does not depend on the values)."""
    groups = -(-k // GROUP)
    out = []
    for _ in range(copies):
        qw = torch.randint(-(2**31), 2**31, (k, n // 8), dtype=torch.int32, device="cuda")
        qz = torch.randint(-(2**31), 2**31, (groups, n // 8), dtype=torch.int32, device="cuda")
        s = torch.rand(groups, n, device="cuda").mul_(0.002).add_(0.001).half()
        out.append((qw, qz, s))
    return out


def graph_time_us(calls: list[Callable[[], object]], samples: int) -> float:
    """Median µs per call of ``calls`` captured once each, back to back, in one CUDA graph."""
    return common.graph_time_us(calls, samples, reps=len(calls))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def main() -> None:
    global IMPL
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"shapes {QUICK_SHAPES}, M in {QUICK_ROWS}, fewer samples")
    ap.add_argument("--sweep", action="store_true", help="also time the tile configurations of the Triton kernels")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default results/<gpu>/bench_w4a16.json)")
    ap.add_argument("--layers", nargs="+", choices=sorted(SHAPES), help="a subset of the layers")
    ap.add_argument("--rows", nargs="+", type=int, help="other row counts M")
    ap.add_argument("--impl", default=IMPL.__name__,
                    help="the module to time (a copy of an earlier w4a16.py, for before/after in one run)")
    args = ap.parse_args()
    IMPL = importlib.import_module(args.impl)
    if not torch.cuda.is_available():
        raise SystemExit("bench_w4a16 needs a CUDA GPU")

    shapes = {name: SHAPES[name] for name in (args.layers or (QUICK_SHAPES if args.quick else SHAPES))}
    rows = args.rows or (QUICK_ROWS if args.quick else ROWS)
    samples = 10 if args.quick else 30
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 60 * 2**20)
    torch.manual_seed(0)
    records = []
    print(f"{'layer':8s} {'M':>5s} {'w4a16 us':>9s} {'GB/s':>6s} {'TFLOP/s':>7s} {'fp16 us':>8s} {'GB/s':>6s} "
          f"{'speedup':>7s} {'dequant us':>10s} {'err':>8s}", flush=True)
    for name, (k, n) in shapes.items():
        groups = -(-k // GROUP)
        w4_bytes = k * n // 2 + groups * n * 2 + groups * n // 2
        layers = layer_copies(k, n, max(2, -(-3 * l2 // w4_bytes)))
        # fp16 weights have 4x the bytes: fewer copies exceed the L2 (each one its own memory).
        dense = [dequantize_awq_ref(*layers[i % len(layers)], GROUP, dtype=torch.float16)
                 for i in range(max(2, -(-3 * l2 // (k * n * 2))))]
        for m in rows:
            xs = [torch.randn(m, k, device="cuda", dtype=torch.float16) for _ in range(2)]
            ref = (xs[0].float() @ dequantize_awq_ref(*layers[0], GROUP)).half()
            err = rel_err(IMPL.w4a16_matmul(xs[0], *layers[0], GROUP), ref)
            io_bytes = m * k * 2 + m * n * 2
            flops = 2 * m * k * n
            t_w4 = graph_time_us([lambda i=i, layer=layer: IMPL.w4a16_matmul(xs[i % 2], *layer, GROUP)
                                  for i, layer in enumerate(layers)], samples)
            t_fp16 = graph_time_us([lambda i=i: torch.matmul(xs[i % 2], dense[i]) for i in range(len(dense))], samples)
            t_deq = cuda_time_us(
                lambda: torch.matmul(xs[0], dequantize_awq_ref(*layers[0], GROUP, dtype=torch.float16)),
                max(3, samples // 5))
            gbs = (w4_bytes + io_bytes) / t_w4 / 1e3
            gbs16 = (k * n * 2 + io_bytes) / t_fp16 / 1e3
            print(f"{name:8s} {m:5d} {t_w4:9.1f} {gbs:6.0f} {flops / t_w4 / 1e6:7.1f} {t_fp16:8.1f} {gbs16:6.0f} "
                  f"{t_fp16 / t_w4:7.2f} {t_deq:10.1f} {err:8.1e}", flush=True)
            dense_path = m >= getattr(IMPL, "DEQUANT_MIN_ROWS", 1 << 30)
            cfg = IMPL.gemv_config(n, k) if m == 1 else "dequant+matmul" if dense_path else IMPL.gemm_config(m, n, k)
            rec = record(engine="conveyor", model="llama2-7b", precision="w4a16", model_format="awq",
                         benchmark="bench_w4a16", batch=m, layer=name, K=k, N=n, group_size=GROUP,
                         w4a16_us=t_w4, w4a16_gb_s=gbs, w4a16_tflops=flops / t_w4 / 1e6, fp16_us=t_fp16,
                         fp16_gb_s=gbs16, speedup_vs_fp16=t_fp16 / t_w4, dequant_matmul_us=t_deq,
                         rel_err=err, config=repr(cfg), impl=args.impl)
            if args.sweep:
                rec["sweep"] = sweep(m, k, n, xs, layers, ref, samples)
                ranked = sorted((r for r in rec["sweep"] if r["us"] is not None), key=lambda r: r["us"])
                for r in ranked[:3]:
                    print(f"{'':8s} {m:5d} best {r['config']} splits={r['splits']}: {r['us']:.1f} us", flush=True)
            records.append(rec)
        layers = dense = []  # free this shape's copies before the next one's
        torch.cuda.empty_cache()
    save_to(records, args.out, "bench_w4a16")


def sweep(m: int, k: int, n: int, xs: list[torch.Tensor], layers: list[tuple[torch.Tensor, ...]],
          ref: torch.Tensor, samples: int) -> list[dict]:
    """Time every candidate tile configuration of the kernel that M rows take (checked first),
    then the fastest one with other numbers of K splits than the default."""
    results = []

    def run(cfg: GemvConfig | GemmConfig | None, splits: int | None, dequant: bool = False) -> None:
        kw = {"gemv" if isinstance(cfg, GemvConfig) else "gemm": cfg, "splits": splits, "dequant": dequant}
        try:
            err = rel_err(IMPL.w4a16_matmul_triton(xs[0], *layers[0], GROUP, **kw), ref)
            us = graph_time_us([lambda i=i, layer=layer: IMPL.w4a16_matmul_triton(xs[i % 2], *layer, GROUP, **kw)
                                for i, layer in enumerate(layers)], max(5, samples // 3))
        except Exception as exc:  # noqa: BLE001 - a configuration that does not compile or fit
            print(f"    {cfg} splits={splits}: failed ({type(exc).__name__}: {str(exc)[:80]})", flush=True)
            us = err = None
        name = "dequant+matmul" if dequant else repr(cfg)
        results.append({"config": name, "splits": splits, "us": us, "rel_err": err})

    configs = sweep_configs(m)
    for cfg in configs:
        run(cfg, None)
    timed = [r for r in results if r["us"] is not None]
    if not timed:
        return results
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    # Other K splits for the fastest of each kind (GEMV, GEMM, swapped GEMM).
    kinds: dict[str, dict] = {}
    for r in timed:
        cfg = next(c for c in configs if repr(c) == r["config"])
        kind = "gemv" if isinstance(cfg, GemvConfig) else "swap" if cfg.swap else "gemm"
        if kind not in kinds or r["us"] < kinds[kind]["us"]:
            kinds[kind] = {"us": r["us"], "cfg": cfg}
    for best in kinds.values():
        cfg = best["cfg"]
        if isinstance(cfg, GemvConfig):
            unit = 4 * cfg.block_r
            auto, _ = split_k(cdiv(n // 8, cfg.block_p), k, unit, cfg.programs_per_sm * sms)
        else:
            unit = tile_k(cfg.block_k, GROUP, k)
            auto, _ = split_k(cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n), k, unit, cfg.programs_per_sm * sms,
                              min_units=4)
        for splits in sorted({1, max(1, auto // 2), 2 * auto, 3 * auto, 4 * auto} - {auto}):
            if splits <= cdiv(k, unit):
                run(cfg, splits)
    return results


if __name__ == "__main__":
    main()
