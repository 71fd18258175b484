"""What every benchmark shares: the result record, percentiles, the engine built on dummy weights."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"
RECORD_KEYS = ("engine", "gpu", "model", "precision", "benchmark", "batch", "input_len", "output_len",
               "out_tok_s", "ttft_ms", "req_s", "commit", "command")


def gpu_name() -> str:
    """The device's name, or "cpu"."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def commit() -> str | None:
    """$CONVEYOR_COMMIT (set where .git is absent, e.g. on a device machine), else git's short HEAD."""
    env = os.environ.get("CONVEYOR_COMMIT")
    if env:
        return env
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def command_line() -> str:
    """How this process was started, for the record."""
    return " ".join([f"python -m benchmarks.{Path(sys.argv[0]).stem}", *sys.argv[1:]])


def record(**fields: Any) -> dict[str, Any]:
    """A result record: every key of RECORD_KEYS (None when unused) plus any extra ones."""
    base = {k: None for k in RECORD_KEYS}
    base.update(commit=commit(), command=command_line(), gpu=gpu_name())
    base.update(fields)
    return base


def save(records: list[dict[str, Any]], name: str, subdir: str = "h100") -> Path:
    """Write the records to results/<subdir>/<name>.json and return the path."""
    out = RESULTS_DIR / subdir
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(records, indent=1) + "\n")
    extra = os.environ.get("BENCH_OUT")  # a second copy (the device machine's $OUT)
    if extra:
        Path(extra).mkdir(parents=True, exist_ok=True)
        (Path(extra) / f"{name}.json").write_text(json.dumps(records, indent=1) + "\n")
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


def cache_size(text: str) -> float | int | str:
    """An argparse type for cache_max_entry_count: '0.8' (fraction), '2000' (blocks), '4GiB'."""
    if text.isdigit():
        return int(text)
    try:
        return float(text)
    except ValueError:
        return text


def dummy_engine(shape: str, dtype: str = "float16", **config: Any):
    """An LLMEngine of a published shape with seeded random weights built on the device."""
    from benchmarks.dummy_model import write_model_dir
    from conveyor.engine.config import EngineConfig
    from conveyor.engine.llm_engine import LLMEngine

    model_dir = write_model_dir(shape, Path(tempfile.gettempdir()) / f"conveyor-dummy-{shape}")
    return LLMEngine(model_dir, EngineConfig(dtype=dtype, load_format="dummy", **config))


def drain(engine) -> None:
    """Step the engine until every request finished (untimed work: warm-ups, set-up)."""
    while engine.has_work:
        engine.step()
