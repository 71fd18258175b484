"""A before/after comparison in pairs (``run_h200.sh ab``): each pair's numbers, its after/before
ratio, and the median of the ratios. A pair is two runs back to back, so slow drift of the machine
(clocks, temperature) moves both of its runs alike, and the median shrugs off one odd pair.

    python -m benchmarks.ab_summary --before b1.json b2.json --after a1.json a2.json [--key out_tok_s]

The files are the records ``profile_throughput`` saves, paired by position; a missing file (a
run cut off by its timeout) drops its pair. When a record has them, its rate over the first
seconds against the rest and its GPUs' mean SM clock are printed beside it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from statistics import median
from typing import Any


def load(path: Path) -> dict[str, Any] | None:
    """The first record of a results file, or None when the file is missing or unreadable."""
    try:
        return json.loads(path.read_text())[0]
    except (OSError, ValueError, IndexError, KeyError, TypeError):
        return None


def value(rec: dict[str, Any] | None, key: str) -> float | None:
    """The record's ``key``, None for a missing run or key."""
    return rec.get(key) if rec else None


def pair_ratio(before: float | None, after: float | None) -> float | None:
    """after / before, or None when either run is missing."""
    return after / before if after is not None and before else None


def median_ratio(pair_ratios: list[float | None]) -> float | None:
    """The median of the complete pairs' ratios, or None without one."""
    known = [r for r in pair_ratios if r is not None]
    return median(known) if known else None


def describe(rec: dict[str, Any] | None, key: str) -> str:
    """One run in a few words: the compared value, its start against the rest, its SM clock."""
    if value(rec, key) is None:
        return "missing"
    text = f"{rec[key]:.1f}"
    split = rec.get("timeline_summary")
    if split and split.get("out_tok_s_rest") is not None:
        text += f" (first {split['split_s']} s {split['out_tok_s_first']:.0f}, rest {split['out_tok_s_rest']:.0f})"
    clocks = [g["sm_mhz_mean"] for g in (rec.get("gpu_clocks") or {}).values() if g.get("sm_mhz_mean") is not None]
    if clocks:
        text += f" SM {' / '.join(f'{c:.0f}' for c in clocks)} MHz"
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=Path, nargs="+", required=True)
    ap.add_argument("--after", type=Path, nargs="+", required=True)
    ap.add_argument("--key", default="out_tok_s", help="the record's value to compare (default out_tok_s)")
    args = ap.parse_args()
    if len(args.before) != len(args.after):
        ap.error(f"{len(args.before)} --before files and {len(args.after)} --after files: give one of each per pair")
    before = [load(p) for p in args.before]
    after = [load(p) for p in args.after]
    per_pair = [pair_ratio(value(b, args.key), value(a, args.key)) for b, a in zip(before, after)]
    for i, (b, a, ratio) in enumerate(zip(before, after, per_pair), 1):
        shown = f"{ratio:.3f}" if ratio is not None else "-"
        print(f"pair {i}: before {describe(b, args.key)}; after {describe(a, args.key)}; after/before {shown}")
    med = median_ratio(per_pair)
    if med is None:
        print(f"{args.key} after/before: no complete pair")
        return
    known = [r for r in per_pair if r is not None]
    print(f"{args.key} after/before, median of {len(known)} pairs: {med:.3f} "
          f"(pairs from {min(known):.3f} to {max(known):.3f})")


if __name__ == "__main__":
    main()
