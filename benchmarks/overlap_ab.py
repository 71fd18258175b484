"""A/B of overlapped steps on one engine: the same cases with ``engine.overlap`` on and off.

Each case runs ``--repeats`` times per setting, alternating on/off so that clock or thermal
drift hits both alike; the median is reported. One engine (one weight init, one graph capture)
serves both settings: the switch is read at every step.

    python -m benchmarks.overlap_ab --model llama2-7b -c 1:128:256 -c 1:2048:1 -c 64:128:128
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.common import dummy_engine, record, save
from benchmarks.profile_generation import run_case


def parse_case(text: str) -> tuple[int, int, int]:
    """'BATCH:IN:OUT' -> (BATCH, IN, OUT)."""
    b, i, o = text.split(":")
    return int(b), int(i), int(o)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama2-7b")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("-c", "--case", type=parse_case, action="append", required=True, help="BATCH:IN:OUT")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    engine = dummy_engine(args.model, args.dtype)
    records = []
    print(f"{'batch':>5} {'in':>5} {'out':>5} {'overlap':>8} | {'out tok/s':>10} {'ttft ms':>9} {'p50 ms':>7}",
          flush=True)
    for batch, input_len, output_len in args.case:
        run_case(engine, batch, input_len, min(output_len, 4), seed=1)  # warm-up: compile kernels
        runs: dict[bool, list[dict]] = {True: [], False: []}
        for i in range(args.repeats):
            for overlap in (True, False):
                engine.overlap = overlap
                runs[overlap].append(run_case(engine, batch, input_len, output_len, seed=100 + i))
        for overlap, rs in runs.items():
            med = {k: statistics.median(r[k] for r in rs) for k in ("out_tok_s", "ttft_ms")}
            p50 = [r["tpot_p50_ms"] for r in rs if r["tpot_p50_ms"] is not None]
            med["tpot_p50_ms"] = statistics.median(p50) if p50 else None
            print(f"{batch:>5} {input_len:>5} {output_len:>5} {overlap!s:>8} | {med['out_tok_s']:>10.1f} "
                  f"{med['ttft_ms']:>9.2f} {med['tpot_p50_ms'] or 0:>7.2f}", flush=True)
            records.append(record(
                engine="conveyor", model=args.model, precision=args.dtype, benchmark="overlap_ab",
                batch=batch, input_len=input_len, output_len=output_len, overlap=overlap,
                repeats=args.repeats, statistic="median", **med,
                ttft_all_ms=[r["ttft_ms"] for r in rs], out_tok_s_all=[r["out_tok_s"] for r in rs],
            ))
    engine.overlap = True
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    print(f"saved {save(records, args.name or f'overlap_ab_{args.model}')}")


if __name__ == "__main__":
    main()
