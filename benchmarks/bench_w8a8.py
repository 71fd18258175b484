"""W8A8 kernels against fp16 cuBLAS on the Llama-2-7B projections (kernels/w8a8.py).

For each projection (K, N) and row count M:

* ``fp16``: ``x @ w.T`` through cuBLAS (``F.linear``), the baseline;
* ``triton``: the Triton int8 GEMM with its dequantizing epilogue (autotuned; the chosen tile is
  recorded), and ``int_mm``: ``torch._int_mm`` (cuBLAS, int32 out) plus the Triton epilogue
  (M > 16 only), with ``int_mm_raw``, the bare ``torch._int_mm``, to show the epilogue's cost;
* ``quant``: the per-token quantization of ``x``, and the totals ``quant + triton`` and
  ``quant + int_mm``, which are what a W8A8 layer costs in place of the fp16 GEMM.

Then RMSNorm + quantization at hidden 4096: ``rms_norm_quant`` against ``rms_norm`` followed by
``quant_per_token`` (and the same with the residual add).

Timing: CUDA events around back-to-back launches (about 20 ms per round), median of the rounds,
after a warm-up call that compiles and autotunes. Weights are rotated over enough copies to
exceed twice the L2 cache, so small-M cases read them from HBM as a real decode step does. Each
int8 path is checked against the reference (``rel_err``) before it is timed.

    python -m benchmarks.bench_w8a8                  # the full grid
    python -m benchmarks.bench_w8a8 --quick          # M in {1, 256, 2048}, fewer rounds
    python -m benchmarks.bench_w8a8 --configs        # also every MATMUL_CONFIGS tile, per case
    python -m benchmarks.bench_w8a8 --out /tmp/w8a8.json
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.common import cycle_time_us, graph_time_us, record, save_to
from conveyor.kernels import w8a8
from conveyor.kernels.rms_norm import add_rms_norm, rms_norm

SHAPES = {"qkv": (4096, 12288), "o_proj": (4096, 4096), "gate_up": (4096, 22016), "down": (11008, 4096)}  # (K, N)
ROWS = (1, 16, 64, 256, 2048, 8192)
QUICK_ROWS = (1, 256, 2048)
TARGET = 1.5  # int8 over fp16 at M >= 2048 (the tensor cores' int8 peak is ~2x fp16's)
DEVICE = "cuda"


GRAPHS = False  # --graphs: time calls replayed from a CUDA graph, as decode steps run (no launch cost)


def time_us(fns: list[Callable[[], Any]], rounds: int) -> float:
    """Median µs per call cycling through ``fns`` (replayed from a CUDA graph when GRAPHS is set)."""
    return graph_time_us(fns, rounds, reps=64) if GRAPHS else cycle_time_us(fns, rounds, max_reps=500)


def copies_for(nbytes: int) -> int:
    """How many copies of a weight make the rotation exceed twice the L2 cache."""
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20) or (50 << 20)
    return max(1, min(16, math.ceil(2 * l2 / nbytes)))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def best_config(m: int) -> str | None:
    """The tile the autotuner chose for the latest call in ``m``'s bucket."""
    tuner = w8a8._AUTOTUNED[w8a8.m_bucket(m)]
    cfg = getattr(tuner, "best_config", None)
    return None if cfg is None else str(cfg)


