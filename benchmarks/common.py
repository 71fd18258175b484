"""What every benchmark shares: the result record, percentiles, the engine built on dummy weights."""

from __future__ import annotations

import functools
import json
import statistics
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"
RECORD_KEYS = ("engine", "gpu", "model", "precision", "model_format", "quant_policy", "tp", "benchmark", "batch",
               "input_len", "output_len", "out_tok_s", "ttft_ms", "req_s", "commit", "command")
# What every conveyor run measures until the engine runs quantized or tensor-parallel models.
ENGINE_DEFAULTS = {"model_format": "hf", "quant_policy": 0, "tp": 1}


def add_tp_arguments(ap) -> None:
    """``--tp`` and ``--tp-all-reduce``: the tensor-parallel options every engine benchmark takes."""
    from conveyor.engine.config import TP_ALL_REDUCE_KINDS

    ap.add_argument("--tp", type=int, default=1, help="tensor parallel: GPUs the model is split over")
    ap.add_argument("--tp-all-reduce", default="nccl", choices=TP_ALL_REDUCE_KINDS,
                    help="tensor parallel's path for decode-sized all-reduces (EngineConfig.tp_all_reduce)")


def tp_fields(args) -> dict[str, Any]:
    """What a record says of ``add_tp_arguments``' options: ``tp``, and the all-reduce path when
    there is one to take (tp > 1)."""
    return {"tp": args.tp, "tp_all_reduce": args.tp_all_reduce if args.tp > 1 else None}


def gpu_name() -> str:
    """The device's name, or "cpu"."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


@functools.cache  # one answer a process: record() asks at every case
def commit() -> str | None:
    """$CONVEYOR_COMMIT (set where .git is absent, e.g. on a device machine), else git's short
    HEAD, with ``-dirty`` when tracked files differ from it: a copy of a working tree can carry an
    older .git (the device machine's did: its records named the session's first commit while the
    code was two commits on), and a record must not claim a commit whose code it did not run."""
    env = os.environ.get("CONVEYOR_COMMIT")
    if env:
        return env
    here = Path(__file__).parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=here).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], capture_output=True, cwd=here).returncode
    except (OSError, subprocess.CalledProcessError):
        return None
    return f"{head}-dirty" if dirty else head


def command_line() -> str:
    """How this process was started, for the record."""
    return " ".join([f"python -m benchmarks.{Path(sys.argv[0]).stem}", *sys.argv[1:]])


def record(**fields: Any) -> dict[str, Any]:
    """A result record: every key of RECORD_KEYS (None when unused) plus any extra ones."""
    base = {k: None for k in RECORD_KEYS}
    base.update(commit=commit(), command=command_line(), gpu=gpu_name())
    if str(fields.get("engine", "")).startswith("conveyor"):
        base.update(ENGINE_DEFAULTS)
    base.update(fields)
    return base


def results_subdir() -> str:
    """results/<this>: the GPU's short name (h200, h100, ...), with xN on a machine of N GPUs, or "cpu"."""
    name = gpu_name().lower()
    kind = next((g for g in ("h200", "h100", "a100") if g in name), "cpu" if name == "cpu" else "other")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return f"{kind}x{count}" if count > 1 else kind  # a 2-GPU machine's runs: h200x2


def save(records: list[dict[str, Any]], name: str, subdir: str | None = None) -> Path:
    """Write the records to results/<subdir>/<name>.json (default: this GPU's folder) and return the path."""
    out = RESULTS_DIR / (subdir or results_subdir())
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(records, indent=1) + "\n")
    extra = os.environ.get("BENCH_OUT")  # a second copy (the device machine's $OUT)
    if extra:
        Path(extra).mkdir(parents=True, exist_ok=True)
        (Path(extra) / f"{name}.json").write_text(json.dumps(records, indent=1) + "\n")
    return path


def save_to(records: list[dict[str, Any]], out: Path | None, name: str) -> Path:
    """Write the records to ``out`` when given (an explicit path), else as :func:`save` does; print
    and return where they went."""
    if out is None:
        path = save(records, name)
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(records, indent=1) + "\n")
        path = out
    print(f"saved {path}", flush=True)
    return path


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation, or None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def random_prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    """Random token ids (skipping the first 100 ids, where special tokens usually sit)."""
    return [rng.randrange(100, vocab) for _ in range(length)]


