"""Where a tensor-parallel rank's steps go, for the benchmarks: per step, how long the rank's
host waited for rank 0's plan, how long it took to build and launch the step, and the step's
span on the GPU (CUDA events, which include waiting inside collectives for slower ranks).

Off unless ``EngineConfig.rank_timing_dir`` names a directory: every rank then writes
``rank<r>.json`` there when the engine closes (``summary``: per step kind, the steps and the mean
wait, host and GPU milliseconds, and the GPU's busy seconds); rank 0 through a runner step hook
(``StepHook``), ranks 1..tp-1 around each plan they follow (``tp_workers``). A rank whose host
time per step exceeds its GPU span is launch-bound, and the others wait for it in every collective.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


def alloc_retries() -> int:
    """How often torch's caching allocator found no free block, freed its cache (``cudaFree``,
    which waits for the whole device) and tried again, on the current device: a step that does
    it blocks its host until the GPU is idle, and under tensor parallel the other ranks with it."""
    return int(torch.cuda.memory_stats().get("num_alloc_retries", 0))


def busy_seconds(spans) -> float:
    """Seconds in which the GPU held some step's work: the union of the (start, end) CUDA event
    spans (all recorded on one device, ends already reached). With overlapped steps the next
    step's span opens as soon as the stream reaches it, so spans may touch or overlap; a gap
    means the GPU waited for the host."""
    spans = [(s, e) for s, e in spans if s is not e]
    if not spans:
        return 0.0
    origin = spans[0][0]
    intervals = sorted((origin.elapsed_time(s), origin.elapsed_time(e)) for s, e in spans)
    total, (lo, hi) = 0.0, intervals[0]
    for a, b in intervals[1:]:
        if a > hi:
            total += hi - lo
            lo, hi = a, b
        else:
            hi = max(hi, b)
    return (total + hi - lo) / 1e3


class RankTiming:
    """One rank's step log; ``begin``/``end`` around each followed plan, ``write`` at the stop."""

    def __init__(self, rank: int, directory: Path, device: torch.device):
        self.rank, self.path = rank, Path(directory) / f"rank{rank}.json"
        self.cuda = device.type == "cuda"
        self.steps: list[tuple[str, int, float, float]] = []  # (kind, tokens, wait s, host s)
        self.spans: list[tuple] = []
        self._start = None
        self._t0 = time.perf_counter()

    def begin(self) -> None:
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()

    def end(self, kind: str, tokens: int, wait_s: float, host_s: float) -> None:
        self.steps.append((kind, tokens, wait_s, host_s))
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.spans.append((self._start, end))

    def summary(self) -> dict:
        """Per step kind: steps, mean tokens, mean wait / host / GPU ms; the GPU's busy seconds."""
        if self.cuda:
            torch.cuda.synchronize()
        gpu_ms = [s.elapsed_time(e) for s, e in self.spans] if self.cuda else [None] * len(self.steps)
        kinds: dict[str, dict] = {}
        for (kind, tokens, wait, host), gpu in zip(self.steps, gpu_ms):
            k = kinds.setdefault(kind, {"steps": 0, "tokens": 0, "wait_ms": 0.0, "host_ms": 0.0, "gpu_ms": 0.0})
            k["steps"] += 1
            k["tokens"] += tokens
            k["wait_ms"] += wait * 1e3
            k["host_ms"] += host * 1e3
            k["gpu_ms"] += gpu or 0.0
        for k in kinds.values():
            for key in ("tokens", "wait_ms", "host_ms", "gpu_ms"):
                k[f"mean_{key}"] = k.pop(key) / k["steps"]
            if not self.cuda:
                k["mean_gpu_ms"] = None
        return {"rank": self.rank, "wall_s": time.perf_counter() - self._t0, "steps": len(self.steps),
                "gpu_busy_s": busy_seconds(self.spans) if self.cuda else None, "by_kind": kinds,
                "alloc_retries": alloc_retries() if self.cuda else None}

    def write(self) -> Path | None:
        """Save the summary; a directory that cannot be written is logged, not raised: the rank
        must still leave its process group with the others."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(self.summary(), indent=1))
        except OSError as exc:
            logger.warning("rank_timing_dir=%s: could not write %s: %s", self.path.parent, self.path.name, exc)
            return None
        return self.path


class StepHook:
    """Rank 0's side: a model-runner step hook (``runner.step_hooks``) feeding a ``RankTiming``.
    Rank 0 makes the plans, so it waits for none; its host time is the step's launch."""

    def __init__(self, timing: RankTiming):
        self.timing, self._kind, self._t = timing, "eager", 0.0

    def begin(self, graph: bool) -> None:
        self._kind, self._t = ("graph" if graph else "eager"), time.perf_counter()
        self.timing.begin()

    def end(self) -> None:
        self.timing.end(self._kind, 0, 0.0, time.perf_counter() - self._t)


def read_all(directory: Path) -> list[dict]:
    """Every rank's summary written under ``directory``, by rank."""
    return sorted((json.loads(p.read_text()) for p in Path(directory).glob("rank*.json")), key=lambda r: r["rank"])


def table(summaries: list[dict]) -> str:
    """The summaries as text lines: per rank and step kind, mean wait / host / GPU ms a step."""
    lines = ["rank kind    steps  tokens  wait ms  host ms   GPU ms   (GPU busy s, allocator retries)"]
    for s in summaries:
        for kind, k in sorted(s["by_kind"].items()):
            gpu = "-" if k["mean_gpu_ms"] is None else f"{k['mean_gpu_ms']:8.2f}"
            busy = "-" if s["gpu_busy_s"] is None else f"{s['gpu_busy_s']:.1f}"
            retries = "-" if s.get("alloc_retries") is None else s["alloc_retries"]
            lines.append(f"{s['rank']:4d} {kind:6s} {k['steps']:6d} {k['mean_tokens']:7.0f} {k['mean_wait_ms']:8.2f} "
                         f"{k['mean_host_ms']:8.2f} {gpu:>8}   ({busy}, {retries})")
    return "\n".join(lines)