def bench_gemms(rows: tuple[int, ...], rounds: int, dtype: torch.dtype, sweep: bool) -> list[dict[str, Any]]:
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    records = []
    for name, (k, n) in SHAPES.items():
        w16 = [torch.randn(n, k, device=DEVICE, dtype=dtype, generator=gen) * 0.02]
        w16 += [w16[0].clone() for _ in range(copies_for(w16[0].nbytes) - 1)]
        wq, w_scale = w8a8.quant_per_token(w16[0])
        w_scale = w_scale.view(-1)
        wqs = [wq] + [wq.clone() for _ in range(copies_for(wq.nbytes) - 1)]
        for m in rows:
            x = torch.randn(m, k, device=DEVICE, dtype=dtype, generator=gen)
            xq, x_scale = w8a8.quant_per_token(x)
            ref = w8a8.int8_matmul_ref(xq, x_scale, wq, w_scale, None, dtype)
            int_mm_ok = w8a8.int_mm_problem(m, n, k) is None
            r: dict[str, Any] = {"shape": name, "K": k, "N": n, "M": m}
            r["rel_err_triton"] = rel_err(w8a8.int8_matmul_triton(xq, x_scale, wq, w_scale, None, dtype), ref)
            r["triton_config"] = best_config(m)
            r["fp16_us"] = time_us([lambda w=w: F.linear(x, w) for w in w16], rounds)
            r["quant_us"] = time_us([lambda: w8a8.quant_per_token(x)], rounds)
            r["triton_us"] = time_us(
                [lambda w=w: w8a8.int8_matmul_triton(xq, x_scale, w, w_scale, None, dtype) for w in wqs], rounds)
            r["quant_triton_us"] = r["quant_us"] + r["triton_us"]
            if int_mm_ok:
                r["rel_err_int_mm"] = rel_err(w8a8.int8_matmul_int_mm(xq, x_scale, wq, w_scale, None, dtype), ref)
                r["int_mm_us"] = time_us(
                    [lambda w=w: w8a8.int8_matmul_int_mm(xq, x_scale, w, w_scale, None, dtype) for w in wqs], rounds)
                r["int_mm_raw_us"] = time_us([lambda w=w: torch._int_mm(xq, w.t()) for w in wqs], rounds)
                r["quant_int_mm_us"] = r["quant_us"] + r["int_mm_us"]
            for path in ("triton", "int_mm"):
                if f"{path}_us" in r:
                    r[f"speedup_{path}"] = r["fp16_us"] / r[f"{path}_us"]
                    r[f"speedup_quant_{path}"] = r["fp16_us"] / r[f"quant_{path}_us"]
            r["tops_triton"] = 2 * m * n * k / r["triton_us"] / 1e6
            if sweep:
                r["configs_us"] = sweep_configs(xq, x_scale, wqs, w_scale, dtype, ref, rounds)
            records.append(r)
            print(format_gemm(r), flush=True)
        del w16, wqs
        torch.cuda.empty_cache()
    return records


def sweep_configs(xq: torch.Tensor, x_scale: torch.Tensor, wqs: list[torch.Tensor], w_scale: torch.Tensor,
                  dtype: torch.dtype, ref: torch.Tensor, rounds: int) -> dict[str, float | str]:
    """Every candidate tile of this M's bucket, timed alone (a failure is recorded, not raised)."""
    out: dict[str, float | str] = {}
    for cfg in w8a8.MATMUL_CONFIGS[w8a8.m_bucket(xq.shape[0])]:
        label = "bm{BLOCK_M}_bn{BLOCK_N}_bk{BLOCK_K}_w{num_warps}_s{num_stages}".format(**cfg)
        try:
            err = rel_err(w8a8.int8_matmul_triton(xq, x_scale, wqs[0], w_scale, None, dtype, config=cfg), ref)
            if not err < 1e-2:
                out[label] = f"wrong (rel err {err:.2e})"
                continue
            out[label] = time_us([lambda w=w: w8a8.int8_matmul_triton(xq, x_scale, w, w_scale, None, dtype, config=cfg)
                                  for w in wqs], rounds)
        except Exception as exc:  # noqa: BLE001 - a tile that does not compile or fit is a result too
            out[label] = f"failed ({type(exc).__name__})"
    return out


def format_gemm(r: dict[str, Any]) -> str:
    line = (f"{r['shape']:8s} M={r['M']:<5d} fp16 {r['fp16_us']:8.1f} us | quant {r['quant_us']:6.1f} | "
            f"triton {r['triton_us']:8.1f} ({r['speedup_triton']:.2f}x, +quant {r['speedup_quant_triton']:.2f}x, "
            f"{r['tops_triton']:.0f} TOPS)")
    if "int_mm_us" in r:
        line += (f" | int_mm {r['int_mm_us']:8.1f} ({r['speedup_int_mm']:.2f}x, "
                 f"+quant {r['speedup_quant_int_mm']:.2f}x; raw {r['int_mm_raw_us']:.1f})")
    line += f" | err {r['rel_err_triton']:.1e} {r['triton_config'] or ''}"
    if "configs_us" in r:
        timed = sorted((v, k) for k, v in r["configs_us"].items() if isinstance(v, float))
        line += "\n    " + "  ".join(f"{k}={v:.1f}" for v, k in timed)
        line += "".join(f"\n    {k}: {v}" for k, v in r["configs_us"].items() if isinstance(v, str))
    return line