def dummy_engine(shape: str, dtype: str = "float16", process_group: bool = False, **config: Any):
    """An LLMEngine of a published shape with seeded random weights built on the device
    (``config``: EngineConfig fields; ``process_group``: LLMEngine's, a group even at tp=1)."""
    from benchmarks.dummy_model import write_model_dir
    from conveyor.engine.config import EngineConfig
    from conveyor.engine.llm_engine import LLMEngine

    model_dir = write_model_dir(shape, Path(tempfile.gettempdir()) / f"conveyor-dummy-{shape}")
    return LLMEngine(model_dir, EngineConfig(dtype=dtype, load_format="dummy", **config), process_group=process_group)


def cuda_time_us(call: Callable[[], object], samples: int, calls: int = 1) -> float:
    """Median over ``samples`` of the mean µs per call of ``calls`` launches queued back to back
    between two CUDA events, after one warm-up call. ``calls=1`` times single eager calls (the
    host's launch work included: for the slow, multi-kernel reference paths); more calls overlap
    the launches and leave the kernels' own time."""
    call()
    torch.cuda.synchronize()
    times = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def cycle_time_us(fns: list[Callable[[], object]], rounds: int, max_reps: int = 2000) -> float:
    """Median µs per call over ``rounds`` rounds of back-to-back calls cycling through ``fns``
    (several copies of one operand rotated past the L2 cache, or one), about 20 ms a round."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(5):
        fns[i % len(fns)]()
    end.record()
    end.synchronize()
    per_call_ms = max(start.elapsed_time(end) / 5, 1e-3)
    reps = max(5, min(max_reps, int(20 / per_call_ms)))
    runs = []
    for _ in range(rounds):
        start.record()
        for i in range(reps):
            fns[i % len(fns)]()
        end.record()
        end.synchronize()
        runs.append(start.elapsed_time(end) * 1e3 / reps)
    return statistics.median(runs)


def graph_time_us(fns: list[Callable[[], object]], rounds: int, reps: int = 128) -> float:
    """Median µs per call of ``reps`` calls (cycling through ``fns``) captured in one CUDA graph
    and replayed ``rounds`` times: as decode steps run them, without launch costs."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compiles) off the capture, as torch recommends
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            fns[i % len(fns)]()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    runs = []
    for _ in range(rounds):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        runs.append(start.elapsed_time(end) * 1e3 / reps)
    return statistics.median(runs)


class StepTimer:
    """A model-runner step hook: CUDA events around each step's device work, and how many steps
    replayed a decode graph or ran eagerly. ``attach`` it to an engine's runner for a run."""

    def __init__(self) -> None:
        self.spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.graph_steps = self.eager_steps = 0

    def attach(self, engine) -> "StepTimer":
        engine.runner.step_hooks.append(self)
        return self

    def detach(self, engine) -> None:
        engine.runner.step_hooks.remove(self)

    def begin(self, graph: bool) -> None:
        if graph:
            self.graph_steps += 1
        else:
            self.eager_steps += 1
        if torch.cuda.is_available():
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self.spans.append((start, start))

    def end(self) -> None:
        if self.spans and self.spans[-1][0] is self.spans[-1][1]:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.spans[-1] = (self.spans[-1][0], end)


def drain(engine) -> None:
    """Step the engine until every request finished (untimed work: warm-ups, set-up)."""
    while engine.has_work:
        engine.step()


def default_tokenizer(path: str | None) -> str:
    """A ``--tokenizer`` argument, or the default model's directory (SmolLM2's) when it is not given."""
    if path is not None:
        return path
    from conveyor.default_model import local_path

    return str(local_path(None))


def run_batch(engine, prompts: list[list[int]], params, images: list | None = None) -> dict[str, Any]:
    """Submit every prompt at once (``params``: one SamplingParams or one per prompt; ``images``:
    each prompt's ImageInputs) and step until done: output tok/s, mean first-token latency, tokens,
    wall time, and each request's output length (``lengths``, in prompt order)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    first: dict[str, float] = {}
    counts: dict[str, int] = {}
    per_request = params if isinstance(params, list) else [params] * len(prompts)
    per_images = images or [None] * len(prompts)
    rids = [engine.add_request(p, q, images=im).request_id for p, q, im in zip(prompts, per_request, per_images)]
    while engine.has_work:
        for o in engine.step():
            if o.token is not None:
                counts[o.request_id] = counts.get(o.request_id, 0) + 1
                first.setdefault(o.request_id, time.perf_counter() - t0)
    wall = time.perf_counter() - t0
    n_out = sum(counts.values())
    return {"out_tok_s": n_out / wall, "ttft_ms": statistics.mean(first.values()) * 1e3, "out_tokens": n_out,
            "wall_s": wall, "lengths": [counts.get(r, 0) for r in rids]}
