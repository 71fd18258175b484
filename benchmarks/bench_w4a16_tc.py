"""The tensor-core W4A16 kernels (``kernels/w4a16/tc.py``) against the Triton ones and fp16 cuBLAS,
on Llama-2-7B projections (group 128), in the same process.

For each layer and row count M: ``tc`` (``tc_matmul``, default policy; on Hopper the warp-group
kernel from ``WG_MIN_ROWS`` rows, then ``mma us`` is the ``mma.sync`` instance it replaces), ``triton``
(``w4a16_matmul_triton``: what the layer ran before), ``fp16`` (``torch.matmul`` on the dense
weight). Timing and the weight copies that defeat the L2 are ``bench_w4a16``'s (one CUDA graph of
calls over several weight copies, median of replays). ``--sweep`` also times every compiled
instance (``tc.CONFIGS``) with the default and other K splits and prints the fastest three;
``--wg-sweep`` times every warp-group instance (``tc.WG_CONFIGS``) and split.

    python -m benchmarks.bench_w4a16_tc [--rows 1 16 64] [--layers qkv down] [--sweep | --wg-sweep] [--out PATH]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmarks.bench_w4a16 import GROUP, SHAPES, graph_time_us, layer_copies, rel_err
from benchmarks.common import record, save_to
from conveyor.kernels._triton import cdiv, sm_count
from conveyor.kernels.w4a16 import dequantize_awq_ref, w4a16_matmul_triton
from conveyor.kernels.w4a16.tc import (CONFIGS, STAGE_K, TC_DEQUANT_MIN_ROWS, WG_CONFIGS,
                                       tc_config, tc_matmul, tc_repack, tc_stages_per_split, wg_builds, wg_config,
                                       wg_matmul, wg_takes)

ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    ap.add_argument("--rows", nargs="+", type=int, default=ROWS)
    ap.add_argument("--sweep", action="store_true", help="time every compiled instance and other K splits")
    ap.add_argument("--wg-sweep", action="store_true", help="time every warp-group instance (--sweep does too)")
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_w4a16_tc needs a CUDA GPU")
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 60 * 2**20)
    sms = sm_count(torch.device("cuda", 0))
    wg = wg_builds(torch.device("cuda", 0))
    print(f"warp-group (wgmma) kernels: {'built' if wg else 'not available here'}", flush=True)
    torch.manual_seed(0)
    records = []
    print(f"{'layer':8s} {'M':>4s} {'tc us':>7s} {'GB/s':>6s} {'triton us':>9s} {'fp16 us':>8s} "
          f"{'tc/triton':>9s} {'fp16/tc':>7s} {'err':>8s}  config", flush=True)
    for name in args.layers:
        k, n = SHAPES[name]
        groups = cdiv(k, GROUP)
        w4_bytes = k * n // 2 + groups * n * 3  # codes, fp16 scales, uint8 zeros (tc's layout)
        layers = layer_copies(k, n, max(2, cdiv(3 * l2, w4_bytes)))
        tcs = [tc_repack(*layer, GROUP) for layer in layers]
        dense = [dequantize_awq_ref(*layers[i % len(layers)], GROUP, dtype=torch.float16)
                 for i in range(max(2, cdiv(3 * l2, k * n * 2)))]
        for m in args.rows:
            xs = [torch.randn(m, k, device="cuda", dtype=torch.float16) for _ in range(2)]
            ref = (xs[0].float() @ dequantize_awq_ref(*layers[0], GROUP)).half()
            err = rel_err(tc_matmul(xs[0], tcs[0]), ref)

            def time_tc(**kw) -> float:
                return graph_time_us([lambda i=i, w=w: tc_matmul(xs[i % 2], w, **kw) for i, w in enumerate(tcs)],
                                     args.samples)

            t_tc = time_tc()
            t_tri = graph_time_us([lambda i=i, layer=layer: w4a16_matmul_triton(xs[i % 2], *layer, GROUP)
                                   for i, layer in enumerate(layers)], args.samples)
            t_16 = graph_time_us([lambda i=i: torch.matmul(xs[i % 2], dense[i]) for i in range(len(dense))],
                                 args.samples)
            gbs = (w4_bytes + m * (k + n) * 2) / t_tc / 1e3
            cfg = tc_config(m, n, k)
            used, t_mma = cfg.name, None
            if m >= TC_DEQUANT_MIN_ROWS:
                used = "dequantize + cuBLAS"
            elif wg_takes(m, torch.device("cuda", 0)):
                used, t_mma = wg_config(m).name, time_tc(cfg=cfg)
            mma = f" (mma.sync {cfg.name}: {t_mma:.1f} us)" if t_mma else ""
            print(f"{name:8s} {m:4d} {t_tc:7.1f} {gbs:6.0f} {t_tri:9.1f} {t_16:8.1f} {t_tri / t_tc:9.2f} "
                  f"{t_16 / t_tc:7.2f} {err:8.1e}  {used}{mma}", flush=True)
            rec = record(engine="conveyor", model="llama2-7b", precision="w4a16", model_format="awq",
                         benchmark="bench_w4a16_tc", batch=m, layer=name, K=k, N=n, group_size=GROUP,
                         tc_us=t_tc, tc_gb_s=gbs, triton_us=t_tri, fp16_us=t_16, tc_vs_triton=t_tri / t_tc,
                         tc_vs_fp16=t_16 / t_tc, rel_err=err, config=used, mma_sync_us=t_mma)
            if wg and (args.sweep or args.wg_sweep) and m >= 8:  # every warp-group instance and split count
                for c in WG_CONFIGS:
                    if c.rows > 2 * max(m, 32):
                        continue
                    for splits in (1, 2, 4, 8):
                        e = rel_err(wg_matmul(xs[0], tcs[0], cfg=c, splits=splits), ref)
                        us = graph_time_us([lambda i=i, w=w: wg_matmul(xs[i % 2], w, cfg=c, splits=splits)
                                            for i, w in enumerate(tcs)], args.samples)
                        print(f"{'':8s} {m:4d} wg {c.name} splits={splits}: {us:.1f} us (tc {t_tc:.1f}, "
                              f"triton {t_tri:.1f}), err {e:.1e}", flush=True)
                        rec.setdefault("wg", []).append({"config": c.name, "splits": splits, "us": us, "rel_err": e})
            if args.sweep:
                rows = []
                for c in CONFIGS:
                    if n % c.n_tile or not (m <= 16 * c.m8 and 8 * c.m8 <= max(8, 2 * m)):
                        continue  # a tile that does not divide N, or rows far from M
                    tiles = n // c.n_tile * cdiv(m, 8 * c.m8)
                    auto = cdiv(k // STAGE_K, tc_stages_per_split(tiles, k, sms, c.target_per_sm))
                    for splits in sorted({auto, max(1, auto // 2), 2 * auto}):
                        if splits > k // STAGE_K:
                            continue
                        try:
                            e = rel_err(tc_matmul(xs[0], tcs[0], cfg=c, splits=splits, dequant=False), ref)
                            us = time_tc(cfg=c, splits=splits, dequant=False)
                        except Exception as exc:  # noqa: BLE001 - an instance that does not fit
                            print(f"    {c.name} splits={splits}: failed ({str(exc)[:80]})", flush=True)
                            continue
                        rows.append({"config": c.name, "splits": splits, "us": us, "rel_err": e})
                rows.sort(key=lambda r: r["us"])
                for r in rows[:3]:
                    print(f"{'':8s} {m:4d} best {r['config']} splits={r['splits']}: {r['us']:.1f} us", flush=True)
                rec["sweep"] = rows
            records.append(rec)
        layers = tcs = dense = []
        torch.cuda.empty_cache()
    save_to(records, args.out, "bench_w4a16_tc")


if __name__ == "__main__":
    main()
