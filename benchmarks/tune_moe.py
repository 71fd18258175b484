"""Tune the fused-MoE tiles for expert shapes on this GPU and save them where ``kernels/moe/policy.py``
looks (``kernels/moe/configs/<GPU>/``), so that users never tune at start-up.

For each shape and token count M (routing from a random router, softmax top-k renormalised), every
``BLOCK_M`` that fits the rows per expert lays the pairs out once, then each candidate tile of the
gate/up kernel and of the down kernel is timed alone, replayed from a CUDA graph
(``triton.testing.do_bench_cudagraph``: device time, no host launch work, as a decode step pays
it). The saved entry is the ``BLOCK_M`` whose best gate/up plus best down time is the least.
Each winner is checked against the reference before it is saved.

    python -m benchmarks.tune_moe                       # the shapes below, bf16
    python -m benchmarks.tune_moe --shape Qwen3-30B-A3B --tokens 1 64 --quick
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import triton.testing

from benchmarks.common import commit
from conveyor.kernels.moe import fused_moe_ref, select_experts
from conveyor.kernels.moe.align import moe_align
from conveyor.kernels.moe.launch import down, fused_moe_triton, gate_up
from conveyor.kernels.moe.policy import MoeConfig, Tiles, config_path

# (experts, top_k, hidden, one rank's inter): the published shapes, at tp=1 (and tp=2 where a model
# that size is served over two GPUs).
SHAPES = {
    "Mixtral-8x7B": (8, 2, 4096, 14336),
    "Mixtral-8x7B-tp2": (8, 2, 4096, 7168),
    "Qwen3-30B-A3B": (128, 8, 2048, 768),
    "DeepSeek-V2-Lite": (64, 6, 2048, 1408),
    "Qwen1.5-MoE-A2.7B": (60, 4, 2048, 1408),
}
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def block_ms(rows_per_expert: float) -> list[int]:
    """The BLOCK_M worth trying at this many rows per expert on average."""
    out = [16]
    for bm, least in ((32, 8), (64, 24), (128, 64)):
        if rows_per_expert > least:
            out.append(bm)
    return out[-3:]


def candidate_tiles(quick: bool) -> list[Tiles]:
    ns, ks = ((64, 128), (64, 128)) if quick else ((32, 64, 128), (64, 128, 256))
    tiles = []
    for n, k, w, s in itertools.product(ns, ks, (4, 8), (3, 4)):
        if n * k > 128 * 128 or (w == 8 and n * k < 64 * 64):
            continue  # too large for shared memory at these stages / too little work for 8 warps
        tiles.append(Tiles(n, k, w, s))
    return tiles


def bench_us(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=30) * 1e3


def tune_shape(name: str, experts: int, top_k: int, hidden: int, inter: int, tokens: tuple[int, ...],
               dtype: torch.dtype, quick: bool, save) -> dict[str, dict]:
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=g) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, device="cuda", generator=g) / inter**0.5).to(dtype)
    entries: dict[str, dict] = {}
    for m in tokens:
        t0 = time.perf_counter()
        x = torch.randn(m, hidden, device="cuda", generator=g).to(dtype)
        weights, ids = select_experts(torch.randn(m, experts, device="cuda", generator=g), top_k, renormalize=True)
        pairs = m * top_k
        h = torch.randn(pairs, inter, device="cuda", generator=g).to(dtype)
        y = torch.empty(pairs, hidden, device="cuda", dtype=dtype)
        flat_w = weights.reshape(-1).contiguous()
        best: tuple[float, MoeConfig, float, float] | None = None
        for bm in block_ms(pairs / experts):
            sorted_pairs, tile_expert, _ = moe_align(ids, experts, bm)
            timed_up, timed_down = [], []
            for t in candidate_tiles(quick):
                try:
                    timed_up.append((bench_us(lambda t=t: gate_up(x, w13, h, sorted_pairs, tile_expert, top_k,
                                                                   bm, t)), t))
                    timed_down.append((bench_us(lambda t=t: down(h, w2, y, flat_w, sorted_pairs, tile_expert,
                                                                 bm, t)), t))
                except Exception as exc:  # noqa: BLE001 - a tile the compiler or the GPU refuses (out of resources)
                    print(f"  skip m{bm} {t}: {type(exc).__name__}")
            up_us, up = min(timed_up, key=lambda e: e[0])
            down_us, dn = min(timed_down, key=lambda e: e[0])
            if best is None or up_us + down_us < best[0]:
                best = (up_us + down_us, MoeConfig(bm, up, dn), up_us, down_us)
        total, cfg, up_us, down_us = best
        ref = fused_moe_ref(x, w13, w2, weights, ids)
        out = fused_moe_triton(x, w13, w2, weights, ids, config=cfg)
        err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
        assert err < 2e-2, f"{name} M={m} {cfg.label()}: relative error {err:.3g}"
        entries[str(m)] = {**cfg.to_json(), "gate_up_us": round(up_us, 2), "down_us": round(down_us, 2)}
        save(entries)  # after every token count: a run cut short keeps what it measured
        print(f"{name:18s} M={m:5d} {cfg.label():50s} gate_up {up_us:8.1f} us  down {down_us:8.1f} us"
              f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
    return entries


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", action="append", choices=sorted(SHAPES), help="default: all")
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--quick", action="store_true", help="fewer candidate tiles")
    ap.add_argument("--out-dir", help="write the files here instead of kernels/moe/configs/<GPU>/")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    gpu = torch.cuda.get_device_name()
    for name in args.shape or sorted(SHAPES):
        experts, top_k, hidden, inter = SHAPES[name]
        path = config_path(gpu, experts, top_k, hidden, inter, dtype)
        if args.out_dir:
            path = type(path)(args.out_dir) / path.parent.name / path.name
        path.parent.mkdir(parents=True, exist_ok=True)
        # Entries of token counts this run does not measure are kept.
        old = json.loads(path.read_text())["configs"] if path.is_file() else {}

        def save(entries: dict, path=path, name=name, old=old) -> None:
            merged = dict(sorted({**old, **entries}.items(), key=lambda e: int(e[0])))
            path.write_text(json.dumps({"gpu": gpu, "shape": name, "commit": commit(), "triton": triton.__version__,
                                        "configs": merged}, indent=1) + "\n")

        tune_shape(name, experts, top_k, hidden, inter, tuple(args.tokens), dtype, args.quick, save)
        print(path, flush=True)


if __name__ == "__main__":
    main()
