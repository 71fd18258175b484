"""An engine factory for the served benchmark: ``LLMEngine`` with the offline benchmark's step
timer, and a timeline of what the engine held, so that served and offline runs compare step for step.

    python -m conveyor.testing.serve api_server ... --engine-factory benchmarks.timed_engine:build

``CONVEYOR_ENGINE_TIMELINE`` names the JSON file written (every 5 s and at exit; default
``$BENCH_OUT/served_engine_timeline.json``): the steps, the GPU's busy seconds over them (the
union of each step's CUDA event span, as ``profile_throughput`` reports it; at exit only, so
that the engine loop never walks every step's events while it serves) and, once a second
while there is work, the requests running and waiting, the steps and the tokens out so far; and
the first and last steps' times on the host's monotonic clock (``time.perf_counter``), which the
served benchmark's record shares (``client_cpu.start_monotonic``).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from benchmarks.common import StepTimer
from conveyor.engine.config import EngineConfig
from conveyor.engine.llm_engine import LLMEngine
from conveyor.engine.rank_timing import busy_seconds

WRITE_EVERY_S = 5.0


class TimedEngine:
    """Wraps ``step``; every other attribute is the wrapped engine's."""

    def __init__(self, engine: LLMEngine, path: Path):
        self._engine, self._path = engine, path
        self._timer = StepTimer().attach(engine)
        self._t0: float | None = None  # first step with work
        self._steps = self._tokens = 0
        self._timeline: list[dict] = []
        self._next_sample = self._next_write = self._last = 0.0

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def step(self):
        outputs = self._engine.step()
        now = time.perf_counter()
        if self._t0 is None:
            self._t0 = now
        self._steps += 1
        self._last = now
        self._tokens += sum(o.token is not None for o in outputs)
        if now >= self._next_sample:
            scheduler = self._engine.scheduler
            self._timeline.append({"t": round(now - self._t0, 3), "steps": self._steps, "tokens": self._tokens,
                                   "running": len(scheduler.running), "waiting": len(scheduler.waiting)})
            self._next_sample = now + 1.0
        if now >= self._next_write:
            self.write()
            self._next_write = now + WRITE_EVERY_S
        return outputs

    def write(self, final: bool = False) -> None:
        spans = self._timer.spans
        if final and spans and torch.cuda.is_available():
            torch.cuda.synchronize()  # every step's events have completed
            busy = busy_seconds(spans)
        else:
            busy = None
        record = {"steps": self._steps, "tokens": self._tokens, "graph_steps": self._timer.graph_steps,
                  "eager_steps": self._timer.eager_steps, "gpu_busy_s": busy,
                  "gpu_span_s": spans[0][0].elapsed_time(spans[-1][1]) / 1e3 if busy is not None else None,
                  "first_step_monotonic": self._t0, "last_step_monotonic": self._last,
                  "timeline": self._timeline}
        tmp = self._path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record) + "\n")
        tmp.replace(self._path)

    def close(self) -> None:
        self.write(final=True)
        close = getattr(self._engine, "close", None)
        if close is not None:
            close()


def build(model_path: str, config: EngineConfig) -> TimedEngine:
    """The engine factory ``conveyor.testing.serve --engine-factory benchmarks.timed_engine:build`` names."""
    default = Path(os.environ.get("BENCH_OUT", "benchmarks/results")) / "served_engine_timeline.json"
    path = Path(os.environ.get("CONVEYOR_ENGINE_TIMELINE", default))
    path.parent.mkdir(parents=True, exist_ok=True)
    return TimedEngine(LLMEngine(model_path, config), path)