def bench_norms(rows: tuple[int, ...], rounds: int, dtype: torch.dtype, hidden: int = 4096) -> list[dict[str, Any]]:
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    w = torch.randn(hidden, device=DEVICE, dtype=dtype, generator=gen)
    records = []
    for m in rows:
        x = torch.randn(m, hidden, device=DEVICE, dtype=dtype, generator=gen)
        res = torch.randn(m, hidden, device=DEVICE, dtype=dtype, generator=gen)
        r: dict[str, Any] = {"shape": "rms_norm_quant", "K": hidden, "M": m}
        r["fused_us"] = time_us([lambda: w8a8.rms_norm_quant(x, w, 1e-6)], rounds)
        r["separate_us"] = time_us([lambda: w8a8.quant_per_token(rms_norm(x, w, 1e-6))], rounds)
        r["fused_residual_us"] = time_us([lambda: w8a8.rms_norm_quant(x, w, 1e-6, res)], rounds)
        r["separate_residual_us"] = time_us([lambda: w8a8.quant_per_token(add_rms_norm(x, res, w, 1e-6)[0])], rounds)
        # Bytes the fused kernel must move: x (and residual in, residual out) at 2 bytes, codes at 1.
        r["fused_gb_s"] = m * hidden * 3 / r["fused_us"] / 1e3
        r["fused_residual_gb_s"] = m * hidden * 7 / r["fused_residual_us"] / 1e3
        records.append(r)
        print(f"rms_norm_quant M={m:<5d} fused {r['fused_us']:7.1f} us ({r['fused_gb_s']:.0f} GB/s) vs separate "
              f"{r['separate_us']:7.1f} | with residual {r['fused_residual_us']:7.1f} ({r['fused_residual_gb_s']:.0f} "
              f"GB/s) vs {r['separate_residual_us']:7.1f}", flush=True)
    return records


def recommend_int_mm_rows(records: list[dict[str, Any]]) -> int | None:
    """The smallest M from which torch._int_mm (with its epilogue) beats Triton on every shape at
    that M and every larger one measured; None if there is none."""
    by_m: dict[int, bool] = {}
    for r in records:
        if "int_mm_us" not in r:
            continue
        by_m[r["M"]] = by_m.get(r["M"], True) and r["int_mm_us"] < r["triton_us"]
    best = None
    for m in sorted(by_m, reverse=True):
        if not by_m[m]:
            break
        best = m
    return best


def summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    large = [r for r in records if r["M"] >= 2048]
    best = {}
    for r in large:
        paths = [r["speedup_quant_triton"]] + ([r["speedup_quant_int_mm"]] if "speedup_quant_int_mm" in r else [])
        best[f"{r['shape']}_M{r['M']}"] = max(paths)
    worst = min(best.values()) if best else None
    return {"recommended_INT_MM_MIN_ROWS": recommend_int_mm_rows(records), "speedup_quant_gemm_at_M_ge_2048": best,
            "worst_speedup_at_M_ge_2048": worst, "target": TARGET}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"M in {QUICK_ROWS}, 3 rounds")
    parser.add_argument("--configs", action="store_true", help="also time every MATMUL_CONFIGS tile of each case")
    parser.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16")
    parser.add_argument("--graphs", action="store_true",
                        help="time graph replays (the kernels alone, as in decode) instead of eager launches")
    parser.add_argument("--rows", type=int, nargs="*", default=None, help="row counts M (default: the grid)")
    parser.add_argument("--out", type=Path, help="write the JSON records here (default: benchmarks/results/<gpu>/)")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    dtype = getattr(torch, args.dtype)
    rows, rounds = (QUICK_ROWS, 3) if args.quick else (ROWS, 7)
    rows = tuple(args.rows) if args.rows else rows
    global GRAPHS
    GRAPHS = args.graphs
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  dtype {args.dtype}", flush=True)
    gemms = bench_gemms(rows, rounds, dtype, args.configs)
    norms = bench_norms(rows, rounds, dtype)
    verdict = summary(gemms)
    worst = verdict["worst_speedup_at_M_ge_2048"]
    worst_text = "n/a" if worst is None else f"{worst:.2f}x"
    print(f"int8 (quant + GEMM, best path) over fp16 at M >= 2048: worst {worst_text} (target {TARGET}x); "
          f"recommended INT_MM_MIN_ROWS = {verdict['recommended_INT_MM_MIN_ROWS']}", flush=True)
    common = dict(engine="kernels", model="llama2-7b", precision=f"w8a8/{args.dtype}", benchmark="bench_w8a8")
    records = [record(**common, batch=r["M"], **r) for r in gemms + norms]
    records.append(record(**common, **verdict))
    save_to(records, args.out, "bench_w8a8")


if __name__ == "__main__":
    main()
