"""The fused-MoE Triton kernel against a per-expert loop of cuBLAS GEMMs (kernels/moe/).

For each expert shape (Mixtral-8x7B: H 4096, I 14336, E 8, k 2; Qwen3-30B-A3B: H 2048, I 768,
E 128, k 8) and token count M, with routing from a random router (softmax top-k, renormalised):

* ``loop``: what a framework without a grouped kernel runs: the experts in use read back to the
  host, then for each one its rows gathered, ``x @ w13[e].T`` (cuBLAS), SiLU-and-multiply,
  ``@ w2[e].T`` (cuBLAS), weighted and added into the output;
* ``fused``: ``fused_moe_triton`` (alignment + two grouped GEMMs + the sum over k), timed as
  single eager calls (host launch work included, as the loop is) and as back-to-back launches
  (``fused_kernel_us``: host launch work overlapped, where the host keeps up) and replayed from a
  CUDA graph (``fused_graph_us``: the device time alone, what a decode step pays; on the device
  machine's slow host the eager numbers of small M are host-bound).

``weight_gb_s``: the bytes of the experts in use over the graph-replayed time, against the HBM's ~4.8 TB/s
(decode is a weight stream). Each fused result is checked against the reference first (rel_err).

    python -m benchmarks.bench_moe            # the full grid, saved to results/<gpu>/bench_moe.json
    python -m benchmarks.bench_moe --quick    # M in {1, 256}

The tiles are the saved tuning's for this GPU where there is one (``benchmarks/tune_moe.py``).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks.common import cuda_time_us, record, save
from conveyor.kernels.moe import fused_moe_ref, select_experts
from conveyor.kernels.moe.launch import fused_moe_triton
from conveyor.kernels.moe.policy import moe_config

SHAPES = {
    "Mixtral-8x7B": dict(hidden=4096, inter=14336, experts=8, top_k=2),
    "Qwen3-30B-A3B": dict(hidden=2048, inter=768, experts=128, top_k=8),
}
ROWS = (1, 16, 64, 256, 2048)


def moe_loop(x, w13, w2, weights, ids):
    """The per-expert cuBLAS loop (the module doc)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    inter = w2.shape[2]
    flat = ids.reshape(-1)
    flat_w = weights.reshape(-1)
    for e in flat.unique().tolist():  # the host sync every such loop needs
        slots = (flat == e).nonzero(as_tuple=True)[0]
        rows = slots // ids.shape[1]
        gate_up = x[rows] @ w13[e].t()
        h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out.index_add_(0, rows, (h @ w2[e].t()).float() * flat_w[slots, None])
    return out.to(x.dtype)


def graph_us(call, samples: int, replays: int = 20) -> float | None:
    """Median µs per call of ``call`` captured once into a CUDA graph and replayed ``replays``
    times back to back (a decode step's cost: no host launch work), or None if capture fails."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            call()
    except RuntimeError as exc:
        print(f"capture failed: {exc}")
        return None
    return cuda_time_us(lambda: [graph.replay() for _ in range(replays)], samples) / replays


def bench_shape(model: str, s: dict, rows: tuple[int, ...], samples: int) -> list[dict]:
    """The records of one expert shape at each row count, bf16."""
    dtype = torch.bfloat16
    records = []
    g = torch.Generator(device="cuda").manual_seed(0)
    hid, inter, experts, top_k = s["hidden"], s["inter"], s["experts"], s["top_k"]
    w13 = (torch.randn(experts, 2 * inter, hid, device="cuda", generator=g) / hid**0.5).to(dtype)
    w2 = (torch.randn(experts, hid, inter, device="cuda", generator=g) / inter**0.5).to(dtype)
    for m in rows:
        x = torch.randn(m, hid, device="cuda", generator=g).to(dtype)
        logits = torch.randn(m, experts, device="cuda", generator=g)
        weights, ids = select_experts(logits, top_k, renormalize=True)
        ref = fused_moe_ref(x, w13, w2, weights, ids)
        out = fused_moe_triton(x, w13, w2, weights, ids)
        err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
        fused = cuda_time_us(lambda: fused_moe_triton(x, w13, w2, weights, ids), samples)
        fused_kernel = cuda_time_us(lambda: fused_moe_triton(x, w13, w2, weights, ids), samples, calls=10)
        graph = graph_us(lambda: fused_moe_triton(x, w13, w2, weights, ids), samples)
        loop = cuda_time_us(lambda: moe_loop(x, w13, w2, weights, ids), samples)
        used = ids.unique().numel()
        gbytes = used * 3 * hid * inter * w13.element_size() / 1e9
        cfg = moe_config(m, top_k, experts, hidden=hid, inter=inter, dtype=dtype, device=x.device)
        rec = record(
            engine="conveyor", model=model, precision="bf16", benchmark="moe_kernel", batch=m,
            hidden=hid, inter=inter, experts=experts, top_k=top_k, experts_used=used,
            fused_us=round(fused, 1), fused_kernel_us=round(fused_kernel, 1),
            fused_graph_us=graph and round(graph, 1), loop_us=round(loop, 1),
            speedup=round(loop / fused, 2), weight_gb_s=round(gbytes / ((graph or fused_kernel) * 1e-6), 1),
            rel_err=float(f"{err:.3g}"), tiles=cfg.label(), graph_speedup=graph and round(loop / graph, 2),
        )
        records.append(rec)
        print(f"{model:14s} M={m:5d} fused {fused:9.1f} us (back to back {fused_kernel:9.1f}, graph {graph or 0:8.1f})"
              f"  loop {loop:9.1f} us"
              f"  x{loop / fused:5.2f}  {rec['weight_gb_s']:7.1f} GB/s  err {err:.2g}  {rec['tiles']}",
              flush=True)
    return records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--samples", type=int, default=20)
    args = ap.parse_args()
    rows = (1, 256) if args.quick else ROWS
    records: list[dict] = []
    for model, shape in SHAPES.items():
        records += bench_shape(model, shape, rows, args.samples)
        torch.cuda.empty_cache()  # the shape's weights are gone: free them for the next
    print(save(records, "bench_moe"))


if __name__ == "__main__":
    main()
