"""Summarize the stack samples of stage processes (``services/stack_sampler.py``).

    python -m benchmarks.stack_summary DIR [--top 20]

For each ``DIR/*.folded`` file and each thread in it: the wall time sampled, the frames where that
time was spent (innermost, "self") and the frames under which it was spent ("inclusive"), in
milliseconds and as a share of the thread's time.
"""

from __future__ import annotations

import argparse
from collections import Counter, defaultdict
from pathlib import Path


def read_folded(path: Path) -> dict[str, Counter[tuple[str, ...]]]:
    """thread name -> Counter of stacks (outermost first, thread name stripped) -> ms."""
    threads: dict[str, Counter[tuple[str, ...]]] = defaultdict(Counter)
    for line in path.read_text().splitlines():
        stack, _, ms = line.rpartition(" ")
        thread, *frames = stack.split(";")
        threads[thread][tuple(frames)] += float(ms)
    return threads


def summarize(stacks: Counter[tuple[str, ...]], top: int) -> list[str]:
    total = sum(stacks.values()) or 1.0
    own: Counter[str] = Counter()
    under: Counter[str] = Counter()
    for frames, ms in stacks.items():
        if frames:
            own[frames[-1]] += ms
        for frame in set(frames):
            under[frame] += ms
    lines = ["    self:"]
    lines += [f"      {ms:9.0f} ms {ms / total:6.1%}  {frame}" for frame, ms in own.most_common(top)]
    lines.append("    inclusive (frames under which less than all of the thread's time went):")
    partial = [(frame, ms) for frame, ms in under.most_common() if ms < 0.999 * total][:top]
    lines += [f"      {ms:9.0f} ms {ms / total:6.1%}  {frame}" for frame, ms in partial]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args()
    files = sorted(args.dir.glob("*.folded"))
    if not files:
        ap.error(f"no .folded files in {args.dir} (set CONVEYOR_STACK_SAMPLES for the server)")
    for path in files:
        print(path.name)
        for thread, stacks in sorted(read_folded(path).items(), key=lambda kv: -sum(kv[1].values())):
            print(f"  thread {thread}: {sum(stacks.values()) / 1e3:.1f} s sampled")
            print("\n".join(summarize(stacks, args.top)))


if __name__ == "__main__":
    main()
